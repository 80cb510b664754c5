"""The exit codes `ddp-app` ends with, in a module that imports nothing (the launcher runs before torch)."""

# Bad input: the one-line message says what to fix. Retrying cannot help.
BAD_INPUT_EXIT_CODE = 2
# Stopped on a preemption signal (SIGUSR1/SIGTERM) after saving last.ckpt; requeued under SLURM.
PREEMPTED_EXIT_CODE = 3
# Stopped by Ctrl-C (SIGINT) after saving last.ckpt, as a shell reports a process ended by SIGINT (128 + 2).
INTERRUPTED_EXIT_CODE = 130
# Codes with which every rank stops together, at the same step, on purpose.
STOP_EXIT_CODES = (PREEMPTED_EXIT_CODE, INTERRUPTED_EXIT_CODE)
