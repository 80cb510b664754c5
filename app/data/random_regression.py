"""Seeded random regression data for the tutorials' ToyModel."""

from __future__ import annotations

from typing import Any

from torch.utils.data import Dataset

from app.data.base import ShardedDataModule
from app.data.datasets import check_num_samples, random_regression_splits


class RandomRegressionDataModule(ShardedDataModule):
    """`num_samples` training pairs, plus a quarter as many for validation and for test."""

    def __init__(
        self,
        num_samples: int = 1024,
        in_features: int = 10,
        out_features: int = 5,
        data_seed: int = 0,
        **loader_options: Any,
    ) -> None:
        super().__init__(**loader_options)  # batch_size, num_workers, ...: see ShardedDataModule
        check_num_samples(num_samples)
        self.num_samples = num_samples
        self.in_features = in_features
        self.out_features = out_features
        self.data_seed = data_seed

    def make_splits(self) -> tuple[Dataset, Dataset, Dataset]:
        return random_regression_splits(self.num_samples, self.in_features, self.out_features, self.data_seed)
