"""The exit codes `ddp-app` ends with, in a module that imports nothing (the launcher runs before torch)."""

# Bad input: the one-line message says what to fix. Retrying cannot help.
BAD_INPUT_EXIT_CODE = 2
# This rank stopped because another rank died or was lost (its one-line report says so): not this rank's input, so a
# restart or a requeue may succeed. Below 2 would be ambiguous with a crash; above 2 it is its own case in the logs.
PEER_LOST_EXIT_CODE = 4
# Stopped on a preemption signal (SIGUSR1/SIGTERM) after saving last.ckpt; requeued under SLURM.
PREEMPTED_EXIT_CODE = 3
# Stopped by Ctrl-C (SIGINT) after saving last.ckpt, as a shell reports a process ended by SIGINT (128 + 2).
INTERRUPTED_EXIT_CODE = 130
# A collective timed out and this rank named the rank that did not arrive (`app.cluster.hangs`).
HANG_EXIT_CODE = 5
# Codes with which every rank stops together, at the same step, on purpose.
STOP_EXIT_CODES = (PREEMPTED_EXIT_CODE, INTERRUPTED_EXIT_CODE)
