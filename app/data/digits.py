"""scikit-learn's 8x8 handwritten digits: 1,797 real images shipped inside the scikit-learn wheel."""

from __future__ import annotations

from typing import Any

from torch.utils.data import Dataset

from app.data.base import ShardedDataModule
from app.data.datasets import digits_splits


class DigitsDataModule(ShardedDataModule):
    """The default dataset: runs anywhere, no download, 64 features per image."""

    def __init__(
        self, val_fraction: float = 0.15, test_fraction: float = 0.15, split_seed: int = 0, **loader_options: Any
    ) -> None:
        super().__init__(**loader_options)  # batch_size, num_workers, ...: see ShardedDataModule
        self.val_fraction = val_fraction
        self.test_fraction = test_fraction
        self.split_seed = split_seed

    def make_splits(self) -> tuple[Dataset, Dataset, Dataset]:
        return digits_splits(self.val_fraction, self.test_fraction, self.split_seed)
