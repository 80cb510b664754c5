"""LightningDataModules (`batch_size` is always per process) and, in `datasets`, their datasets.

The DataModules are imported on first use (`app.data.DigitsDataModule`), so that importing `app.data.datasets`, as the
reference trainer does, does not import Lightning."""

from __future__ import annotations

import importlib
from typing import Any

# Public name -> the module that defines it.
DATA_MODULES = {
    "ShardedDataModule": "app.data.base",
    "DigitsDataModule": "app.data.digits",
    "RandomRegressionDataModule": "app.data.random_regression",
    "TensorFileDataModule": "app.data.tensor_file",
    "CIFAR10DataModule": "app.data.vision",
    "FakeImageDataModule": "app.data.vision",
    "ImageFolderDataModule": "app.data.imagefolder",
    "MNISTDataModule": "app.data.vision",
    "StreamingDataModule": "app.data.litdata_shards",
    "SyntheticTokensDataModule": "app.data.tokens",
    "DataNotFoundError": "app.data.datasets",
}

__all__ = sorted(DATA_MODULES)


def __getattr__(name: str) -> Any:
    if name in DATA_MODULES:
        return getattr(importlib.import_module(DATA_MODULES[name]), name)
    raise AttributeError(f"module 'app.data' has no attribute {name!r}")


def import_all() -> None:
    """Import every DataModule, so that LightningCLI knows them by their short names."""
    for module in set(DATA_MODULES.values()):
        importlib.import_module(module)
