"""torchvision image datasets: MNIST, CIFAR-10 and an explicitly chosen FakeData stand-in.

Downloads happen only in `prepare_data` (Lightning runs it once per node, on local rank 0).
Compute nodes are often offline: stage the files under `data_dir` ahead of time and keep
`download: false`; a missing dataset then fails with one message that says where we looked.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset, Subset, TensorDataset
from torchvision import datasets, transforms

from app.data.base import DataNotFoundError, ShardedDataModule

MNIST_NORMALIZE = transforms.Normalize((0.1307,), (0.3081,))
CIFAR10_NORMALIZE = transforms.Normalize((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))


def _train_val_split(
    train_full: Dataset, train_eval_view: Dataset, val_size: int, split_seed: int
) -> tuple[Dataset, Dataset]:
    """Hold out `val_size` training samples; `train_eval_view` is the same data without augmentation."""
    total = len(train_full)  # type: ignore[arg-type]
    if not 0 < val_size < total:
        raise ValueError(f"data.val_size must lie in (0, {total}), got {val_size}.")
    order = torch.randperm(total, generator=torch.Generator().manual_seed(split_seed)).tolist()
    return Subset(train_full, order[val_size:]), Subset(train_eval_view, order[:val_size])


class MNISTDataModule(ShardedDataModule):
    """torchvision MNIST (28x28 grey images); files under `<data_dir>/MNIST/raw/`."""

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
        self.transform = transforms.Compose([transforms.ToTensor(), MNIST_NORMALIZE])

    def _raw_folder(self) -> Path:
        return Path(self.data_dir) / "MNIST" / "raw"

    def prepare_data(self) -> None:
        if self.download:
            try:
                for train in (True, False):
                    datasets.MNIST(self.data_dir, train=train, download=True)
            except Exception as error:
                raise DataNotFoundError(
                    f"Could not download MNIST into {self._raw_folder()} ({error}). "
                    "Fix: run once where the internet is reachable, or copy the four IDX files there "
                    "and set data.init_args.download=false."
                ) from error

    def _dataset(self, train: bool) -> datasets.MNIST:
        try:
            return datasets.MNIST(self.data_dir, train=train, transform=self.transform, download=False)
        except RuntimeError as error:
            names = ", ".join(Path(url).stem for url, _ in datasets.MNIST.resources)
            raise DataNotFoundError(
                f"MNIST not found in {self._raw_folder().resolve()} (looked for {names}). "
                "Fix: set data.init_args.download=true where the internet is reachable, or stage the "
                "files there and point data.init_args.data_dir at their parent."
            ) from error

    def make_splits(self) -> tuple[Dataset, Dataset, Dataset]:
        train_full = self._dataset(train=True)
        train, val = _train_val_split(train_full, train_full, self.val_size, self.split_seed)
        return train, val, self._dataset(train=False)


class _CIFAR10(datasets.CIFAR10):
    """torchvision's CIFAR10, with the MD5 check made optional for locally generated test data.

    Keep `verify_checksums` on for real data: the batches are pickles, and the checksum is what
    guarantees that the file being unpickled is the published one.
    """

    def __init__(self, *args, verify_checksums: bool = True, **kwargs) -> None:
        self.verify_checksums = verify_checksums
        super().__init__(*args, **kwargs)

    def _check_integrity(self) -> bool:
        if self.verify_checksums:
            return super()._check_integrity()
        folder = Path(self.root) / self.base_folder
        return all((folder / name).is_file() for name, _ in self.train_list + self.test_list)

    def _load_meta(self) -> None:
        if self.verify_checksums:
            return super()._load_meta()
        with open(os.path.join(self.root, self.base_folder, self.meta["filename"]), "rb") as infile:
            self.classes = pickle.load(infile, encoding="latin1")[self.meta["key"]]
        self.class_to_idx = {name: index for index, name in enumerate(self.classes)}


class CIFAR10DataModule(ShardedDataModule):
    """torchvision CIFAR-10 (32x32 colour images); files under `<data_dir>/cifar-10-batches-py/`.

    Training images get the standard augmentation (random crop with 4-pixel padding, horizontal
    flip) when `augment` is on; validation and test images never do.
    """

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
        super().__init__(**loader_options)  # batch_size, num_workers, ...: see ShardedDataModule
        self.data_dir = data_dir
        self.download = download
        self.val_size = val_size
        self.split_seed = split_seed
        self.augment = augment
        self.verify_checksums = verify_checksums
        self.eval_transform = transforms.Compose([transforms.ToTensor(), CIFAR10_NORMALIZE])
        augmentation = [transforms.RandomCrop(32, padding=4), transforms.RandomHorizontalFlip()]
        self.train_transform = transforms.Compose(
            (augmentation if augment else []) + [transforms.ToTensor(), CIFAR10_NORMALIZE]
        )

    def _folder(self) -> Path:
        return Path(self.data_dir) / _CIFAR10.base_folder

    def prepare_data(self) -> None:
        if self.download:
            try:
                _CIFAR10(self.data_dir, train=True, download=True)
            except Exception as error:
                raise DataNotFoundError(
                    f"Could not download CIFAR-10 into {self._folder()} ({error}). "
                    "Fix: run once where the internet is reachable, or extract cifar-10-python.tar.gz "
                    "there and set data.init_args.download=false."
                ) from error

    def _dataset(self, train: bool, transform: transforms.Compose) -> _CIFAR10:
        try:
            return _CIFAR10(self.data_dir, train=train, transform=transform, verify_checksums=self.verify_checksums)
        except RuntimeError as error:
            raise DataNotFoundError(
                f"CIFAR-10 not found or corrupted in {self._folder().resolve()} (looked for data_batch_1..5, "
                "test_batch, batches.meta with their published MD5 sums). Fix: set "
                "data.init_args.download=true where the internet is reachable, or extract "
                "cifar-10-python.tar.gz into data.init_args.data_dir."
            ) from error

    def make_splits(self) -> tuple[Dataset, Dataset, Dataset]:
        train_full = self._dataset(True, self.train_transform)
        train_eval_view = self._dataset(True, self.eval_transform)
        train, val = _train_val_split(train_full, train_eval_view, self.val_size, self.split_seed)
        return train, val, self._dataset(False, self.eval_transform)


class FakeImageDataModule(ShardedDataModule):
    """Random images of a given shape (values in [0, 1), as ToTensor gives), for benchmarks only.

    It is never a silent fallback for a missing dataset: a config has to name it. The images are
    drawn once, in `setup`, from a generator seeded by the split, so a training step measures
    training, not image synthesis: torchvision's FakeData re-seeds the global RNG for every
    sample, and that call's cost grows with the depth of the call stack (torch records a stack
    trace for its lazy CUDA/XPU seeding), which made loading 50% slower under Lightning's deeper
    loop than in the plain reference trainer (measured on the CNN benchmark).
    """

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
        def fake(size: int, offset: int) -> TensorDataset:
            generator = torch.Generator().manual_seed(offset)
            images = torch.rand((size, *self.image_size), generator=generator)
            return TensorDataset(images, torch.randint(self.num_classes, (size,), generator=generator))

        return (
            fake(self.train_size, 0),
            fake(self.eval_size, self.train_size),
            fake(self.eval_size, 2 * self.train_size),
        )
