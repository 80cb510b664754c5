"""Training from LitData shards (`python -m app.data.shard` writes them): `StreamingDataModule`.

`StreamingDataset` reads the shards (a local folder or object storage with a chunk cache) by index; the order is ours,
not `StreamingDataLoader`'s (which depends on ranks and workers and saves state ahead of training).
`ResumableDistributedSampler` with `chunked_shard` keeps LitData's chunk-wise reading while the order stays a function
of (seed, epoch, world size): exact resume with any `num_workers`, elastic on another world size.

Encoded images get `ImageFolderDataModule`'s transforms, seeded per sample; other samples are returned as written."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset
from torchvision.io import ImageReadMode, decode_image

from app.data.base import ShardedDataModule
from app.data.datasets import DataNotFoundError
from app.data.image_datasets import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    UnreadableImageError,
    check_crop_scale,
    eval_transform,
    train_transform,
)
from app.data.samplers import DEFAULT_SHUFFLE_CHUNKS
from app.errors import InvalidConfigError


def open_shards(input_dir: str, cache_dir: str | None) -> Any:
    """LitData's `StreamingDataset` over one split's shards; one line when they are not there."""
    try:
        from litdata import StreamingDataset
    except ImportError:
        raise DataNotFoundError(
            "reading LitData shards needs the litdata package. Fix: pip install -e '.[streaming]'."
        ) from None
    try:
        return StreamingDataset(input_dir, cache_dir=cache_dir)
    except (FileNotFoundError, AssertionError, ValueError) as error:
        raise DataNotFoundError(
            f"no LitData shards at {input_dir} ({str(error).splitlines()[0] if str(error) else type(error).__name__}). "
            "Fix: write them with python -m app.data.shard --config <your config> --out <dir>, and give "
            "--data.init_args.data_dir=<dir>."
        ) from None


def is_store(data_dir: str) -> bool:
    """Whether LitData streams `data_dir` from a store (s3://..., its `local:` store) rather than a folder."""
    return "://" in data_dir or data_dir.startswith("local:")


class ShardSamples(Dataset):
    """One split's shards as a map-style data set (`StreamingDataset[i]`, decoded).

    `chunk_sizes` tells the sampler how samples lie in chunks. Chunks open lazily in each reading process."""

    def __init__(self, input_dir: str, transform: Any, cache_dir: str | None, shuffle_chunks: int) -> None:
        self.input_dir = input_dir
        self.stream = open_shards(input_dir, cache_dir)
        # Fetch whole chunks, not one ranged request per sample (which LitData's `local:` store answered with nothing,
        # litdata 0.2.76); the chunked order reads a chunk's samples together. `_on_demand_bytes` is private
        # (docs/private_apis.md): its public setter needs the cache that the first ranged request creates.
        self.stream._on_demand_bytes = False
        # LitData's (start, end) of each chunk's samples (`StreamingDataset.region_of_interest`, listed in
        # docs/private_apis.md): the whole chunk unless LitData subsamples.
        self.chunk_sizes = [end - start for start, end in self.stream.region_of_interest]
        self.shuffle_chunks = shuffle_chunks
        self.transform = transform

    def __len__(self) -> int:
        # Not len(self.stream): in a distributed run LitData's length is one rank's share.
        return sum(self.chunk_sizes)

    def __getitem__(self, index: int) -> Any:
        from litdata.exceptions import ChunkWaitTimeoutError

        try:
            sample = self.stream[int(index)]
        except (struct.error, EOFError, UnicodeDecodeError, ValueError, ChunkWaitTimeoutError) as error:
            # A chunk cut short or damaged after writing (an interrupted copy to object storage: LitData then waits for
            # the rest of it), or a download from the store that does not arrive.
            raise self._unreadable(index, "cannot be read from its chunk", error) from None
        if isinstance(sample, dict) and "image" in sample:
            return self._decode(sample, index), int(sample["label"])
        return sample

    def _unreadable(self, index: int, what: str, error: Exception) -> UnreadableImageError:
        # UnreadableImageError: one line, also when raised in a loader worker (its class unwraps it).
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        return UnreadableImageError(
            f"sample {index} of the shards at {self.input_dir} {what} ({type(error).__name__}: {reason}). "
            "Fix: copy the shards again or rewrite them (python -m app.data.shard), or check the store's connection."
        )

    def _decode(self, sample: dict[str, Any], index: int) -> torch.Tensor:
        encoded = torch.frombuffer(bytearray(sample["image"]), dtype=torch.uint8)
        try:
            image = decode_image(encoded, mode=ImageReadMode.RGB)
        except RuntimeError as error:
            raise self._unreadable(index, "is not a readable image", error) from None
        return self.transform(image) if self.transform is not None else image


class StreamingDataModule(ShardedDataModule):
    """LitData shards written by `python -m app.data.shard`: `data_dir/train`, `data_dir/val` (and `data_dir/test`).

    Without test shards the val split is the test split.

    `data_dir` is a local folder or a URL (s3://bucket/shards; chunks cached in `cache_dir`, LitData's default when
    null). `shuffle_chunks`: the training order shuffles chunks, then samples within windows of this many chunks (more
    mixes more, more chunks open). Encoded images get `ImageFolderDataModule`'s transforms (same keys). `batch_size`,
    `num_workers`, ...: see `ShardedDataModule`."""

    def __init__(
        self,
        data_dir: str = "data/shards",
        shuffle_chunks: int = DEFAULT_SHUFFLE_CHUNKS,
        cache_dir: str | None = None,
        image_size: int = 224,
        crop_scale: tuple[float, float] = (0.08, 1.0),
        horizontal_flip: bool = True,
        resize_size: int = 256,
        mean: tuple[float, ...] = IMAGENET_MEAN,
        std: tuple[float, ...] = IMAGENET_STD,
        **loader_options: Any,
    ) -> None:
        super().__init__(**loader_options)
        if shuffle_chunks < 1:
            raise InvalidConfigError(
                f"data.shuffle_chunks ({shuffle_chunks}) must be at least 1 (the chunks whose samples are shuffled "
                "together). Fix: a positive number, e.g. 4."
            )
        check_crop_scale(tuple(crop_scale))
        self.data_dir = str(data_dir).rstrip("/")
        self.shuffle_chunks = shuffle_chunks
        self.cache_dir = cache_dir
        self.image_size = image_size
        self.crop_scale = tuple(crop_scale)
        self.horizontal_flip = horizontal_flip
        self.resize_size = resize_size
        self.mean = tuple(mean)
        self.std = tuple(std)

    @staticmethod
    def classes_on_disk(data_dir: str) -> list[str] | None:
        """The class names the shard writer recorded (`ddp_app_shards.json`), for the launcher's `num_classes` check;
        None where none is recorded (a URL, unlabelled or older shards). A local `data_dir` without train/ shards is an
        error."""
        data_dir = str(data_dir).rstrip("/")
        if is_store(data_dir):
            return None
        if not (Path(data_dir) / "train" / "index.json").is_file():
            where = "does not exist" if not Path(data_dir).exists() else "has no train/index.json"
            raise DataNotFoundError(
                f"no LitData shards at {data_dir} ({Path(data_dir).resolve()} {where}). Fix: write them with "
                "python -m app.data.shard --config <your config> --out <dir>, and give --data.init_args.data_dir=<dir>."
            )
        from app.data.shard import MANIFEST

        try:
            classes = json.loads((Path(data_dir) / MANIFEST).read_text()).get("classes")
        except (OSError, ValueError, AttributeError):  # no record, or not ours: nothing to check against
            return None
        return [str(name) for name in classes] if isinstance(classes, list) and classes else None

    def _split(self, name: str, transform: Any) -> ShardSamples:
        return ShardSamples(f"{self.data_dir}/{name}", transform, self.cache_dir, self.shuffle_chunks)

    def _has_split(self, name: str) -> bool:
        if is_store(self.data_dir):  # a store: open test/ to see
            try:
                self._split(name, None)
            except DataNotFoundError:
                return False
            return True
        return (Path(self.data_dir) / name / "index.json").is_file()

    def make_splits(self) -> tuple[Dataset, Dataset, Dataset]:
        augmented = train_transform(self.image_size, self.crop_scale, self.horizontal_flip, self.mean, self.std)
        plain = eval_transform(self.image_size, self.resize_size, self.mean, self.std)
        train = self._split("train", augmented)
        val = self._split("val", plain)
        test = self._split("test", plain) if self._has_split("test") else val
        return train, val, test
