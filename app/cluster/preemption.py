"""Preemption: save at the next step boundary, requeue, exit. Nothing heavy in the signal handler.

SLURM sends SIGUSR1 ahead of the time limit (`#SBATCH --signal=SIGUSR1@90`) and SIGTERM before it
kills a job. Lightning's own SIGUSR1 handler saves the checkpoint inside the handler, which can
hang intermittently (Lightning #21406); here the handler only sets a flag.
"""

from __future__ import annotations

import os
import signal
import subprocess
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


class Preemption(L.Callback):
    """On SIGUSR1/SIGTERM: checkpoint at the next step boundary on all ranks, requeue under SLURM, stop.

    Ranks may receive the signal at different steps (or only one rank may, with a local `kill`), so
    they agree through a one-element all-reduce per step on a CPU (gloo) group, which does not
    synchronise the GPU stream.
    """

    def __init__(self) -> None:
        self._received: int | None = None
        self._previous: dict[int, Any] = {}
        self._group: Any = None

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._received = signum

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        for signum in PREEMPTION_SIGNALS:
            self._previous[signum] = signal.signal(signum, self._on_signal)
        if dist.is_available() and dist.is_initialized() and trainer.world_size > 1:
            self._group = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else dist.group.WORLD

    def _restore_handlers(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._restore_handlers()

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._restore_handlers()

    def _anyone_signalled(self) -> bool:
        flag = torch.tensor([0 if self._received is None else 1], dtype=torch.int32)
        if self._group is not None:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
        return bool(flag.item())

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self._anyone_signalled():
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
