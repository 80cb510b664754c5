"""Sharded checkpoints (`strategy: fsdp`): every rank writes its own shards, and a checkpoint is complete or absent,
never half-written; loading one never runs code.

A checkpoint is a DCP directory: one `__<rank>_0.distcp` per rank, DCP's `.metadata` (rank 0, after every rank's
shards), and `meta.pt` (`META_NAME`, rank 0's `torch.save` of the rest of the Lightning checkpoint).

What a user names (`checkpoints/last.ckpt`) is a symlink to that directory, written under a fresh name
(`.last.ckpt.<token>.shards`) and published by one `os.replace` of the link once everything is on disk. A killed rank
leaves the previous checkpoint; the next save removes the orphan. All ranks must see one filesystem.

Loads never run code: `meta.pt` through `safe_load`, tensors through DCP with `weights_only=True`, and `.metadata` (a
plain pickle in PyTorch) through `SafeFileSystemReader`, which builds only DCP's metadata records, sizes and dtypes."""

from __future__ import annotations

import io
import os
import pickle
import shutil
import uuid
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import ReadItem

from app.checkpoints import state as checkpoint_state
from app.checkpoints.io import (
    CLI_CLASS_PATH_KEY,
    CLI_INSTANTIATOR_KEY,
    CheckpointError,
    CheckpointSummary,
    safe_load,
    summarize_checkpoint,
)

META_NAME = "meta.pt"  # rank 0's non-tensor part of the Lightning checkpoint (Lightning's name too)
DCP_INDEX = ".metadata"  # DCP's index of every shard, written last (torch.distributed.checkpoint.filesystem)
SHARDS_SUFFIX = ".shards"

# What DCP's `.metadata` pickle may build: its own metadata records (classes of this module only), the per-file storage
# record, paths, sizes, dtypes and the layout lookup torch pickles layouts with.
DCP_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
ALLOWED_GLOBALS = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
}


def is_sharded_checkpoint(path: str | Path) -> bool:
    """A complete sharded checkpoint: a directory (or a link to one) holding DCP's index and meta.pt."""
    path = Path(path)
    return path.is_dir() and (path / DCP_INDEX).is_file() and (path / META_NAME).is_file()


def is_checkpoint(path: str | Path) -> bool:
    """A checkpoint file (torch.save) or a complete sharded checkpoint: what `--ckpt_path last` may pick."""
    return Path(path).is_file() or is_sharded_checkpoint(path)


def new_shards_directory(path: Path) -> Path:
    """A fresh directory name beside `path` for the shards of its next save (chosen by rank 0)."""
    return path.parent / f".{path.name}.{uuid.uuid4().hex[:12]}{SHARDS_SUFFIX}"


def remove_unpublished(path: Path) -> None:
    """Remove the shard directories of `path` that no link points to: saves a kill interrupted, and the one a published
    save replaced. Rank 0 only, before a save starts and after it is published."""
    published = path.resolve() if path.is_symlink() else None
    for candidate in path.parent.glob(f".{path.name}.*{SHARDS_SUFFIX}"):
        if candidate.resolve() != published:
            shutil.rmtree(candidate, ignore_errors=True)


def publish(shards: Path, path: Path) -> None:
    """Point `path` at the complete `shards` directory in one atomic step (rank 0, after every rank wrote).

    A link made under a temporary name is renamed over `path`, as `atomic_write` renames a file; the link is relative,
    so a run directory that is moved or copied keeps its checkpoints."""
    _fsync_directory(shards)
    if path.is_dir() and not path.is_symlink():  # a plain directory (a sharded save by another tool)
        shutil.rmtree(path)
    link = path.parent / f".{path.name}.{uuid.uuid4().hex[:12]}.link"
    os.symlink(shards.name, link)
    os.replace(link, path)
    _fsync_directory(path.parent)
    remove_unpublished(path)


def remove_sharded(path: Path) -> None:
    """Delete a published checkpoint: the link, then the directory it pointed to (a ModelCheckpoint's top-k file that
    fell out of the top k)."""
    target = path.resolve() if path.is_symlink() else None
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)
    if target is not None and target.is_dir():
        shutil.rmtree(target, ignore_errors=True)


def _fsync_directory(directory: Path) -> None:
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


class MetadataUnpickler(pickle.Unpickler):
    """Builds DCP's metadata records and nothing else: any other global refuses the file."""

    def find_class(self, module: str, name: str) -> Any:
        value = super().find_class(module, name) if module == DCP_METADATA_MODULE else None
        if isinstance(value, type):
            return value
        if (module, name) in ALLOWED_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint's index")


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader whose index is read by `MetadataUnpickler` (PyTorch's uses `pickle.load`)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        index = Path(self.path) / DCP_INDEX
        try:
            with open(index, "rb") as file:
                metadata = MetadataUnpickler(file).load()
        except pickle.UnpicklingError as error:
            raise CheckpointError(
                f"refused to load {index}: {error}; unpickling it could run code. Fix: resume from a checkpoint "
                "written by ddp-app fit."
            ) from error
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id  # as FileSystemReader.read_metadata does
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, reading non-tensor entries (optimizer hyperparameters) with `weights_only=True`
    (PyTorch's default planner reads them with `weights_only=False`)."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        loaded = torch.load(value, weights_only=True)
        super().load_bytes(read_item, _Preloaded(loaded))


class _Preloaded(io.BytesIO):
    """What `SafeLoadPlanner` hands the default planner: an already safely loaded value, re-serialised with torch.save,
    since `DefaultLoadPlanner.load_bytes` calls `torch.load(weights_only=False)`."""

    def __init__(self, loaded: Any) -> None:
        buffer = io.BytesIO()
        torch.save(loaded, buffer)
        super().__init__(buffer.getvalue())


def load_full_tensors(path: str | Path, prefix: str = "state_dict.") -> dict[str, torch.Tensor]:
    """Every tensor of a sharded checkpoint whose key starts with `prefix`, whole, in this one process (no process
    group): `state_dict.` for the weights (keys without the prefix), `optimizer_0.state.` for the first optimizer's
    state. For comparisons and exports; reads as safely as a resume."""
    path = Path(path)
    index = SafeFileSystemReader(path).read_metadata()
    tensors = {
        key: torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
        for key, entry in index.state_dict_metadata.items()
        if key.startswith(prefix) and isinstance(entry, TensorStorageMetadata)
    }
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")  # one process, as asked
        dcp.load(tensors, storage_reader=SafeFileSystemReader(path), planner=SafeLoadPlanner(), no_dist=True)
    return {key.removeprefix(prefix): tensor for key, tensor in tensors.items()}


def load_whole(path: str | Path) -> dict[str, Any]:
    """A checkpoint as one dict, whatever its layout: a file's `safe_load`, or a sharded checkpoint's meta.pt with its
    weights (`state_dict`) and each optimizer's state (`optimizer_states`, the `state` of each keyed by parameter name)
    joined whole. For tools that compare checkpoints (`ddp-app resume-check`); a run resumes through
    `FSDP2Strategy.load_checkpoint`."""
    path = Path(path)
    if not is_sharded_checkpoint(path):
        return safe_load(path)
    checkpoint = safe_load(path / META_NAME)
    checkpoint["state_dict"] = load_full_tensors(path)
    keys = SafeFileSystemReader(path).read_metadata().state_dict_metadata
    optimizers = sorted({key.split(".", 1)[0] for key in keys if key.startswith("optimizer_")})
    checkpoint["optimizer_states"] = [{"state": load_full_tensors(path, f"{name}.state.")} for name in optimizers]
    return checkpoint


def summarize_any(path: str | Path) -> CheckpointSummary:
    """`summarize_checkpoint` for a file, `summarize_sharded` for a sharded checkpoint."""
    return summarize_sharded(path) if is_sharded_checkpoint(path) else summarize_checkpoint(path)


def summarize_sharded(path: str | Path) -> CheckpointSummary:
    """What `app.checkpoints.io.summarize_checkpoint` says of a file, for a sharded checkpoint: its model class,
    hyperparameters and tracked run from meta.pt, its weights' shapes from DCP's index."""
    path = Path(path)
    if not is_sharded_checkpoint(path):
        raise CheckpointError(
            f"--ckpt_path {path} is not a complete sharded checkpoint (it lacks {DCP_INDEX} or {META_NAME}). "
            "Fix: give --ckpt_path last, or the last.ckpt of a run trained with strategy fsdp."
        )
    meta = safe_load(path / META_NAME, name=f"--ckpt_path {path}")
    hyper_parameters = dict(meta.get("hyper_parameters") or {})
    hyper_parameters.pop(CLI_INSTANTIATOR_KEY, None)
    class_path = hyper_parameters.pop(CLI_CLASS_PATH_KEY, None)
    reader = SafeFileSystemReader(path)
    index = reader.read_metadata()
    prefix = "state_dict."
    shapes = {
        key.removeprefix(prefix): tuple(entry.size)
        for key, entry in index.state_dict_metadata.items()
        if key.startswith(prefix) and hasattr(entry, "size")
    }
    run = (checkpoint_state.get(meta, "tracking") or {}).get("run")
    return CheckpointSummary(str(path), class_path, hyper_parameters, shapes, run if isinstance(run, dict) else None)
