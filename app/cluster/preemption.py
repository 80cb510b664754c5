"""Stop signals: preemption (SIGUSR1/SIGTERM) and Ctrl-C (SIGINT). The handlers only set a flag.

SLURM sends SIGUSR1 ahead of the time limit (`#SBATCH --signal=SIGUSR1@90`) and SIGTERM before it
kills a job; a user presses Ctrl-C. Lightning's own SIGUSR1 handler saves the checkpoint inside the
handler, which can hang intermittently (Lightning #21406), and its Ctrl-C handling saves nothing.
Here a handler records the signal; `app.last_checkpoint.LastCheckpoint` acts on it at the next
step boundary, on every rank at the same step: it saves `last.ckpt` and raises `Stopped`.
A second Ctrl-C while that is under way ends the process at once: the previous `last.ckpt` stays
intact because checkpoints are replaced atomically (`app.checkpoints.atomic_torch_save`).
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
from types import FrameType
from typing import Any

from app.cluster.exit_codes import INTERRUPTED_EXIT_CODE, PREEMPTED_EXIT_CODE
from app.cluster.launch import with_ckpt_path_last
from app.cluster.preflight import INTERACTIVE_JOB_NAMES
from app.errors import UserFacingError

PREEMPTION_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)
STOP_SIGNALS = (*PREEMPTION_SIGNALS, signal.SIGINT)

# Lightning 2.6 broadcasts rank 0's SIGTERM flag before every training step
# (`_TrainingEpochLoop._broadcast_sigterm_tensor`: a collective and an `.item()` per step, with no
# switch to turn it off). `LastCheckpoint` owns SIGTERM during training, so that flag is never set.
LIGHTNING_PER_STEP_SIGTERM_BROADCAST = "_broadcast_sigterm_tensor"
# An upper bound for the interval between checks, in case the steps slow down much after one.
MAX_STEPS_BETWEEN_CHECKS = 10_000


class Stopped(UserFacingError):
    """Training stopped on a signal after writing a checkpoint to resume from."""

    def __init__(self, message: str, exit_code: int, is_global_zero: bool) -> None:
        super().__init__(message)
        self.exit_code = exit_code
        self.is_global_zero = is_global_zero  # every rank stops; one of them reports it


def steps_between_checks(seconds_since_check: float, steps_since_check: int, check_interval_s: float) -> int:
    """How many steps make about `check_interval_s` seconds at the pace of the last interval (>= 1)."""
    if steps_since_check < 1 or seconds_since_check <= 0:
        return 1
    seconds_per_step = seconds_since_check / steps_since_check
    return max(1, min(MAX_STEPS_BETWEEN_CHECKS, int(check_interval_s / seconds_per_step)))


def abort_now(signum: int, frame: FrameType | None) -> None:
    """A second Ctrl-C: end this process now, without saving; the previous last.ckpt is intact."""
    os.write(2, b"ddp-app: second Ctrl-C: stopped without saving; the previous last.ckpt is intact.\n")
    os._exit(INTERRUPTED_EXIT_CODE)


class StopSignalFlag:
    """Records the first stop signal; installed for the duration of training only."""

    def __init__(self) -> None:
        self.received: int | None = None
        self._previous: dict[int, Any] = {}

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGINT:
            signal.signal(signal.SIGINT, abort_now)
        if self.received is None or signum != signal.SIGINT:  # a preemption outranks Ctrl-C: it requeues
            self.received = signum

    def install(self) -> None:
        self.received = None
        for signum in STOP_SIGNALS:
            self._previous[signum] = signal.signal(signum, self._on_signal)

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()


def stop_message(signum: int, step: int, epoch: int, path: str, is_global_zero: bool) -> tuple[str, int]:
    """The one line printed after stopping on `signum`, and the exit code; rank 0 requeues under SLURM."""
    resume = resume_command(sys.argv)
    if signum == signal.SIGINT:
        return (
            f"interrupted (Ctrl-C) at global step {step} (epoch {epoch}): saved {path}. Resume with: {resume}",
            INTERRUPTED_EXIT_CODE,
        )
    requeued = requeue_slurm_job() if is_global_zero else ""
    return (
        f"preempted at global step {step} (epoch {epoch}, {signal.Signals(signum).name}): saved {path}{requeued}. "
        f"Resume with --ckpt_path last (the sbatch scripts in slurm/ do): {resume}",
        PREEMPTED_EXIT_CODE,
    )


def resume_command(argv: list[str]) -> str:
    """This command line with `--ckpt_path last` in place of any ckpt_path it had."""
    program = "ddp-app" if os.path.basename(argv[0]).startswith(("ddp-app", "__main__")) else argv[0]
    return shlex.join([program, *with_ckpt_path_last(argv[1:])])


def requeue_slurm_job() -> str:
    """Ask SLURM to requeue this batch job; returns a note for the message ('' outside SLURM)."""
    job_id = os.environ.get("SLURM_ARRAY_JOB_ID") or os.environ.get("SLURM_JOB_ID")
    if not job_id or os.environ.get("SLURM_JOB_NAME") in INTERACTIVE_JOB_NAMES:  # nothing to requeue
        return ""
    if os.environ.get("SLURM_ARRAY_TASK_ID"):
        job_id = f"{job_id}_{os.environ['SLURM_ARRAY_TASK_ID']}"
    try:
        result = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"; requeue of job {job_id} failed ({error})"
    if result.returncode != 0:
        return f"; requeue of job {job_id} failed ({result.stderr.strip()})"
    return f"; requeued SLURM job {job_id}"
