"""`last.ckpt` is always fresh, and every stop (preemption, Ctrl-C) saves it first.

Lightning 2.6's `ModelCheckpoint(save_last=True)` rewrites last.ckpt only in a step where it saved a
top-k checkpoint ("Only save last checkpoint if a checkpoint was actually saved",
`ModelCheckpoint.on_validation_end`): with a monitored metric that stops improving, last.ckpt goes
stale and `--ckpt_path last` after a crash silently redoes every epoch since the best one. So
`ddp-app` writes last.ckpt itself, beside whatever ModelCheckpoints the config has (their best-k
selection is untouched), into the directory of the first one that keeps a last checkpoint:

- at the end of every training epoch (after validation, so the best-k state is current);
- every `every_n_seconds` of training (and every `every_n_steps` steps, if set) within an epoch;
- at the step where a preemption signal or Ctrl-C arrived, and then training stops (a preemption
  during setup, recorded since the rank started, stops training before its first step: nothing new
  to save).

A crash can therefore lose at most the work since the later of the last epoch end and the last
interval. Saves happen only at optimizer-step boundaries (never between accumulated micro-batches,
whose summed gradients a checkpoint does not hold), and all ranks save at the same step: the ranks
agree on signals and on a due time-interval save through one small all-reduce about once per
second (`check_interval_s`) on a CPU group, not through a collective per step.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Checkpoint, ModelCheckpoint

from app.cluster.preemption import (
    LIGHTNING_PER_STEP_SIGTERM_BROADCAST,
    STOP_SIGNAL_FLAG,
    STOP_SIGNALS,
    Stopped,
    steps_between_checks,
    stop_message,
)
from app.errors import InvalidConfigError
from app.private_apis import require

LAST_NAME = "last.ckpt"


def checkpoint_directory(trainer: L.Trainer) -> Path:
    """Where last.ckpt lives: the directory of the first ModelCheckpoint that keeps a last
    checkpoint, else of the first ModelCheckpoint, else `<default_root_dir>/checkpoints`."""
    model_checkpoints = [cb for cb in trainer.checkpoint_callbacks if isinstance(cb, ModelCheckpoint) and cb.dirpath]
    keeping_last = [cb for cb in model_checkpoints if cb.save_last]
    for callback in keeping_last or model_checkpoints:
        return Path(callback.dirpath)
    return Path(trainer.default_root_dir) / "checkpoints"


def find_last_checkpoint(trainer: L.Trainer) -> str | None:
    """What `--ckpt_path last` means: the newest `last*.ckpt` of any checkpoint directory, or None.

    Lightning resolves "last" only among ModelCheckpoints' directories, and warns when there is
    none yet; None here means a first run, which starts fresh.
    """
    directories = {checkpoint_directory(trainer)}
    directories |= {Path(cb.dirpath) for cb in trainer.checkpoint_callbacks if getattr(cb, "dirpath", None)}
    candidates = [path for directory in directories for path in directory.glob("last*.ckpt") if path.is_file()]
    return str(max(candidates, key=lambda path: path.stat().st_mtime)) if candidates else None


def agreed_last_checkpoint(trainer: L.Trainer) -> str | None:
    """`--ckpt_path last` for every rank: what global rank 0 finds (`find_last_checkpoint`).

    Ranks that looked for themselves could disagree: on a network filesystem each node may see other
    modification times (attribute caching) or a last.ckpt being replaced, and ranks that resume from
    different checkpoints train apart without an error. So rank 0's answer is broadcast over the
    strategy's process group, which starts here rather than inside `fit`: Lightning's
    `setup_environment` keeps a process group that exists (docs/private_apis.md).
    """
    if trainer.world_size == 1:
        return find_last_checkpoint(trainer)
    trainer.strategy.setup_environment()
    found = find_last_checkpoint(trainer) if trainer.is_global_zero else None
    return trainer.strategy.broadcast(found, src=0)


class LastCheckpoint(Checkpoint):
    """Writes `<checkpoint directory>/last.ckpt` at every epoch end, on an interval, and on a stop signal.

    Configured under the top-level `last_checkpoint:` key of a `ddp-app` config.

    Args:
        every_n_seconds: save within an epoch when this much training time passed since the last
            save (0 turns the time interval off). A crash loses at most this much work.
        every_n_steps: also save every this many optimizer steps (None: no step interval).
        check_interval_s: how often the ranks compare stop signals and the time interval.
    """

    def __init__(
        self, every_n_seconds: float = 300.0, every_n_steps: int | None = None, check_interval_s: float = 1.0
    ) -> None:
        if every_n_seconds < 0:
            raise InvalidConfigError(f"last_checkpoint.every_n_seconds must be >= 0 (0: off), got {every_n_seconds}.")
        if every_n_steps is not None and every_n_steps < 1:
            raise InvalidConfigError(f"last_checkpoint.every_n_steps must be >= 1 or null, got {every_n_steps}.")
        self.every_n_seconds = every_n_seconds
        self.every_n_steps = every_n_steps
        self.check_interval_s = check_interval_s
        self.dirpath: str | None = None
        self.last_model_path = ""
        # True while last.ckpt is written: the save `--ckpt_path last` resumes from, unlike a
        # ModelCheckpoint's step-N or best-k file (app/tracking/run.py settles values on it only).
        self.saving = False
        self._signals = STOP_SIGNAL_FLAG
        self._taken_signals: tuple[int, ...] = ()  # those the flag handles since on_train_start, not before
        self._group: Any = None
        self._steps_until_check = 1
        self._steps_since_check = 0
        self._last_check = time.monotonic()
        self._last_save = time.monotonic()
        self._saved_step = -1
        self._step_at_previous_batch = -1
        self._pending: tuple[int, bool] = (0, False)  # (stop signal, interval save due) agreed, not yet done
        self._stop_due = 0  # a stop signal: training stops at the next hook, after the save
        self._save_due = False  # a save decided at a step's end, done at the next hook
        self._stop_at: tuple[int, int] | None = None  # (step, epoch) of a stop agreed at an epoch's end

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self.dirpath is None:
            self.dirpath = str(checkpoint_directory(trainer))

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # `app.entry.run` recorded SIGUSR1 and SIGTERM since the rank started; Ctrl-C is recorded from here on.
        self._taken_signals = self._signals.install(STOP_SIGNALS)
        if dist.is_available() and dist.is_initialized() and trainer.world_size > 1:
            self._group = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else dist.group.WORLD
        epoch_loop = trainer.fit_loop.epoch_loop
        # Private (docs/private_apis.md): without it every step would still run Lightning's broadcast,
        # so a Lightning without it stops here in one line rather than train with a collective per step.
        require(epoch_loop, LIGHTNING_PER_STEP_SIGTERM_BROADCAST, "lightning", "last.ckpt's stop signals")
        setattr(epoch_loop, LIGHTNING_PER_STEP_SIGTERM_BROADCAST, lambda: None)
        now = time.monotonic()
        self._steps_until_check, self._steps_since_check, self._last_check, self._last_save = 1, 0, now, now
        # A resumed run starts from a checkpoint of this very step: nothing new to save yet.
        self._saved_step = self._step_at_previous_batch = trainer.global_step
        self._pending = (0, False)
        self._stop_due = 0
        self._save_due = False
        self._stop_at = None
        # A signal during setup (data, rendezvous, sanity check) stops every rank here, together,
        # with nothing new to save: last.ckpt, if any, is the state training would start from.
        signum, _ = self._agree()
        if signum:
            self._stop(trainer, signum, saved=False)

    def _agree(self) -> tuple[int, bool]:
        """(stop signal any rank got or 0, whether any rank's save interval is due); the same on all
        ranks. Also fixes the step of the next check, the smallest any rank proposes."""
        now = time.monotonic()
        signum = self._signals.received or 0
        due = self.every_n_seconds > 0 and now - self._last_save >= self.every_n_seconds
        proposal = steps_between_checks(now - self._last_check, self._steps_since_check, self.check_interval_s)
        self._steps_since_check, self._last_check = 0, now
        if self._group is None:  # one process: nobody to agree with
            self._steps_until_check = proposal
            return signum, due
        # MAX of the signals and flags, MAX of the negated proposals = MIN of the proposals: one collective.
        message = torch.tensor([signum, int(due), -proposal], dtype=torch.int64)
        dist.all_reduce(message, op=dist.ReduceOp.MAX, group=self._group)
        self._steps_until_check = int(-message[2])
        return int(message[0]), bool(message[1])

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._steps_since_check += 1
        self._steps_until_check -= 1
        if self._steps_until_check <= 0:
            signum, due = self._agree()
            self._pending = (max(self._pending[0], signum), self._pending[1] or due)
        stepped = trainer.global_step != self._step_at_previous_batch
        self._step_at_previous_batch = trainer.global_step
        if not stepped:  # between accumulated micro-batches: the gradients so far are in no checkpoint
            return
        signum, due = self._pending
        step_due = self.every_n_steps is not None and trainer.global_step % self.every_n_steps == 0
        if signum or due or step_due:
            self._pending = (0, False)
            # Saved at the next hook, after Lightning has logged this step's metrics (it does so after
            # on_train_batch_end) and nothing else has run: the checkpoint never holds a step whose log
            # row a kill during the save could lose. A stop signal stops right after that save.
            self._save_due = True
        if signum:
            self._stop_due = signum

    def _save_and_stop_if_due(self, trainer: L.Trainer) -> None:
        if self._save_due:
            self._save_due = False
            self._save(trainer)
        if self._stop_due:
            self._stop(trainer, self._stop_due)

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._save_and_stop_if_due(trainer)

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking:
            self._save_and_stop_if_due(trainer)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._save_due = False  # the epoch-end save below supersedes a step save still due
        signum, _ = self._agree()  # all ranks are here together: a good moment to compare signals
        signum = max(signum, self._pending[0], self._stop_due)
        self._pending = (0, False)
        # Always, even right after an interval save at the last batch: validation and the epoch's end
        # have changed the state since (best-k, epoch counters), and a resume starts the next epoch.
        self._save(trainer)
        if signum:
            # Stopped at the next hook (the next epoch's start, or the end of training), not here:
            # Lightning logs the epoch's `on_epoch=True` values (train_acc, ...) after this hook, and
            # a resume from this checkpoint starts the next epoch, which never logs them again.
            self._stop_due = signum
            self._stop_at = (trainer.global_step, trainer.current_epoch)

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._stop_due:  # agreed at the previous epoch's end, after its save
            self._stop(trainer, self._stop_due)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._stop_due:  # the signal came at the run's last step: saved, and nothing left to stop
            self._save_and_stop_if_due(trainer)
        # A stop signal from here on is recorded and left alone: training is over and last.ckpt saved.
        self._signals.restore(self._taken_signals)
        if trainer.global_step != self._saved_step:  # stopped mid-epoch by max_steps or max_time
            self._save(trainer)

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        # Keep the flag-only handlers while a stopped job exits: after a requeue SLURM sends SIGTERM to
        # every task, which must not end a rank midway (under `app.entry.run` they stay until the exit).
        if not isinstance(exception, Stopped):
            self._signals.restore(self._taken_signals)

    def _save(self, trainer: L.Trainer) -> None:
        path = Path(self.dirpath or checkpoint_directory(trainer)) / LAST_NAME
        self.last_model_path = str(path)
        self.saving = True
        try:
            trainer.save_checkpoint(path, weights_only=False)  # every rank takes part; rank 0 writes (atomically)
        finally:
            self.saving = False
        self._saved_step = trainer.global_step
        self._last_save = time.monotonic()

    def _stop(self, trainer: L.Trainer, signum: int, saved: bool = True) -> None:
        path = self.last_model_path if saved else None
        step, epoch = self._stop_at or (trainer.global_step, trainer.current_epoch)
        message, exit_code = stop_message(signum, step, epoch, path, trainer.is_global_zero)
        raise Stopped(message, exit_code, trainer.is_global_zero)
