"""Callbacks a user brings that talk to the other ranks from epoch-end hooks (tests/fault/test_callback_matrix.py).

Lightning allows both; each used to hang a ddp-app fit when it met a collective of ddp-app's own
issued from another hook, or a rank-0-only read of the metrics (issue 31).
"""

from __future__ import annotations

import threading
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


class ClampBeforeTheCopy(L.Callback):
    """A user's in-place change of a parameter between a save and the next optimizer step (a clamp in
    `on_before_optimizer_step`), on rank `rank`, made before the second save's late copy
    (`last_checkpoint.overlap_copy`) for certain: that save's write is held until the clamp is done.
    The first save is left alone, so the run has a checkpoint the failed one must not replace."""

    def __init__(self, rank: int = 1) -> None:
        self.rank = rank
        self.writes = 0
        self.clamped = threading.Event()

    def _hold(self) -> None:  # on the writer thread, as each background write starts
        self.writes += 1
        if self.writes == 2:
            self.clamped.wait(60)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        from app.checkpoints.plugin import background_writer

        writer = background_writer(trainer)
        if writer is not None and trainer.global_rank == self.rank:
            writer.before_write = self._hold

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer) -> None:
        from app.checkpoints.plugin import background_writer

        writer = background_writer(trainer)  # its write may not have reached `_hold` yet: count the saves
        second_save = writer is not None and writer.saves_started == 2
        if trainer.global_rank == self.rank and second_save and not self.clamped.is_set():
            with torch.no_grad():
                next(pl_module.parameters()).clamp_(-0.05, 0.05)
            self.clamped.set()


class DrawsAtEpochStart(L.Callback):
    """Draws from torch's global generator at each epoch's start (a random curriculum, a subset for
    the epoch) and logs the draw at every step: a run resumed at an epoch's start must draw what the
    uninterrupted run drew there."""

    def __init__(self) -> None:
        self.draw = 0.0

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.draw = float(torch.rand(()))

    def state_dict(self) -> dict[str, float]:  # the epoch's draw, for a run resumed within the epoch
        return {"draw": self.draw}

    def load_state_dict(self, state_dict: dict[str, float]) -> None:
        self.draw = state_dict["draw"]

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: object, batch: object, batch_idx: int
    ) -> None:
        pl_module.log("epoch_draw", self.draw)
