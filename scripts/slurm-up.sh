#!/usr/bin/env bash
# A one-machine Slurm cluster for tests/test_slurm.py: munged, slurmctld and slurmd on this host, from
# Debian's slurm-wlm and munge. Idempotent; needs root. `.ci/run` calls it; the tests skip, saying why,
# where the daemons are not up.
set -euo pipefail
if ! command -v slurmctld >/dev/null 2>&1; then
  timeout 600 apt-get install -y -q slurm-wlm munge >/dev/null
fi
HOST=$(hostname -s)
CPUS=$(nproc)
MEM=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 - 512 ))
mkdir -p /etc/slurm /var/spool/slurmctld /var/spool/slurmd /var/log/slurm /run/munge
cat > /etc/slurm/slurm.conf <<CONF
ClusterName=trainguard-ci
SlurmctldHost=$HOST
SlurmUser=root
AuthType=auth/munge
# a job step's credential lives 5 s (default 120): Slurm holds a requeued job until the old one expires
AuthInfo=cred_expire=5
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
ReturnToService=2
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
KillWait=30
MinJobAge=600
NodeName=$HOST CPUs=$CPUS RealMemory=$MEM State=UNKNOWN
PartitionName=ci Nodes=$HOST Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
CONF
if [ ! -s /etc/munge/munge.key ]; then mungekey --create --keyfile /etc/munge/munge.key 2>/dev/null || dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 2>/dev/null; fi
chown -R munge:munge /etc/munge /run/munge /var/lib/munge /var/log/munge 2>/dev/null || true
chmod 0400 /etc/munge/munge.key
pgrep -x munged >/dev/null || runuser -u munge -- /usr/sbin/munged
if pgrep -x slurmctld >/dev/null; then scontrol reconfigure >/dev/null 2>&1 || true; else /usr/sbin/slurmctld; fi
pgrep -x slurmd >/dev/null || /usr/sbin/slurmd
for _ in $(seq 1 30); do
  if sinfo -h -o %T 2>/dev/null | grep -Eqx '(idle|mixed|allocated)'; then echo "slurm is up on $HOST"; exit 0; fi
  pgrep -x slurmctld >/dev/null || /usr/sbin/slurmctld || true   # a stopping one may have held its port
  scontrol update nodename="$HOST" state=resume >/dev/null 2>&1 || true
  sleep 1
done
echo "slurm did not come up; see /var/log/slurm/" >&2
exit 1
