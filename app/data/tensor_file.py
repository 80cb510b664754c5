"""Your own data as tensors in one file: `torch.save({"inputs": X, "targets": y}, "data.pt")`."""

from __future__ import annotations

from typing import Any

from torch.utils.data import Dataset

from app.data.base import ShardedDataModule
from app.data.datasets import tensor_file_splits


class TensorFileDataModule(ShardedDataModule):
    """Splits one tensor file into train/val/test with a seeded permutation."""

    def __init__(
        self,
        path: str,
        val_fraction: float = 0.1,
        test_fraction: float = 0.1,
        split_seed: int = 0,
        **loader_options: Any,
    ) -> None:
        super().__init__(**loader_options)  # batch_size, num_workers, ...: see ShardedDataModule
        self.path = path
        self.val_fraction = val_fraction
        self.test_fraction = test_fraction
        self.split_seed = split_seed

    def make_splits(self) -> tuple[Dataset, Dataset, Dataset]:
        return tensor_file_splits(self.path, self.val_fraction, self.test_fraction, self.split_seed)
