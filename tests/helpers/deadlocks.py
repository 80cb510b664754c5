"""User bugs that deadlock the ranks, and a rank that is only slow (tests/fault/test_hangs.py).

The deadlock test times the report from the moment of the mismatch, which it reads from the
ranks' flight recorders in the hang directory: nothing here needs to mark the moment.
"""

from __future__ import annotations

import time
from typing import Any

import lightning as L
import torch

from tests.helpers.hangs import OnceAtStep, mark_injected


class ExtraSyncedValue(L.Callback):
    """Lightning #19106's shape: rank 0 logs one more `sync_dist=True` value than the other ranks
    (`if trainer.is_global_zero: self.log(..., sync_dist=True)`), once, from `hook`:

    - `step`: at the end of step `at_step`, a per-step value, which Lightning reduces inside `log`
      (a barrier, then an all-reduce): the barrier meets the others' next gradient all-reduce, and hangs;
    - `train`, `validation`: at the first epoch's end, a per-epoch value next to one every rank logs,
      reduced when the metrics are next read. On gloo its barrier meets the others' next collective
      and completes, and its all-reduce aborts the process ("Received data size doesn't match").
    """

    def __init__(self, hook: str = "step", at_step: int = 5) -> None:
        self.hook = hook
        self.at_step = at_step

    def _log_epoch_values(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        pl_module.log("shared_value", torch.tensor(1.0), sync_dist=True)
        if trainer.is_global_zero and trainer.current_epoch == 0:
            pl_module.log("rank_zero_value", torch.tensor(2.0), sync_dist=True)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if self.hook == "step" and trainer.is_global_zero and trainer.global_step == self.at_step:
            pl_module.log("rank_zero_value", torch.tensor(2.0), on_step=True, on_epoch=False, sync_dist=True)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.hook == "train":
            self._log_epoch_values(trainer, pl_module)

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.hook == "validation" and not trainer.sanity_checking:
            self._log_epoch_values(trainer, pl_module)


class SlowStepOnce(OnceAtStep):
    """Rank `rank` sleeps `seconds` once, at the start of step `at_step` (a long data load, a slow
    host), while the other ranks go on to that step's gradient all-reduce and wait for it there:
    the same collective, reached late. Writes `<marker_dir>/slept` when the sleep is over."""

    def __init__(self, seconds: float, marker_dir: str, rank: int = 1, at_step: int = 25) -> None:
        super().__init__(marker_dir, rank, at_step)
        self.seconds = seconds

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if self.due(trainer) and trainer.global_rank == self.rank:
            time.sleep(self.seconds)
            mark_injected(self.marker_dir, "slept")
