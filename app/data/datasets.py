"""The datasets behind every DataModule, without Lightning: splits, downloads and loader settings. `DATASETS` maps a
DataModule's class name to its split function (same arguments and defaults as its `__init__`,
tests/data/test_datasets.py checks), which the reference trainer calls too."""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset, Subset, TensorDataset
from torchvision import datasets, transforms

from app.checkpoints.io import safe_load
from app.errors import InvalidConfigError, UserFacingError
from app.private_apis import require

Splits = tuple[Dataset, Dataset, Dataset]

MNIST_NORMALIZE = transforms.Normalize((0.1307,), (0.3081,))
CIFAR10_NORMALIZE = transforms.Normalize((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))


class DataNotFoundError(UserFacingError):
    """The dataset is not on disk and may not be downloaded; the message says where we looked."""


@dataclass(frozen=True)
class LoaderSettings:
    """The DataLoader and sampler arguments every DataModule takes. `batch_size` is per process."""

    batch_size: int = 32
    num_workers: int | None = None  # None: sized to the machine (`default_num_workers`)
    pin_memory: bool | None = None  # None: pin when training on a GPU
    persistent_workers: bool = False
    shuffle: bool = True
    seed: int = 0  # the DistributedSampler's shuffling seed
    on_device: bool = False  # keep each split whole on the training device (app/data/on_device.py; Lightning only)

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise InvalidConfigError(f"data.batch_size must be >= 1 (it is per process), got {self.batch_size}.")
        if self.num_workers is not None and self.num_workers < 0:
            raise InvalidConfigError(f"data.num_workers must be >= 0, got {self.num_workers}.")

    @classmethod
    def split_off(cls, init_args: dict[str, Any]) -> tuple[LoaderSettings, dict[str, Any]]:
        """(the loader settings in a config's `data.init_args`, the dataset's own arguments)."""
        names = {field.name for field in fields(cls)}
        settings = cls(**{key: value for key, value in init_args.items() if key in names})
        return settings, {key: value for key, value in init_args.items() if key not in names}


MAX_DEFAULT_WORKERS = 8


def default_num_workers(dataset: Dataset | None, on_gpu: bool, local_ranks: int) -> int:
    """The loader worker processes `num_workers: null` means, per rank.

    None on a CPU (the ranks use the cores) or for tensors in memory (a worker only adds a pickled copy). On a GPU, for
    per-sample decoding: the cores this process may use, shared by the node's ranks, less one, at most 8."""
    if not on_gpu or dataset is None:
        return 0
    while isinstance(dataset, Subset):
        dataset = dataset.dataset
    if isinstance(dataset, TensorDataset):
        return 0
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(0, min(MAX_DEFAULT_WORKERS, cores // max(1, local_ranks) - 1))


def digits_splits(val_fraction: float = 0.15, test_fraction: float = 0.15, split_seed: int = 0) -> Splits:
    """scikit-learn's 8x8 digits, stratified (train, val, test); pixel values scaled from 0..16 to 0..1."""
    if not (0 < val_fraction < 1 and 0 < test_fraction < 1 and val_fraction + test_fraction < 1):
        raise InvalidConfigError(
            f"data.val_fraction ({val_fraction}) and data.test_fraction ({test_fraction}) must each "
            "lie in (0, 1) and sum to less than 1."
        )
    # Imported here, not at the top: scikit-learn is slow to import, and `ddp-app` imports every DataModule to parse a
    # config (the launcher's check of bad input, every rank), digits or not.
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

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


def check_num_samples(num_samples: int) -> None:
    if num_samples < 4:
        raise InvalidConfigError(f"data.num_samples must be >= 4, got {num_samples}.")


def random_regression_splits(
    num_samples: int = 1024, in_features: int = 10, out_features: int = 5, data_seed: int = 0
) -> Splits:
    """Inputs ~ N(0, 1); targets = a fixed random linear map of the inputs plus noise.

    All from one generator seeded with `data_seed`, so every rank and run builds the same tensors. `num_samples`
    training pairs, a quarter as many for validation and test."""
    check_num_samples(num_samples)
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


def tensor_file_splits(path: str, val_fraction: float = 0.1, test_fraction: float = 0.1, split_seed: int = 0) -> Splits:
    """Your own tensors (`torch.save({"inputs": X, "targets": y}, path)`), split with a seeded permutation."""
    dataset = load_tensor_file(path)
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(split_seed)).tolist()
    n_val = int(len(order) * val_fraction)
    n_test = int(len(order) * test_fraction)
    val, test, train = order[:n_val], order[n_val : n_val + n_test], order[n_val + n_test :]
    return Subset(dataset, train), Subset(dataset, val), Subset(dataset, test)


def _train_val_split(
    train_full: Dataset, train_eval_view: Dataset, val_size: int, split_seed: int
) -> tuple[Dataset, Dataset]:
    """Hold out `val_size` training samples; `train_eval_view` is the same data without augmentation."""
    total = len(train_full)  # type: ignore[arg-type]
    if not 0 < val_size < total:
        raise InvalidConfigError(f"data.val_size must lie in (0, {total}), got {val_size}.")
    order = torch.randperm(total, generator=torch.Generator().manual_seed(split_seed)).tolist()
    return Subset(train_full, order[val_size:]), Subset(train_eval_view, order[:val_size])


def mnist_folder(data_dir: str) -> Path:
    return Path(data_dir) / "MNIST" / "raw"


def download_mnist(data_dir: str = "data", download: bool = False, **_: Any) -> None:
    """Fetch MNIST into `data_dir` if `download` (once, before any rank reads it)."""
    if download:
        try:
            for train in (True, False):
                datasets.MNIST(data_dir, train=train, download=True)
        except Exception as error:
            raise DataNotFoundError(
                f"Could not download MNIST into {mnist_folder(data_dir)} ({error}). "
                "Fix: run once where the internet is reachable, or copy the four IDX files there "
                "and set data.init_args.download=false."
            ) from error


def _mnist(data_dir: str, train: bool, transform: transforms.Compose) -> datasets.MNIST:
    try:
        return datasets.MNIST(data_dir, train=train, transform=transform, download=False)
    except RuntimeError as error:
        names = ", ".join(Path(url).stem for url, _ in datasets.MNIST.resources)
        raise DataNotFoundError(
            f"MNIST not found in {mnist_folder(data_dir).resolve()} (looked for {names}). "
            "Fix: set data.init_args.download=true where the internet is reachable, or stage the "
            "files there and point data.init_args.data_dir at their parent."
        ) from error


def mnist_splits(data_dir: str = "data", download: bool = False, val_size: int = 5000, split_seed: int = 0) -> Splits:
    """torchvision MNIST (28x28 grey images); files under `<data_dir>/MNIST/raw/`. Never downloads."""
    transform = transforms.Compose([transforms.ToTensor(), MNIST_NORMALIZE])
    train_full = _mnist(data_dir, True, transform)
    train, val = _train_val_split(train_full, train_full, val_size, split_seed)
    return train, val, _mnist(data_dir, False, transform)


class _CIFAR10(datasets.CIFAR10):
    """torchvision's CIFAR10 with the MD5 check optional (for generated test data).

    Keep `verify_checksums` on for real data: it guards what is unpickled."""

    def __init__(self, *args, verify_checksums: bool = True, **kwargs) -> None:
        self.verify_checksums = verify_checksums
        # Private: the methods overridden below; without them verify_checksums=False would do nothing.
        for name in ("_check_integrity", "_load_meta"):
            require(datasets.CIFAR10, name, "torchvision", "verify_checksums=False")
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


def cifar10_folder(data_dir: str) -> Path:
    return Path(data_dir) / _CIFAR10.base_folder


def download_cifar10(data_dir: str = "data", download: bool = False, **_: Any) -> None:
    """Fetch CIFAR-10 into `data_dir` if `download` (once, before any rank reads it)."""
    if download:
        try:
            _CIFAR10(data_dir, train=True, download=True)
        except Exception as error:
            raise DataNotFoundError(
                f"Could not download CIFAR-10 into {cifar10_folder(data_dir)} ({error}). "
                "Fix: run once where the internet is reachable, or extract cifar-10-python.tar.gz "
                "there and set data.init_args.download=false."
            ) from error


def cifar10_splits(
    data_dir: str = "data",
    download: bool = False,
    val_size: int = 5000,
    split_seed: int = 0,
    augment: bool = True,
    verify_checksums: bool = True,
) -> Splits:
    """torchvision CIFAR-10 from `<data_dir>/cifar-10-batches-py/`; never downloads. With `augment`, training images get
    a padded random crop and a horizontal flip."""
    eval_transform = transforms.Compose([transforms.ToTensor(), CIFAR10_NORMALIZE])
    augmentation = [transforms.RandomCrop(32, padding=4), transforms.RandomHorizontalFlip()]
    train_transform = transforms.Compose((augmentation if augment else []) + [transforms.ToTensor(), CIFAR10_NORMALIZE])

    def load(train: bool, transform: transforms.Compose) -> _CIFAR10:
        try:
            return _CIFAR10(data_dir, train=train, transform=transform, verify_checksums=verify_checksums)
        except RuntimeError as error:
            raise DataNotFoundError(
                f"CIFAR-10 not found or corrupted in {cifar10_folder(data_dir).resolve()} (looked for "
                "data_batch_1..5, test_batch, batches.meta with their published MD5 sums). Fix: set "
                "data.init_args.download=true where the internet is reachable, or extract "
                "cifar-10-python.tar.gz into data.init_args.data_dir."
            ) from error

    train, val = _train_val_split(load(True, train_transform), load(True, eval_transform), val_size, split_seed)
    return train, val, load(False, eval_transform)


def fake_image_splits(
    image_size: tuple[int, int, int] = (1, 28, 28), num_classes: int = 10, train_size: int = 4096, eval_size: int = 512
) -> Splits:
    """Random images (values in [0, 1), as ToTensor gives) and labels, drawn once from seeded generators."""

    def fake(size: int, offset: int) -> TensorDataset:
        generator = torch.Generator().manual_seed(offset)
        images = torch.rand((size, *tuple(image_size)), generator=generator)
        return TensorDataset(images, torch.randint(num_classes, (size,), generator=generator))

    return fake(train_size, 0), fake(eval_size, train_size), fake(eval_size, 2 * train_size)


# DataModule class name (the last part of a config's `data.class_path`) -> its splits.
DATASETS: dict[str, Callable[..., Splits]] = {
    "DigitsDataModule": digits_splits,
    "RandomRegressionDataModule": random_regression_splits,
    "TensorFileDataModule": tensor_file_splits,
    "MNISTDataModule": mnist_splits,
    "CIFAR10DataModule": cifar10_splits,
    "FakeImageDataModule": fake_image_splits,
}

# DataModule class name -> its `prepare_data` (downloads); the others have nothing to fetch.
DOWNLOADS: dict[str, Callable[..., None]] = {"MNISTDataModule": download_mnist, "CIFAR10DataModule": download_cifar10}


def markov_token_splits(
    num_sequences: int = 512, context: int = 32, vocab_size: int = 64, data_seed: int = 0
) -> tuple[Dataset, Dataset, Dataset]:
    """(train, val, test): `num_sequences` training sequences and an eighth as many for each of the others, each an
    (inputs, targets) pair of `context` tokens, targets shifted by one position."""
    if num_sequences < 8:
        raise InvalidConfigError(f"data.num_sequences must be >= 8, got {num_sequences}.")
    if context < 2 or vocab_size < 2:
        raise InvalidConfigError(f"data.context and data.vocab_size must be >= 2, got {context} and {vocab_size}.")
    generator = torch.Generator().manual_seed(data_seed)
    # Peaked rows: each token has a few likely successors, so the chain is learnable.
    transitions = torch.softmax(3.0 * torch.randn(vocab_size, vocab_size, generator=generator), dim=1)
    held_out = num_sequences // 8
    total = num_sequences + 2 * held_out
    walks = torch.empty(total, context + 1, dtype=torch.long)
    walks[:, 0] = torch.randint(vocab_size, (total,), generator=generator)
    for position in range(context):
        walks[:, position + 1] = torch.multinomial(transitions[walks[:, position]], 1, generator=generator).squeeze(1)
    inputs, targets = walks[:, :-1].contiguous(), walks[:, 1:].contiguous()
    bounds = (0, num_sequences, num_sequences + held_out, total)
    return tuple(  # type: ignore[return-value]
        TensorDataset(inputs[start:end], targets[start:end]) for start, end in zip(bounds, bounds[1:], strict=False)
    )
