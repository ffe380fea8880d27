#!/bin/bash
# Start a data-parallel job by hand, MindSpore style (reference 000, run.sh): N workers and one
# scheduler, each a plain `python digits.py` configured by environment variables only.
#
#     bash examples/run.sh                          # 2 workers, scheduler on 127.0.0.1:8118
#     WORKERS=4 SCHED_PORT=9000 ARGS="--epochs 3" bash examples/run.sh
#
# Logs go to ./device/worker_$i.log and ./device/scheduler.log, process ids to ./device/*.pid
# (relative to the directory you run it from). If a process dies, bring it back with
# examples/recover.sh (same environment): `bash examples/recover.sh worker 1` or
# `bash examples/recover.sh scheduler`. Training resumes without restarting the survivors.
set -u
EXAMPLES_DIR=$(cd "$(dirname "$0")" && pwd)
PYTHON=${PYTHON:-python}
WORKER_NUM=${WORKERS:-2}
SCHED_PORT=${SCHED_PORT:-8118}
ARGS=${ARGS:-}

export MS_ENABLE_RECOVERY=1                # Enable disaster recovery
export MS_RECOVERY_PATH=./recovery/        # Set the disaster recovery file save path
export OMP_NUM_THREADS=1
export PYTHONUNBUFFERED=1
if [ -n "${TG_HEARTBEAT_TIMEOUT:-}" ]; then
    export TG_HEARTBEAT_TIMEOUT            # Seconds without a heartbeat before a worker is declared dead
fi

rm -rf device
mkdir device
echo "start training"

# Loop start of $WORKER_NUM Worker training processes
for ((i = 0; i < WORKER_NUM; i++)); do
    export MS_WORKER_NUM=$WORKER_NUM    # Set the number of Worker processes in the cluster
    export MS_SCHED_HOST=127.0.0.1      # Set the Scheduler IP address to the local loop address
    export MS_SCHED_PORT=$SCHED_PORT    # Set the Scheduler Port
    export MS_ROLE=MS_WORKER            # Set the startup process to MS_WORKER role
    export MS_NODE_ID=$i                # Set the process id, optional
    # shellcheck disable=SC2086  # ARGS is split into words on purpose
    "$PYTHON" "$EXAMPLES_DIR/digits.py" --ckpt-dir ./ckpt_of_rank $ARGS > device/worker_$i.log 2>&1 &   # Start training scripts
    echo $! > device/worker_$i.pid
done

# Start 1 Scheduler process
export MS_WORKER_NUM=$WORKER_NUM        # Set the number of Worker processes in the cluster
export MS_SCHED_HOST=127.0.0.1          # Set the Scheduler IP address to the local loop address
export MS_SCHED_PORT=$SCHED_PORT        # Set the Scheduler Port
export MS_ROLE=MS_SCHED                 # Set the startup process to MS_SCHED role
unset MS_NODE_ID
# shellcheck disable=SC2086
"$PYTHON" "$EXAMPLES_DIR/digits.py" --ckpt-dir ./ckpt_of_rank $ARGS > device/scheduler.log 2>&1 &    # Start training scripts
echo $! > device/scheduler.pid
