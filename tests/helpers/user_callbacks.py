"""Callbacks a user brings that talk to the other ranks from epoch-end hooks (tests/fault/test_callback_matrix.py).

Lightning allows both; each used to hang a ddp-app fit when it met a collective of ddp-app's own
issued from another hook, or a rank-0-only read of the metrics (issue 31).
"""

from __future__ import annotations

import time

import lightning as L
import torch


class LogsSyncedValues(L.Callback):
    """Logs a rank-dependent value with `sync_dist=True` from both epoch-end hooks: its mean over the
    ranks is reduced whenever someone first reads the metrics, on some ranks earlier than on others."""

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        pl_module.log(
            "user_train_value", torch.tensor(float(trainer.global_rank + trainer.current_epoch)), sync_dist=True
        )

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking:
            pl_module.log("user_val_value", torch.tensor(float(10 * trainer.global_rank)), sync_dist=True)


class BarrierAtEpochEnd(L.Callback):
    """Every rank waits for the others at each epoch's end (a user's own synchronisation)."""

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        trainer.strategy.barrier("user barrier at the epoch's end")


class RankZeroBarrier(L.Callback):
    """A user's bug: a barrier that only global rank 0 enters, at the first epoch's end."""

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.is_global_zero:
            trainer.strategy.barrier("rank 0 only")


class SlowRankZero(L.Callback):
    """Rank 0 busy for `seconds` at the first epoch's end (a large checkpoint written to slow storage)
    while the others go on and wait for it in the next collective."""

    def __init__(self, seconds: float = 12.0) -> None:
        self.seconds = seconds

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.is_global_zero and trainer.current_epoch == 0:
            time.sleep(self.seconds)


class SleepOnRank(L.Callback):
    """One rank slowed by `seconds` at every training step (a slower or shared host): a straggler."""

    def __init__(self, rank: int = 1, seconds: float = 0.03) -> None:
        self.rank = rank
        self.seconds = seconds

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: object, batch_idx: int
    ) -> None:
        if trainer.global_rank == self.rank:
            time.sleep(self.seconds)
