"""Your own data as tensors in one file: `torch.save({"inputs": X, "targets": y}, "data.pt")`."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import Dataset, Subset, TensorDataset

from app.checkpoints import safe_load
from app.data.base import ShardedDataModule
from app.errors import UserFacingError


def load_tensor_file(path: str) -> TensorDataset:
    """Load and validate: both keys present, same length, no NaN/Inf in floating-point inputs."""
    data = safe_load(path)
    if not isinstance(data, dict) or not {"inputs", "targets"} <= data.keys():
        raise UserFacingError(f"{path} must hold a dict with 'inputs' and 'targets' tensors.")
    inputs, targets = data["inputs"], data["targets"]
    if len(inputs) != len(targets):
        raise UserFacingError(f"{path}: {len(inputs)} inputs but {len(targets)} targets.")
    for name, tensor in (("inputs", inputs), ("targets", targets)):
        if tensor.is_floating_point():
            finite = torch.isfinite(tensor.reshape(len(tensor), -1)).all(dim=1)
            if not bool(finite.all()):
                first = int((~finite).nonzero()[0])
                raise UserFacingError(
                    f"{path}: {name} contain NaN or Inf ({int((~finite).sum())} samples, the first is sample "
                    f"{first}). Fix: clean or impute the data before training."
                )
    return TensorDataset(inputs, targets)


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
        dataset = load_tensor_file(self.path)
        order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(self.split_seed)).tolist()
        n_val = int(len(order) * self.val_fraction)
        n_test = int(len(order) * self.test_fraction)
        val, test, train = order[:n_val], order[n_val : n_val + n_test], order[n_val + n_test :]
        return Subset(dataset, train), Subset(dataset, val), Subset(dataset, test)
