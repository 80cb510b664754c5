"""MNIST and CIFAR-10 DataModules on small data written in the real on-disk formats."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from app.data import CIFAR10DataModule, DataNotFoundError, MNISTDataModule
from tests.helpers.datasets_on_disk import write_cifar10, write_mnist


def test_mnist_loads_idx_files(tmp_path: Path) -> None:
    labels = write_mnist(tmp_path, n_train=64, n_test=32)
    module = MNISTDataModule(data_dir=str(tmp_path), val_size=16, batch_size=8, num_workers=0)
    module.prepare_data()
    module.setup("fit")
    assert (len(module.train_dataset), len(module.val_dataset), len(module.test_dataset)) == (48, 16, 32)
    inputs, targets = next(iter(module.train_dataloader()))
    assert inputs.shape == (8, 1, 28, 28) and inputs.dtype == torch.float32
    assert set(targets.tolist()) <= set(labels[True].tolist())
    test_targets = torch.cat([batch[1] for batch in module.test_dataloader()])
    assert test_targets.tolist() == labels[False].tolist()


def test_mnist_missing_says_where_it_looked(tmp_path: Path) -> None:
    module = MNISTDataModule(data_dir=str(tmp_path / "absent"), download=False)
    with pytest.raises(DataNotFoundError) as error:
        module.setup("fit")
    message = str(error.value)
    assert str((tmp_path / "absent" / "MNIST" / "raw").resolve()) in message
    assert "download=true" in message and "\n" not in message


def test_mnist_download_failure_is_one_clear_error(tmp_path: Path) -> None:
    # Dataset hubs are unreachable here, so this is a real failed download.
    module = MNISTDataModule(data_dir=str(tmp_path), download=True)
    with pytest.raises(DataNotFoundError, match="Could not download MNIST"):
        module.prepare_data()


def test_cifar10_loads_pickled_batches(tmp_path: Path) -> None:
    write_cifar10(tmp_path, per_batch=20, n_test=20)
    module = CIFAR10DataModule(data_dir=str(tmp_path), val_size=10, batch_size=4, num_workers=0, verify_checksums=False)
    module.setup("fit")
    assert (len(module.train_dataset), len(module.val_dataset), len(module.test_dataset)) == (90, 10, 20)
    inputs, targets = next(iter(module.train_dataloader()))
    assert inputs.shape == (4, 3, 32, 32) and targets.dtype == torch.int64
    # Validation images come from the un-augmented view: the same image twice is the same tensor.
    assert torch.equal(module.val_dataset[0][0], module.val_dataset[0][0])


def test_cifar10_checksums_guard_real_data(tmp_path: Path) -> None:
    write_cifar10(tmp_path)
    module = CIFAR10DataModule(data_dir=str(tmp_path), verify_checksums=True)
    with pytest.raises(DataNotFoundError, match="MD5"):
        module.setup("fit")
