"""Exit codes of trainguard's processes (launcher, scheduler, workers), declared once.

    0    the job finished
    2    EXIT_CONFIG       bad input, or a configuration refused at start: a restart cannot help
    3    EXIT_JOB_FAILED   the scheduler ended the job as failed (its last lines name the root cause)
    75   EXIT_PREEMPTED    graceful exit: SIGTERM, SIGINT or SIGUSR1 stopped the job at a commit point and
                           the dying-gasp checkpoint was saved (if one is configured). It is EX_TEMPFAIL of
                           sysexits.h: run the same command again to resume from that checkpoint
    76   EXIT_FAULT_STOP   a worker stopped because the job stops after a fault (strategy exit or dump, or
                           restarts used up); it is a consequence, never the root cause
    78   EXIT_CONFIG_ERROR a worker's script raised a deterministic error (SyntaxError, ImportError,
                           trainguard.ConfigError; launch/worker_main.py), which a restart would only raise
                           again: the agent ends the job at once. It is EX_CONFIG of sysexits.h
    79   EXIT_DESYNC       the ranks called collectives that do not match (another operation, another shape,
                           one rank skipping a call), or made different updates (train/engine/lockstep.py): a
                           bug in the script, which a restart would meet again, so the job ends
                           (control/waits.py). trainguard's own code, outside sysexits.h
    80   EXIT_NOT_EXACT    under `--exact strict`: a step replayed after a fault differed from its first run
                           (train/engine/audit.py); the committed state's dying gasp was saved

The launcher exits with EXIT_PREEMPTED when its workers did, and otherwise with the root
cause's own exit code (1 for a signal) or 128 + N when signal N stopped it.
"""

EXIT_CONFIG = 2
EXIT_JOB_FAILED = 3
EXIT_PREEMPTED = 75
EXIT_FAULT_STOP = 76
EXIT_CONFIG_ERROR = 78  # EX_CONFIG: a deterministic error in a worker's script; never restarted
EXIT_DESYNC = 79  # the ranks called collectives that do not match: a script bug; never restarted
EXIT_NOT_EXACT = 80  # --exact strict: a replayed step differed from its first run (train/engine/audit.py)
VERDICTS = {EXIT_DESYNC: "desync: the ranks called collectives that do not match, or made different updates, a bug in "
                        "the script that a restart would meet again",
            EXIT_NOT_EXACT: "not bit-identical: a step replayed after a fault differed from its first run "
                            "(--exact strict)"}  # exit codes of verdicts on the script: never restarted
