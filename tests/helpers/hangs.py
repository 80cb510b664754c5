"""Test-only ways for one rank to hang the others, as real code does (tests/fault/test_hangs.py).

Each writes `<marker_dir>/injected` when it strikes, so a test can time the job's end from then.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import Dataset

from app.data import DigitsDataModule


def mark_injected(marker_dir: str, name: str = "injected") -> None:
    Path(marker_dir).mkdir(parents=True, exist_ok=True)
    (Path(marker_dir) / name).write_text(str(time.time()))


class OnceAtStep(L.Callback):
    """A callback that acts once, at its first hook at or after step `at_step`, on rank `rank`."""

    def __init__(self, marker_dir: str, rank: int = 1, at_step: int = 25) -> None:
        self.marker_dir = marker_dir
        self.rank = rank
        self.at_step = at_step
        self.struck = False

    def due(self, trainer: L.Trainer) -> bool:
        """Whether this hook is the one (every rank learns it; only once)."""
        if self.struck or trainer.global_step < self.at_step:
            return False
        self.struck = True
        return True


class WrappedDataset(Dataset):
    """A dataset that serves `dataset`'s samples with something added (a delay, a stall)."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]


class InjectHang(OnceAtStep):
    """At the first training batch end at or after `at_step`:

    - `skip`: every rank but `rank` enters a barrier (`rank` skips it, as after rank-dependent control flow);
    - `extra`: `rank` alone all-reduces a counter at the end of the next validation epoch (as
      `if trainer.is_global_zero: all_reduce(...)` does); the others go on to gather the validation
      metrics, which starts with a barrier.

    Not `self.log(..., sync_dist=True)` on one rank: on gloo its all-reduce meets another all-reduce
    of a different size, and gloo aborts the process ("Received data size doesn't match expected
    size") instead of hanging (docs/hangs.md).
    """

    def __init__(self, kind: str, marker_dir: str, rank: int = 1, at_step: int = 25) -> None:
        if kind not in ("skip", "extra"):
            raise ValueError(f"kind must be skip or extra, got {kind!r}")
        super().__init__(marker_dir, rank, at_step)
        self.kind = kind

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if self.kind != "skip" or not self.due(trainer):
            return
        if trainer.global_rank == self.rank:
            mark_injected(self.marker_dir)
        else:
            trainer.strategy.barrier("the barrier rank 1 skips")

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.kind != "extra" or not self.due(trainer):
            return
        if trainer.global_rank == self.rank:
            mark_injected(self.marker_dir)
            torch.distributed.all_reduce(torch.ones(3))


class StuckAfter(WrappedDataset):
    """A dataset whose `__getitem__` blocks for an hour on rank `rank` after `items` items (a dead NFS read)."""

    def __init__(self, dataset: Dataset, rank: int, items: int, marker_dir: str) -> None:
        super().__init__(dataset)
        self.rank = rank
        self.items = items
        self.marker_dir = marker_dir
        self.served = 0

    def __getitem__(self, index: int) -> Any:
        self.served += 1
        if self.served > self.items and torch.distributed.get_rank() == self.rank:
            mark_injected(self.marker_dir)
            time.sleep(3600)
        return self.dataset[index]


class StuckDigits(DigitsDataModule):
    """The digits, with a training loader that gets stuck on one rank after `after_items` samples."""

    def __init__(self, marker_dir: str, stuck_rank: int = 1, after_items: int = 800, **options: Any) -> None:
        super().__init__(**options)
        self.marker_dir = marker_dir
        self.stuck_rank = stuck_rank
        self.after_items = after_items

    def make_splits(self) -> tuple[Dataset, Dataset, Dataset]:
        train, val, test = super().make_splits()
        return StuckAfter(train, self.stuck_rank, self.after_items, self.marker_dir), val, test
