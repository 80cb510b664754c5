"""Seeded random regression data for the tutorials' ToyModel."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import TensorDataset

from app.data.base import ShardedDataModule


def random_regression_splits(
    num_samples: int, in_features: int, out_features: int, data_seed: int
) -> tuple[TensorDataset, TensorDataset, TensorDataset]:
    """Inputs ~ N(0, 1); targets = a fixed random linear map of the inputs plus noise.

    Everything comes from one `torch.Generator` seeded with `data_seed`, so every rank and every
    run builds the same tensors (the tutorials call `torch.randn` per step and per rank instead).
    """
    generator = torch.Generator().manual_seed(data_seed)
    total = num_samples * 3 // 2
    inputs = torch.randn(total, in_features, generator=generator)
    weight = torch.randn(in_features, out_features, generator=generator)
    targets = inputs @ weight + 0.1 * torch.randn(total, out_features, generator=generator)
    n_val = num_samples // 4
    train = TensorDataset(inputs[:num_samples], targets[:num_samples])
    val = TensorDataset(inputs[num_samples : num_samples + n_val], targets[num_samples : num_samples + n_val])
    test = TensorDataset(inputs[num_samples + n_val :], targets[num_samples + n_val :])
    return train, val, test


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
        if num_samples < 4:
            raise ValueError(f"data.num_samples must be >= 4, got {num_samples}.")
        self.num_samples = num_samples
        self.in_features = in_features
        self.out_features = out_features
        self.data_seed = data_seed

    def make_splits(self) -> tuple[TensorDataset, TensorDataset, TensorDataset]:
        return random_regression_splits(self.num_samples, self.in_features, self.out_features, self.data_seed)
