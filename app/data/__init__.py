"""LightningDataModules. `batch_size` is always per process."""

from app.data.base import DataNotFoundError, ShardedDataModule
from app.data.digits import DigitsDataModule
from app.data.random_regression import RandomRegressionDataModule
from app.data.tensor_file import TensorFileDataModule
from app.data.vision import CIFAR10DataModule, FakeImageDataModule, MNISTDataModule

__all__ = [
    "CIFAR10DataModule",
    "DataNotFoundError",
    "DigitsDataModule",
    "FakeImageDataModule",
    "MNISTDataModule",
    "RandomRegressionDataModule",
    "ShardedDataModule",
    "TensorFileDataModule",
]
