"""Saving, loading and exporting checkpoints: atomic writes, never-executing loads, clear errors.

- Writes go to a temporary file in the destination directory, are flushed and fsynced, and then
  `os.replace`d over the target: a crash leaves the old file or the new one, never half of one.
  (Lightning serialises into memory and then writes through fsspec, without fsync.)
- Every load uses `torch.load(..., weights_only=True)`, also for http(s) URLs (Lightning defaults
  to `weights_only=False` for those): a checkpoint whose unpickling would run code is refused.

No Lightning here: the datasets the reference trainer shares load tensor files with `safe_load`.
Lightning's side, `SafeCheckpointIO`, is in `app.cli`.
"""

from __future__ import annotations

import io
import os
import pickle
import tempfile
import urllib.request
import zipfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

from app.errors import UserFacingError


class CheckpointError(UserFacingError):
    """A checkpoint that is missing, truncated, unsafe or for another model; one line says which."""


def atomic_torch_save(obj: Any, path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(descriptor, "wb") as file:
            torch.save(obj, file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)  # make the rename itself durable
    finally:
        os.close(directory)


def remove_stale_temporaries(path: Path) -> None:
    """Delete temporaries of `path` left by a writer that was killed mid-save.

    Only global rank 0 writes checkpoints, so no temporary of this name can be in use right now.
    """
    for stale in path.parent.glob(f".{path.name}.*.tmp"):
        stale.unlink(missing_ok=True)


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def safe_load(path: str | Path, map_location: Any = "cpu") -> Any:
    """`torch.load` with `weights_only=True` for files and http(s) URLs, and one-line errors."""
    source: str | Path | io.BytesIO = path
    if str(path).startswith(("http://", "https://")):
        try:
            with urllib.request.urlopen(str(path), timeout=60) as response:
                source = io.BytesIO(response.read())
        except OSError as error:
            raise CheckpointError(f"could not download checkpoint {path}: {_first_line(error)}") from error
    elif not Path(path).is_file():
        raise CheckpointError(f"checkpoint {path} does not exist. Fix: check the path (or use ckpt_path=last).")
    try:
        return torch.load(source, map_location=map_location, weights_only=True)
    except Exception as error:
        raise as_checkpoint_error(path, error) from error


def as_checkpoint_error(path: str | Path, error: BaseException) -> BaseException:
    """The one-line CheckpointError for a failed `torch.load` of `path` (the error itself if unknown)."""
    message = str(error)
    if "Weights only load failed" in message or "Unsupported global" in message:
        return CheckpointError(
            f"refused to load {path}: it holds objects other than tensors and plain data, and unpickling "
            "it could run code. Only a file you trust may be loaded with torch.load(weights_only=False)."
        )
    if isinstance(error, (RuntimeError, EOFError, zipfile.BadZipFile, ValueError, OSError, pickle.UnpicklingError)):
        return CheckpointError(
            f"checkpoint {path} is truncated or corrupt ({_first_line(error)}). Fix: resume from an earlier checkpoint."
        )
    return error


def net_state_dict(checkpoint: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The bare network's state_dict inside a Lightning checkpoint (keys `net.*` without the prefix)."""
    state = checkpoint.get("state_dict")
    if not isinstance(state, dict):
        raise CheckpointError("this file is not a Lightning checkpoint (it has no 'state_dict').")
    return {key.removeprefix("net."): value for key, value in state.items() if key.startswith("net.")}


def check_compatible(net: nn.Module, state: dict[str, torch.Tensor], source: str) -> None:
    """Raise a one-line error naming the first key whose presence or shape differs."""
    expected = net.state_dict()
    for key in list(expected) + [key for key in state if key not in expected]:
        if key not in state:
            raise CheckpointError(f"{source} does not fit this model: it lacks {key!r}.")
        if key not in expected:
            raise CheckpointError(f"{source} does not fit this model: unexpected key {key!r}.")
        if tuple(state[key].shape) != tuple(expected[key].shape):
            raise CheckpointError(
                f"{source} does not fit this model: {key!r} has shape {tuple(state[key].shape)} in the "
                f"checkpoint but {tuple(expected[key].shape)} in the model. Fix: use the config it was trained with."
            )


def load_net_weights(net: nn.Module, state: dict[str, torch.Tensor], source: str = "checkpoint") -> None:
    check_compatible(net, state, source)
    net.load_state_dict(state)


def export_net(ckpt_path: str | Path, out_path: str | Path) -> dict[str, torch.Tensor]:
    """Write the bare `nn.Module` state_dict from a Lightning checkpoint; loadable with weights_only=True."""
    state = net_state_dict(safe_load(ckpt_path))
    atomic_torch_save(state, out_path)
    return state
