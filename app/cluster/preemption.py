"""Preemption: save at the next step boundary, requeue, exit. Nothing heavy in the signal handler.

SLURM sends SIGUSR1 ahead of the time limit (`#SBATCH --signal=SIGUSR1@90`) and SIGTERM before it
kills a job. Lightning's own SIGUSR1 handler saves the checkpoint inside the handler, which can
hang intermittently (Lightning #21406); here the handler only sets a flag.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from types import FrameType
from typing import Any

import lightning as L
import torch
import torch.distributed as dist

from app.errors import UserFacingError

PREEMPTION_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)
# `ddp-app fit` exits with this code when it stopped on a preemption signal after saving a checkpoint.
PREEMPTED_EXIT_CODE = 3


class Preempted(UserFacingError):
    """Training stopped on a preemption signal after writing a checkpoint to resume from."""


# Lightning 2.6 broadcasts rank 0's SIGTERM flag before every training step
# (`_TrainingEpochLoop._broadcast_sigterm_tensor`: a collective and an `.item()` per step, with no
# switch to turn it off). `Preemption` owns SIGTERM during training, so that flag is never set.
LIGHTNING_PER_STEP_SIGTERM_BROADCAST = "_broadcast_sigterm_tensor"
# An upper bound for the interval between checks, in case the steps slow down much after one.
MAX_STEPS_BETWEEN_CHECKS = 10_000


def steps_between_checks(seconds_since_check: float, steps_since_check: int, check_interval_s: float) -> int:
    """How many steps make about `check_interval_s` seconds at the pace of the last interval (>= 1)."""
    if steps_since_check < 1 or seconds_since_check <= 0:
        return 1
    seconds_per_step = seconds_since_check / steps_since_check
    return max(1, min(MAX_STEPS_BETWEEN_CHECKS, int(check_interval_s / seconds_per_step)))


class Preemption(L.Callback):
    """On SIGUSR1/SIGTERM: checkpoint at a step boundary on all ranks, requeue under SLURM, stop.

    Ranks may receive the signal at different steps (or only one rank may, with a local `kill`), so
    they agree through a two-element all-reduce on a CPU (gloo) group, which does not synchronise
    the GPU stream. It runs about once per `check_interval_s` seconds of training, not every step:
    with millisecond steps a collective per step costs more than the step itself (0.9 ms per step
    at 2 ranks on the digits MLP, docs/performance.md), while SLURM warns 90 s ahead. Each check
    also fixes the next one: every rank proposes how many steps make `check_interval_s` at its
    recent pace, and the all-reduce hands all of them the smallest proposal, so all ranks check at
    the same step. Steps longer than `check_interval_s` are checked every step.
    """

    def __init__(self, check_interval_s: float = 1.0) -> None:
        self.check_interval_s = check_interval_s
        self._received: int | None = None
        self._previous: dict[int, Any] = {}
        self._group: Any = None
        self._steps_until_check = 1
        self._steps_since_check = 0
        self._last_check = time.monotonic()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._received = signum

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        for signum in PREEMPTION_SIGNALS:
            self._previous[signum] = signal.signal(signum, self._on_signal)
        if dist.is_available() and dist.is_initialized() and trainer.world_size > 1:
            self._group = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else dist.group.WORLD
        epoch_loop = trainer.fit_loop.epoch_loop
        if hasattr(epoch_loop, LIGHTNING_PER_STEP_SIGTERM_BROADCAST):
            setattr(epoch_loop, LIGHTNING_PER_STEP_SIGTERM_BROADCAST, lambda: None)
        self._steps_until_check, self._steps_since_check = 1, 0
        self._last_check = time.monotonic()

    def _restore_handlers(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._restore_handlers()

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        # Not Lightning's handlers while the job ends: its SIGTERM handler broadcasts to the other
        # ranks, which may be gone already. After a requeue SLURM sends SIGTERM to every task; a rank
        # still on its way out then died with a gloo error instead of its preemption message. Lightning
        # puts the handlers from before `fit` back in its teardown.
        if not isinstance(exception, Preempted):
            self._restore_handlers()

    def _anyone_signalled(self) -> bool:
        """True when any rank got a signal; sets the step of the next check, the same on all ranks."""
        signalled = self._received is not None
        if self._group is None:  # one process: nobody to agree with, and a flag read costs nothing
            return signalled
        now = time.monotonic()
        proposal = steps_between_checks(now - self._last_check, self._steps_since_check, self.check_interval_s)
        # MAX of the flags, and MAX of the negated proposals = MIN of the proposals, in one collective.
        message = torch.tensor([int(signalled), -proposal], dtype=torch.int64)
        dist.all_reduce(message, op=dist.ReduceOp.MAX, group=self._group)
        self._steps_until_check = int(-message[1])
        self._steps_since_check, self._last_check = 0, now
        return bool(message[0])

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._steps_since_check += 1
        self._steps_until_check -= 1
        if self._steps_until_check > 0 or not self._anyone_signalled():
            return
        directory = Path(getattr(trainer.checkpoint_callback, "dirpath", None) or trainer.default_root_dir)
        path = directory / "last.ckpt"
        trainer.save_checkpoint(path)  # every rank takes part; rank 0 writes (atomically)
        requeued = ""
        if trainer.global_rank == 0:
            requeued = requeue_slurm_job()
        raise Preempted(
            f"preempted at global step {trainer.global_step}: saved {path}{requeued}. "
            "Resume with --ckpt_path last (the sbatch scripts in slurm/ do)."
        )


def requeue_slurm_job() -> str:
    """Ask SLURM to requeue this batch job; returns a note for the message ('' outside SLURM)."""
    job_id = os.environ.get("SLURM_ARRAY_JOB_ID") or os.environ.get("SLURM_JOB_ID")
    if not job_id or os.environ.get("SLURM_JOB_NAME") in ("bash", "interactive"):
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
