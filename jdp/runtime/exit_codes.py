"""The exit statuses of `python -m jdp.main`, one per kind of ending, so that a
launcher (launch/local.py, SLURM, Kubernetes) can tell "resume me" from "do not
retry". README.md's table lists them.
"""

FINISHED = 0  # trained to total_steps
FAILED = 1  # an unexpected error (a traceback): it may repeat, so only a bounded retry
BAD_CONFIG = 2  # a bad config, command line or input, reported before anything was written
NONFINITE = 3  # the loss or gradients went non-finite; the last good checkpoint is kept
PEER_LOST = 75  # another process died or stopped making progress: restart the job
PREEMPTED = 76  # SIGTERM or the first Ctrl-C: a checkpoint was saved; rerun to resume
INTERRUPTED = 130  # a second Ctrl-C (128 + SIGINT): stopped at once; complete checkpoints kept

# What a launcher should restart: the job was stopped from outside, not by its input.
RESTARTABLE = frozenset({PEER_LOST, PREEMPTED})
# What it must not restart: the same input fails the same way again.
PERMANENT = frozenset({BAD_CONFIG, NONFINITE})
