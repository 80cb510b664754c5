"""torchvision image datasets: MNIST, CIFAR-10 and an explicitly chosen FakeData stand-in.

Downloads happen only in `prepare_data` (once per node). Offline compute nodes: stage the files under `data_dir` and
keep `download: false`; a missing dataset fails with one message saying where we looked. Datasets are built in
`app.data.datasets`."""

from __future__ import annotations

from typing import Any

from torch.utils.data import Dataset

from app.data.base import ShardedDataModule
from app.data.datasets import cifar10_splits, download_cifar10, download_mnist, fake_image_splits, mnist_splits


class _TorchvisionDataModule(ShardedDataModule):
    """The settings MNIST and CIFAR-10 share: where the files are, whether to download, the split."""

    def __init__(
        self,
        data_dir: str = "data",
        download: bool = False,
        val_size: int = 5000,
        split_seed: int = 0,
        **loader_options: Any,
    ) -> None:
        super().__init__(**loader_options)  # batch_size, num_workers, ...: see ShardedDataModule
        self.data_dir = data_dir
        self.download = download
        self.val_size = val_size
        self.split_seed = split_seed


class MNISTDataModule(_TorchvisionDataModule):
    """torchvision MNIST (28x28 grey images); files under `<data_dir>/MNIST/raw/`."""

    def prepare_data(self) -> None:
        download_mnist(self.data_dir, self.download)

    def make_splits(self) -> tuple[Dataset, Dataset, Dataset]:
        return mnist_splits(self.data_dir, self.download, self.val_size, self.split_seed)


class CIFAR10DataModule(_TorchvisionDataModule):
    """torchvision CIFAR-10 (32x32 colour images); files under `<data_dir>/cifar-10-batches-py/`.

    Training images get the standard augmentation (random crop with 4-pixel padding, horizontal flip) when `augment` is
    on; validation and test images never do."""

    def __init__(
        self,
        data_dir: str = "data",
        download: bool = False,
        val_size: int = 5000,
        split_seed: int = 0,
        augment: bool = True,
        verify_checksums: bool = True,
        **loader_options: Any,
    ) -> None:
        super().__init__(data_dir, download, val_size, split_seed, **loader_options)
        self.augment = augment
        self.verify_checksums = verify_checksums

    def prepare_data(self) -> None:
        download_cifar10(self.data_dir, self.download)

    def make_splits(self) -> tuple[Dataset, Dataset, Dataset]:
        return cifar10_splits(
            self.data_dir, self.download, self.val_size, self.split_seed, self.augment, self.verify_checksums
        )


class FakeImageDataModule(ShardedDataModule):
    """Random images of a given shape (values in [0, 1)), for benchmarks only; a config has to name it.

    Drawn once in `setup` from a generator seeded by the split: torchvision's FakeData re-seeds the global RNG per
    sample, at a cost (docs/performance.md)."""

    def __init__(
        self,
        image_size: tuple[int, int, int] = (1, 28, 28),
        num_classes: int = 10,
        train_size: int = 4096,
        eval_size: int = 512,
        **loader_options: Any,
    ) -> None:
        super().__init__(**loader_options)  # batch_size, num_workers, ...: see ShardedDataModule
        self.image_size = tuple(image_size)
        self.num_classes = num_classes
        self.train_size = train_size
        self.eval_size = eval_size

    def make_splits(self) -> tuple[Dataset, Dataset, Dataset]:
        return fake_image_splits(self.image_size, self.num_classes, self.train_size, self.eval_size)
