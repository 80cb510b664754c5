"""`last.ckpt` is always fresh, and every stop (preemption, Ctrl-C) saves it first.

Lightning 2.6's `save_last=True` rewrites last.ckpt only when it saved a top-k checkpoint, so with a metric that stops
improving it goes stale. ddp-app writes it itself, beside the config's ModelCheckpoints, at every epoch end, every
`every_n_seconds` (and `every_n_steps`) and at a stop signal, always at optimizer-step boundaries and on all ranks at
the same step (decided by `app.run.coordinator.RunCoordinator`)."""

from __future__ import annotations

import time
from pathlib import Path

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint

from app.checkpoints.sharded import is_checkpoint
from app.errors import InvalidConfigError

LAST_NAME = "last.ckpt"


def checkpoint_directory(trainer: L.Trainer) -> Path:
    """Where last.ckpt lives: the directory of the first ModelCheckpoint that keeps a last checkpoint, else of the first
    ModelCheckpoint, else `<default_root_dir>/checkpoints`."""
    model_checkpoints = [cb for cb in trainer.checkpoint_callbacks if isinstance(cb, ModelCheckpoint) and cb.dirpath]
    keeping_last = [cb for cb in model_checkpoints if cb.save_last]
    for callback in keeping_last or model_checkpoints:
        return Path(callback.dirpath)
    return Path(trainer.default_root_dir) / "checkpoints"


def find_last_checkpoint(trainer: L.Trainer) -> str | None:
    """What `--ckpt_path last` means: the newest `last*.ckpt` (a file or a complete sharded checkpoint) of any
    checkpoint directory, or None (a first run)."""
    directories = {checkpoint_directory(trainer)}
    directories |= {Path(cb.dirpath) for cb in trainer.checkpoint_callbacks if getattr(cb, "dirpath", None)}
    candidates = [path for directory in directories for path in directory.glob("last*.ckpt") if is_checkpoint(path)]
    return str(max(candidates, key=lambda path: path.stat().st_mtime)) if candidates else None


def agreed_last_checkpoint(trainer: L.Trainer) -> str | None:
    """`--ckpt_path last` for every rank: what global rank 0 finds, broadcast.

    Ranks looking for themselves could disagree on a network filesystem and train apart. The process group starts here,
    before `fit`: Lightning's `setup_environment` keeps one that exists (docs/private_apis.md)."""
    if trainer.world_size == 1:
        return find_last_checkpoint(trainer)
    trainer.strategy.setup_environment()
    found = find_last_checkpoint(trainer) if trainer.is_global_zero else None
    return trainer.strategy.broadcast(found, src=0)


class LastCheckpoint:
    """The `last_checkpoint:` settings of a `ddp-app` config, and the writer of last.ckpt.

    When to save is decided by `app.run.coordinator.RunCoordinator` (every save is a collective), which calls `save`.

    Args:
        every_n_seconds: save within an epoch when this much training time passed since the last
            save (0 turns the time interval off). A crash loses at most this much work.
        every_n_steps: also save every this many optimizer steps (None: no step interval).
        check_interval_s: how often the ranks compare stop signals and the time interval.
        async_save: write every checkpoint the Trainer saves during training (last.ckpt and
            ModelCheckpoints' files) in the background: a save blocks training only for a copy to host
            memory (app/checkpoints/plugin.py `BackgroundWriter`; under fsdp every rank's shards, written
            with `dcp.save` on the writer thread), whose buffers stay allocated for the next save (one host
            copy of the checkpoint: app/checkpoints/staging.py). False: wait for the disk at every save.
        overlap_copy: with async_save, copy the parameters and the optimizer state to host memory
            while the next step's forward and backward run; that step's update waits for the copy (a save
            then blocks training for the rest of the state only: docs/performance.md, "Checkpoint saves").
            Off by default, because it is only for a module whose weights change in optimizer steps alone:
            an in-place change of a parameter in between (an EMA swap, a clamp) fails that save in one
            line, but one through `.data` goes unnoticed (docs/resume.md, "Background saves").
    """

    def __init__(
        self,
        every_n_seconds: float = 300.0,
        every_n_steps: int | None = None,
        check_interval_s: float = 1.0,
        async_save: bool = True,
        overlap_copy: bool = False,
    ) -> None:
        if every_n_seconds < 0:
            raise InvalidConfigError(f"last_checkpoint.every_n_seconds must be >= 0 (0: off), got {every_n_seconds}.")
        if every_n_steps is not None and every_n_steps < 1:
            raise InvalidConfigError(f"last_checkpoint.every_n_steps must be >= 1 or null, got {every_n_steps}.")
        if check_interval_s < 0:
            raise InvalidConfigError(f"last_checkpoint.check_interval_s must be >= 0, got {check_interval_s}.")
        self.every_n_seconds = every_n_seconds
        self.every_n_steps = every_n_steps
        self.check_interval_s = check_interval_s
        if overlap_copy and not async_save:
            raise InvalidConfigError(
                "last_checkpoint.overlap_copy: true needs last_checkpoint.async_save: true (the copy is made "
                "while the next step runs, and the write after it). Fix: set both, or neither."
            )
        self.async_save = async_save
        self.overlap_copy = overlap_copy
        self.dirpath: str | None = None
        self.last_model_path = ""
        # True while last.ckpt is written: the save `--ckpt_path last` resumes from, unlike a ModelCheckpoint's step-N
        # or best-k file (app/tracking/run.py settles values on it only).
        self.saving = False
        self.saved_step = -1
        self.last_save = time.monotonic()

    def start(self, trainer: L.Trainer) -> None:
        """At training start: a resumed run starts from a checkpoint of this very step."""
        self.saved_step = trainer.global_step
        self.last_save = time.monotonic()

    def interval_due(self, now: float) -> bool:
        """Whether this rank's time interval since the last save has passed."""
        return self.every_n_seconds > 0 and now - self.last_save >= self.every_n_seconds

    def step_due(self, global_step: int) -> bool:
        return self.every_n_steps is not None and global_step % self.every_n_steps == 0

    def save(self, trainer: L.Trainer) -> None:
        """Every rank calls it at the same point; rank 0 writes the file (atomically)."""
        path = Path(self.dirpath or checkpoint_directory(trainer)) / LAST_NAME
        self.last_model_path = str(path)
        self.saving = True
        try:
            trainer.save_checkpoint(path, weights_only=False)
        finally:
            self.saving = False
        self.saved_step = trainer.global_step
        self.last_save = time.monotonic()
