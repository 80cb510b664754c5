"""Write tiny MNIST and CIFAR-10 datasets in their real on-disk formats (dataset hubs are offline)."""

from __future__ import annotations

import pickle
import struct
from pathlib import Path
from typing import Any

import numpy as np

MNIST_FILES = {
    True: ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    False: ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}


def write_idx(path: Path, array: np.ndarray) -> None:
    """IDX format: magic (0, 0, dtype 0x08 = ubyte, ndim), big-endian dims, then the raw bytes."""
    header = struct.pack(">BBBB", 0, 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    path.write_bytes(header + array.astype(np.uint8).tobytes())


def write_mnist(root: Path, n_train: int = 64, n_test: int = 32, seed: int = 0) -> dict[bool, np.ndarray]:
    """`<root>/MNIST/raw/*-ubyte` as torchvision expects them; returns the labels by split."""
    rng = np.random.default_rng(seed)
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    labels = {}
    for train, count in ((True, n_train), (False, n_test)):
        images_name, labels_name = MNIST_FILES[train]
        labels[train] = rng.integers(0, 10, count)
        write_idx(raw / images_name, rng.integers(0, 256, (count, 28, 28)))
        write_idx(raw / labels_name, labels[train])
    return labels


def write_cifar10(root: Path, per_batch: int = 20, n_test: int = 20, seed: int = 0) -> None:
    """`<root>/cifar-10-batches-py/` with five training batches, a test batch and batches.meta."""
    rng = np.random.default_rng(seed)
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True, exist_ok=True)

    def batch(count: int) -> dict:
        return {
            "data": rng.integers(0, 256, (count, 3 * 32 * 32)).astype(np.uint8),
            "labels": rng.integers(0, 10, count).tolist(),
        }

    for index in range(1, 6):
        (folder / f"data_batch_{index}").write_bytes(pickle.dumps(batch(per_batch)))
    (folder / "test_batch").write_bytes(pickle.dumps(batch(n_test)))
    names = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
    (folder / "batches.meta").write_bytes(pickle.dumps({"label_names": names}))


def image_folder_shards(factory: Any, images: Path, config: str, chunk: int, *extra: str) -> Path:
    """The LitData shards `python -m app.data.shard` writes of the image folder `images` (chunks of `chunk` samples)."""
    from app.data.shard import main as write_shards

    out = factory.mktemp("written") / "shards"
    arguments = ["--config", config, "--out", str(out), "--chunk-size", str(chunk), *extra]
    assert write_shards([*arguments, f"--data.init_args.data_dir={images}"]) == 0
    return out
