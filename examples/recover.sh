#!/bin/bash
# Bring one process of an examples/run.sh job back after it died, MindSpore style (reference 000,
# recover.sh). Run it from the same directory as run.sh, with the same WORKERS/SCHED_PORT/ARGS:
#
#     bash examples/recover.sh scheduler        # restart the scheduler (it reloads ./recovery/cluster.db)
#     bash examples/recover.sh worker 1         # restart worker 1 (it rejoins under node id 1)
#
# The output is appended to the process's log in ./device/. Unlike MindSpore there is no 30 s wait
# before a worker may come back: the scheduler re-admits the node id as soon as the old process is
# known dead.
set -u
EXAMPLES_DIR=$(cd "$(dirname "$0")" && pwd)
PYTHON=${PYTHON:-python}
WORKER_NUM=${WORKERS:-2}
SCHED_PORT=${SCHED_PORT:-8118}
ARGS=${ARGS:-}

usage() {
    echo "usage: bash $0 scheduler | worker <node id 0..$((WORKER_NUM - 1))>" >&2
    exit 2
}

export MS_ENABLE_RECOVERY=1                # Enable disaster recovery
export MS_RECOVERY_PATH=./recovery/        # Set the disaster recovery file save path
export OMP_NUM_THREADS=1
export PYTHONUNBUFFERED=1
if [ -n "${TG_HEARTBEAT_TIMEOUT:-}" ]; then
    export TG_HEARTBEAT_TIMEOUT
fi
export MS_WORKER_NUM=$WORKER_NUM           # Set the number of Worker processes in the cluster
export MS_SCHED_HOST=127.0.0.1             # Set the Scheduler IP address to the local loop address
export MS_SCHED_PORT=$SCHED_PORT           # Set the Scheduler Port

case "${1:-}" in
    scheduler | sched)
        export MS_ROLE=MS_SCHED            # Set the startup process to MS_SCHED role
        export MS_NODE_ID=sched            # Set this node Node ID to 'sched'
        name=scheduler
        ;;
    worker)
        id=${2:-}
        if ! [[ "$id" =~ ^[0-9]+$ ]] || [ "$id" -ge "$WORKER_NUM" ]; then
            usage
        fi
        export MS_ROLE=MS_WORKER           # Set the startup process to MS_WORKER role
        export MS_NODE_ID=$id              # The same node id as the process that died
        name=worker_$id
        ;;
    *)
        usage
        ;;
esac

mkdir -p device
echo "restarting $name"
# shellcheck disable=SC2086  # ARGS is split into words on purpose
"$PYTHON" "$EXAMPLES_DIR/digits.py" --ckpt-dir ./ckpt_of_rank $ARGS >> device/$name.log 2>&1 &   # Start training scripts
echo $! > device/$name.pid
