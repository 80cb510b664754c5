"""scikit-learn's 8x8 handwritten digits: 1,797 real images shipped inside the scikit-learn wheel."""

from __future__ import annotations

from typing import Any

import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch.utils.data import TensorDataset

from app.data.base import ShardedDataModule


def digits_splits(
    val_fraction: float, test_fraction: float, split_seed: int
) -> tuple[TensorDataset, TensorDataset, TensorDataset]:
    """Stratified (train, val, test) splits; pixel values scaled from 0..16 to 0..1."""
    if not (0 < val_fraction < 1 and 0 < test_fraction < 1 and val_fraction + test_fraction < 1):
        raise ValueError(
            f"data.val_fraction ({val_fraction}) and data.test_fraction ({test_fraction}) must each "
            "lie in (0, 1) and sum to less than 1."
        )
    images, labels = load_digits(return_X_y=True)
    indices = list(range(len(labels)))
    train_val, test = train_test_split(indices, test_size=test_fraction, stratify=labels, random_state=split_seed)
    train, val = train_test_split(
        train_val,
        test_size=val_fraction / (1 - test_fraction),
        stratify=labels[train_val],
        random_state=split_seed,
    )
    inputs = torch.tensor(images / 16.0, dtype=torch.float32)
    targets = torch.tensor(labels, dtype=torch.long)
    return tuple(TensorDataset(inputs[idx], targets[idx]) for idx in (train, val, test))  # type: ignore[return-value]


class DigitsDataModule(ShardedDataModule):
    """The default dataset: runs anywhere, no download, 64 features per image."""

    def __init__(
        self, val_fraction: float = 0.15, test_fraction: float = 0.15, split_seed: int = 0, **loader_options: Any
    ) -> None:
        super().__init__(**loader_options)  # batch_size, num_workers, ...: see ShardedDataModule
        self.val_fraction = val_fraction
        self.test_fraction = test_fraction
        self.split_seed = split_seed

    def make_splits(self) -> tuple[TensorDataset, TensorDataset, TensorDataset]:
        return digits_splits(self.val_fraction, self.test_fraction, self.split_seed)
