"""Stop signals: preemption (SIGUSR1/SIGTERM) and Ctrl-C (SIGINT). The handlers only set a flag.

Lightning's SIGUSR1 handler saves inside the handler, which can hang (Lightning #21406), and its Ctrl-C saves nothing.
`app.run.coordinator.RunCoordinator` acts on the flag at the next step boundary on every rank: it saves `last.ckpt` and
raises `Stopped`. A second Ctrl-C exits at once; the previous `last.ckpt` stays intact (atomic writes)."""

from __future__ import annotations

import os
import shlex
import signal
import sys
from types import FrameType
from typing import Any

from app.cluster.exit_codes import INTERRUPTED_EXIT_CODE, PREEMPTED_EXIT_CODE
from app.cluster.launch import with_ckpt_path_last
from app.cluster.requeue import requeue_slurm_job
from app.errors import UserFacingError
from app.private_apis import require

PREEMPTION_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)
STOP_SIGNALS = (*PREEMPTION_SIGNALS, signal.SIGINT)

# Lightning 2.6 broadcasts rank 0's SIGTERM flag before every training step
# (`_TrainingEpochLoop._broadcast_sigterm_tensor`: a collective and an `.item()` per step, with no switch to turn it
# off). `RunCoordinator` owns SIGTERM during training, so that flag is never set.
LIGHTNING_PER_STEP_SIGTERM_BROADCAST = "_broadcast_sigterm_tensor"
# Lightning 2.6's method that installs its signal handlers; `keep_lightning_off_stop_signals` replaces it.
LIGHTNING_SIGNAL_HANDLER_INSTALL = "register_signal_handlers"
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
    """Records the first stop signal a process gets; `STOP_SIGNAL_FLAG` is this process's.

    `app.cli.entry.run` installs it for SIGUSR1 and SIGTERM as a rank starts (a preemption during setup is recorded, not
    fatal); `RunCoordinator` adds SIGINT at train start."""

    def __init__(self) -> None:
        self.received: int | None = None
        self._previous: dict[int, Any] = {}

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGINT:
            signal.signal(signal.SIGINT, abort_now)
        if self.received is None or signum != signal.SIGINT:  # a preemption outranks Ctrl-C: it requeues
            self.received = signum

    def install(self, signums: tuple[int, ...] = STOP_SIGNALS) -> tuple[int, ...]:
        """Handle `signums` with the flag; returns those it was not handling yet (give them back with `restore`). The
        first install after a full restore starts a fresh record."""
        if not self._previous:
            self.received = None
        taken = tuple(signum for signum in signums if signum not in self._previous)
        for signum in taken:
            self._previous[signum] = signal.signal(signum, self._on_signal)
        return taken

    def restore(self, signums: tuple[int, ...] | None = None) -> None:
        """Give `signums` (default: all) back to the handlers they had before `install`."""
        for signum in list(self._previous) if signums is None else signums:
            if signum in self._previous:
                signal.signal(signum, self._previous.pop(signum))

    def release(self) -> None:
        """For a run that will never act on the flag (not `fit`, or no last.ckpt to save): restore the handlers, and
        deliver a signal recorded meanwhile to them, as if the flag had never been there."""
        received = self.received
        self.restore()
        self.received = None
        if received is not None:
            signal.raise_signal(received)


STOP_SIGNAL_FLAG = StopSignalFlag()  # signal handlers belong to the process: one flag per process


def keep_lightning_off_stop_signals(trainer: Any) -> None:
    """Lightning installs no signal handler for this Trainer; ddp-app's flag-only ones stay in place.

    Lightning 2.6's SIGTERM handler (`_SignalConnector.register_signal_handlers`) calls `dist.broadcast` inside the
    handler, which hangs on the one rank that got the signal, and then exits 0, untrained. Private
    (docs/private_apis.md); tests/test_private_apis.py fails if a Lightning upgrade changes it."""
    needed_for = "keeping Lightning's SIGTERM handler off a fit"
    connector = require(trainer, "_signal_connector", "lightning", needed_for)
    require(connector, LIGHTNING_SIGNAL_HANDLER_INSTALL, "lightning", needed_for)
    setattr(connector, LIGHTNING_SIGNAL_HANDLER_INSTALL, lambda: None)


def stop_message(signum: int, step: int, epoch: int, path: str | None, is_global_zero: bool) -> tuple[str, int]:
    """The one line printed after stopping on `signum`, and the exit code; rank 0 requeues under SLURM. `path` is where
    last.ckpt was saved; None when training had not started (nothing new to save)."""
    resume = resume_command(sys.argv)
    if path is None:
        when, details, saved = "before training started", [], "nothing new to save"
    else:
        when, details, saved = f"at global step {step}", [f"epoch {epoch}"], f"saved {path}"
    if signum == signal.SIGINT:
        when += f" ({details[0]})" if details else ""
        return f"interrupted (Ctrl-C) {when}: {saved}. Resume with: {resume}", INTERRUPTED_EXIT_CODE
    requeued = requeue_slurm_job() if is_global_zero else ""
    when += f" ({', '.join([*details, signal.Signals(signum).name])})"
    return (
        f"preempted {when}: {saved}{requeued}. "
        f"Resume with --ckpt_path last (the sbatch scripts in slurm/ do): {resume}",
        PREEMPTED_EXIT_CODE,
    )


def resume_command(argv: list[str]) -> str:
    """This command line with `--ckpt_path last` in place of any ckpt_path it had."""
    program = "ddp-app" if os.path.basename(argv[0]).startswith(("ddp-app", "__main__")) else argv[0]
    return shlex.join([program, *with_ckpt_path_last(argv[1:])])
