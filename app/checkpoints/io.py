"""Saving and loading checkpoints: atomic writes, never-executing loads, clear errors.

- Writes go to a temporary file in the destination directory, fsynced, then `os.replace`d: a crash leaves the old file
  or the new one (Lightning writes through fsspec, without fsync).
- Every load uses `torch.load(..., weights_only=True)`, http(s) URLs included (Lightning defaults to False there).
- Every load first checks torch.save's per-record CRC32s (`refuse_bad_checksums`), which torch.load never reads.

No Lightning here; `SafeCheckpointIO` is in `app.cli`, exporting in `app.export`."""

from __future__ import annotations

import errno
import importlib
import io
import os
import pickle
import shutil
import tempfile
import urllib.request
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch
from torch import nn

from app.checkpoints import state as checkpoint_state
from app.errors import UserFacingError


class CheckpointError(UserFacingError):
    """A checkpoint that is missing, truncated, unsafe or for another model; one line says which."""


def atomic_write(path: str | Path, write: Callable[[BinaryIO], None]) -> None:
    """Call `write(file)` on a temporary file beside `path`, fsync it and rename it over `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(descriptor, "wb") as file:
            write(file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException as error:
        Path(temporary).unlink(missing_ok=True)
        refused = disk_error_in(error, path.parent)
        if refused is not None and not (isinstance(error, OSError) and error.filename):
            # torch.save's zip writer reports a full disk as "unexpected pos" while closing, with the OSError only in
            # the context (or nowhere): raise the cause the user can act on, with the path.
            raise OSError(refused.errno, refused.strerror, str(path)) from error
        raise
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)  # make the rename itself durable
    finally:
        os.close(directory)


# What torch's zip writer (caffe2 inline_container.cc) raises when a write of the file under it failed or came back
# short: its own RuntimeError, the OSError (if any) only in the exception's context.
ZIP_WRITER_FAILURES = ("unexpected pos", "PytorchStreamWriter failed writing")
LOW_SPACE_BYTES = 1 << 20  # a filesystem with less free than this after a failed write is called full


def disk_error_in(error: BaseException, directory: str | Path) -> OSError | None:
    """The disk's refusal behind a failed write into `directory`, or None (a bug keeps its traceback).

    The first OSError in `error`'s cause/context chain; for torch's zip writer's bare "unexpected pos" (a short write,
    or a chain DCP's pickling lost), ENOSPC where the filesystem is (nearly) full, else EIO."""
    seen: set[int] = set()
    current: BaseException | None = error
    zip_writer = False
    while current is not None and id(current) not in seen:
        if isinstance(current, OSError) and current.errno is not None:
            return current
        zip_writer = zip_writer or any(sign in str(current) for sign in ZIP_WRITER_FAILURES)
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    if not zip_writer:
        return None
    try:
        full = shutil.disk_usage(directory).free < LOW_SPACE_BYTES
    except OSError:
        full = False
    code = errno.ENOSPC if full else errno.EIO
    return OSError(code, os.strerror(code))


def gather_per_rank(state: Any) -> list[Any]:
    """Every rank's `state`, in rank order, on global rank 0 (the writer); [] elsewhere. A collective.

    Gathered to rank 0 only, not all-gathered, so that other ranks do not hold world size x PowerSGD's error feedback.
    """
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return [state]
    world_size = torch.distributed.get_world_size()
    if world_size == 1:
        return [state]
    rank = torch.distributed.get_rank()
    states: list[Any] | None = [None] * world_size if rank == 0 else None
    torch.distributed.gather_object(state, states, dst=0)
    return states if states is not None else []


def atomic_torch_save(obj: Any, path: str | Path) -> None:
    atomic_write(path, lambda file: torch.save(obj, file))


def remove_stale_temporaries(path: Path) -> None:
    """Delete temporaries of `path` left by a writer killed mid-save (only rank 0 writes, so none is in use)."""
    for stale in path.parent.glob(f".{path.name}.*.tmp"):
        stale.unlink(missing_ok=True)


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


# The URLs `safe_load` reads from. Nothing is written to a URL: see `refuse_url`.
DOWNLOADABLE = ("http://", "https://")


def refuse_url(path: Any, key: str, to_read: bool = False) -> None:
    """One line if `path` (the value of `key`) is a URL ddp-app cannot use.

    Saves need an atomic rename and `last` a directory listing: object stores (s3://, gs://) have neither. A checkpoint
    to read may be an http(s) URL."""
    text = str(path)
    if "://" not in text or (to_read and text.startswith(DOWNLOADABLE)):
        return
    if to_read:
        raise UserFacingError(
            f"{key}={text} is a URL ddp-app does not read checkpoints from (a filesystem path, or http(s)). "
            "Fix: copy the checkpoint to a local or network-mounted path first (aws s3 cp, gsutil cp, ...) "
            "and pass that path."
        )
    raise UserFacingError(
        f"{key}={text} is a URL: ddp-app writes checkpoints and logs only to a filesystem path (atomic "
        "saves, and --ckpt_path last lists the directory; docs/resume.md). Fix: a local directory or a "
        "network filesystem mounted on every node (NFS, Lustre, GPFS); copy the results to object storage "
        "after the run."
    )


def safe_load(path: str | Path, map_location: Any = "cpu", name: str | None = None) -> Any:
    """`torch.load` with `weights_only=True` for files and http(s) URLs, and one-line errors.

    A file torch.save did not write is refused from its first bytes (torch's unpickler would fail with a KeyError or
    advise weights_only=False). `name`: how the line names the checkpoint; default, its path."""
    source: str | Path | io.BytesIO = path
    if str(path).startswith(("http://", "https://")):
        try:
            with urllib.request.urlopen(str(path), timeout=60) as response:
                source = io.BytesIO(response.read())
        except OSError as error:
            raise CheckpointError(f"could not download checkpoint {path}: {_first_line(error)}") from error
        refuse_other_formats(source, path, name)
        refuse_bad_checksums(source, path)
    elif Path(path).is_dir():
        raise not_torch_save(path, name, "a directory")
    elif not Path(path).is_file():
        raise CheckpointError(f"checkpoint {path} does not exist. Fix: check the path (or use ckpt_path=last).")
    else:
        with open(path, "rb") as file:
            refuse_other_formats(file, path, name)
            refuse_bad_checksums(file, path)
    try:
        return torch.load(source, map_location=map_location, weights_only=True)
    except Exception as error:
        raise as_checkpoint_error(path, error) from error


# torch.save writes a zip archive (since torch 1.6) or, with `_use_new_zipfile_serialization=False`, a pickle stream
# that starts with this magic number (torch/serialization.py MAGIC_NUMBER, a LONG1 opcode).
ZIP_MAGIC = b"PK\x03\x04"
PICKLE_PROTOCOL_OPCODE = b"\x80"
TORCH_LEGACY_MAGIC = b"\x8a\x0a" + (0x1950A86A20F9469CFC6C).to_bytes(10, "little")
SNIFFED_BYTES = 4096


def not_a_checkpoint(name: str, what: str, fix: str | None = None) -> CheckpointError:
    """The one line for a file that is not a checkpoint at all; `what` says what it is instead."""
    return CheckpointError(
        f"{name} is not a checkpoint ({what}; a checkpoint is a file written by torch.save, like "
        "runs/digits/checkpoints/last.ckpt). Fix: "
        + (fix or "give the path of a .ckpt file, such as <trainer.default_root_dir>/checkpoints/last.ckpt.")
    )


def describe_other_format(file: BinaryIO, suffix: str = "") -> str | None:
    """What a file is when torch.save did not write it ("a text file", ...), from its first bytes; None when it has
    torch.save's format (a truncated or corrupt one is torch.load's to report)."""
    start = file.read(SNIFFED_BYTES)
    if not start:
        return "an empty file"
    if start.startswith(ZIP_MAGIC):
        names = _zip_names(file, start)
        if not names or any(name.endswith("/data.pkl") for name in names):
            if any("/code/" in name or name.endswith("/constants.pkl") for name in names):
                return "a TorchScript model written by torch.jit.save, which torch.jit.load reads"
            return None
        return f"a zip archive of other files: {', '.join(names[:3])}{', ...' if len(names) > 3 else ''}"
    if start.startswith(PICKLE_PROTOCOL_OPCODE):
        if TORCH_LEGACY_MAGIC in start[:32]:
            return None
        return "a Python pickle written by pickle.dump, not by torch.save"
    if start.startswith(b"\x1f\x8b"):
        return "a gzip-compressed file"
    if start[4:8] == b"\0\0\0\0" and start[8:10] == b'{"':  # a little-endian header length, then JSON
        return "a safetensors file"
    if b"\0" not in start:
        try:
            start.decode("utf-8")
        except UnicodeDecodeError as error:
            if error.start < len(start) - 3:  # not just a character cut by the read
                return "a binary file in another format"
        kind = {".yaml": "a YAML file", ".yml": "a YAML file", ".json": "a JSON file"}.get(suffix.lower())
        return kind or "a text file"
    return "a binary file in another format"


def _zip_names(file: BinaryIO, start: bytes) -> list[str]:
    """The names in a zip archive; for one whose end is cut off (a truncated save), its first name, from the first local
    file header (its name length at offset 26, the name at 30)."""
    try:
        file.seek(0)
        return zipfile.ZipFile(file).namelist()
    except (zipfile.BadZipFile, OSError, ValueError):
        if len(start) < 30:
            return []
        length = int.from_bytes(start[26:28], "little")
        return [start[30 : 30 + length].decode("utf-8", "replace")]


def refuse_other_formats(file: BinaryIO, path: str | Path, name: str | None) -> None:
    """Raise the one-line CheckpointError for a file that torch.save did not write; rewinds `file`."""
    what = describe_other_format(file, Path(str(path)).suffix)
    file.seek(0)
    if what is not None:
        raise not_torch_save(path, name, what)


# Files whose checksums matched in this process, by `_file_identity`: a file rewritten in place or replaced (a new save
# is renamed over the old one: another inode) is checked again.
_CHECKSUMS_MATCHED: set[tuple[int, int, int, int]] = set()


def _file_identity(file: BinaryIO) -> tuple[int, int, int, int] | None:
    """(device, inode, size, modification time in ns) of an open file; None for one in memory (a download)."""
    try:
        status = os.fstat(file.fileno())
    except (OSError, AttributeError, io.UnsupportedOperation):
        return None
    return status.st_dev, status.st_ino, status.st_size, status.st_mtime_ns


def refuse_bad_checksums(file: BinaryIO, path: str | Path) -> None:
    """Raise the one-line CheckpointError where a torch.save zip's data does not match its CRC32s; rewinds `file`.

    `torch.load` never checks them, so a flipped byte would load as a wrong weight. Files saved without checksums (all
    CRCs 0) and the legacy non-zip format have none to check."""
    start = file.read(len(ZIP_MAGIC))
    file.seek(0)
    if start != ZIP_MAGIC:
        return
    identity = _file_identity(file)
    if identity is not None and identity in _CHECKSUMS_MATCHED:
        return  # a resume loads its checkpoint up to three times (the CLI's checks, the tracker, Lightning)
    try:
        with zipfile.ZipFile(file) as archive:
            records = archive.infolist()
            if all(record.CRC == 0 for record in records if record.file_size):
                return
            bad = archive.testzip()
    except (zipfile.BadZipFile, OSError, ValueError, EOFError):
        return  # truncated or otherwise unreadable: torch.load's error names it (not remembered as checked)
    finally:
        file.seek(0)
    if bad is None:
        if identity is not None:
            _CHECKSUMS_MATCHED.add(identity)
        return
    raise CheckpointError(
        f"checkpoint {path} is corrupt: its record {bad} does not match the checksum torch.save wrote "
        "(the file changed after it was written: a failing disk or a bad copy). Fix: resume from an "
        "earlier checkpoint."
    )


def not_torch_save(path: str | Path, name: str | None, what: str) -> CheckpointError:
    if name is not None:
        return not_a_checkpoint(name, what)
    return CheckpointError(f"{path} is not a file written by torch.save ({what}). Fix: check the path.")


def as_checkpoint_error(path: str | Path, error: BaseException) -> BaseException:
    """The one-line CheckpointError for a failed `torch.load` of `path` (the error itself if unknown)."""
    message = str(error)
    if "Weights only load failed" in message or "Unsupported global" in message:
        return CheckpointError(
            f"refused to load {path}: it holds objects other than tensors and plain data, and unpickling "
            "it could run code. Fix: give a checkpoint written by ddp-app fit, or save this one again holding "
            "only tensors and plain data."
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


def check_shapes(
    expected: dict[str, tuple[int, ...]], found: dict[str, tuple[int, ...]], source: str, strict: bool = True
) -> None:
    """Raise a one-line error naming the first key whose presence (when `strict`) or shape differs."""
    for key in list(expected) + [key for key in found if key not in expected]:
        if key not in found or key not in expected:
            if strict:
                missing = f"it lacks {key!r}" if key not in found else f"unexpected key {key!r}"
                raise CheckpointError(
                    f"{source} does not fit this model: {missing}. Fix: use the config it was trained with."
                )
            continue
        if found[key] != expected[key]:
            raise CheckpointError(
                f"{source} does not fit this model: {key!r} has shape {found[key]} in the checkpoint but "
                f"{expected[key]} in the model. Fix: use the config it was trained with."
            )


def shapes(state: dict[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    return {key: tuple(value.shape) for key, value in state.items()}


def check_compatible(net: nn.Module, state: dict[str, torch.Tensor], source: str) -> None:
    """Raise a one-line error naming the first key whose presence or shape differs."""
    check_shapes(shapes(net.state_dict()), shapes(state), source)


# Where LightningCLI keeps the model's (or DataModule's) class path in a checkpoint's hyperparameters, and its own
# instantiator: private names of lightning.pytorch.cli, read here, in sharded.py and in export.py (docs/private_apis.md;
# guarded in tests/test_private_apis.py).
CLI_CLASS_PATH_KEY = "_class_path"
CLI_INSTANTIATOR_KEY = "_instantiator"


@dataclass(frozen=True)
class CheckpointSummary:
    """What a Lightning checkpoint says about the model it fits; the tensors themselves are dropped."""

    path: str
    class_path: str | None  # CLI_CLASS_PATH_KEY in the hyperparameters, saved by LightningCLI
    hyper_parameters: dict[str, Any]
    shapes: dict[str, tuple[int, ...]]
    run: dict[str, Any] | None = None  # the tracked run it belongs to (app/tracking/run.py CHECKPOINT_KEY)


# One read of a resumed checkpoint per process: the file a summary read, kept for the load that follows
# in the same process (`take_read_checkpoint`, once), keyed by the file's path, mtime and size so that
# a file rewritten in between is read again. The launcher drops it before it forks its ranks.
_READ_FOR_THE_LOAD: tuple[tuple[str, int, int], dict[str, Any]] | None = None


def _file_key(path: str | Path) -> tuple[str, int, int] | None:
    try:
        stat = os.stat(path)
    except OSError:  # a URL, or a file gone since
        return None
    return (os.path.realpath(path), stat.st_mtime_ns, stat.st_size)


def take_read_checkpoint(path: str | Path) -> dict[str, Any] | None:
    """The checkpoint `summarize_checkpoint` read from `path` in this process, once; None: read it."""
    global _READ_FOR_THE_LOAD
    kept, _READ_FOR_THE_LOAD = _READ_FOR_THE_LOAD, None
    if kept is None or kept[0] != _file_key(path):
        return None
    return kept[1]


# Checkpoints that another part of the run supplies at the moment `fit` loads a path, by the path's real path: a
# restarted replica group joins its peers there (app/parallel/ft_manager.py), once its Trainer, model and DataModule
# are set up, and resumes from their state instead of its own file when it is behind them.
_SUPPLIED_AT_LOAD: dict[str, Callable[[], dict[str, Any] | None]] = {}


def supply_at_load(path: str | Path, supplier: Callable[[], dict[str, Any] | None]) -> None:
    """When `path` is next loaded by SafeCheckpointIO: `supplier()`'s checkpoint instead, or the file if it gives
    None."""
    _SUPPLIED_AT_LOAD[os.path.realpath(path)] = supplier


def take_supplied_checkpoint(path: str | Path) -> dict[str, Any] | None:
    """The checkpoint supplied for `path` (`supply_at_load`), once; None: read the file."""
    supplier = _SUPPLIED_AT_LOAD.pop(os.path.realpath(path), None)
    return supplier() if supplier is not None else None


def forget_read_checkpoint() -> None:
    """Drop the kept checkpoint (a launcher, whose ranks load it themselves)."""
    global _READ_FOR_THE_LOAD
    _READ_FOR_THE_LOAD = None


def summarize_checkpoint(path: str | Path) -> CheckpointSummary:
    """Load a Lightning checkpoint (weights_only), keeping its model class, hyperparameters and shapes; refuse a file
    that is not one (Lightning would fail deep in every rank)."""
    checkpoint = safe_load(path, name=f"--ckpt_path {path}")
    if not isinstance(checkpoint, dict):
        raise CheckpointError(
            f"--ckpt_path {path} is not a checkpoint: torch.save wrote {_described(checkpoint)} there, where a "
            "Lightning checkpoint is a dict (state_dict, pytorch-lightning_version, ...). Fix: give --ckpt_path a "
            ".ckpt written by ddp-app fit, such as <trainer.default_root_dir>/checkpoints/last.ckpt."
        )
    if not {"state_dict", "pytorch-lightning_version"} <= checkpoint.keys():
        if checkpoint and all(isinstance(v, torch.Tensor) for v in checkpoint.values()):
            raise CheckpointError(
                f"{path} is an exported weights file (a bare state_dict, as `python -m app.export` "
                "writes), not a Lightning checkpoint: load it into the network with "
                f"net.load_state_dict(torch.load('{path}', weights_only=True)). "
                "Fix: give --ckpt_path the .ckpt it was exported from."
            )
        raise CheckpointError(
            f"{path} is not a Lightning checkpoint (it has no 'state_dict' or 'pytorch-lightning_version'). "
            "Fix: give --ckpt_path a .ckpt written by ddp-app fit."
        )
    global _READ_FOR_THE_LOAD
    key = _file_key(path)
    _READ_FOR_THE_LOAD = (key, checkpoint) if key is not None else None
    hyper_parameters = dict(checkpoint.get("hyper_parameters") or {})
    hyper_parameters.pop(CLI_INSTANTIATOR_KEY, None)
    class_path = hyper_parameters.pop(CLI_CLASS_PATH_KEY, None)
    run = (checkpoint_state.get(checkpoint, "tracking") or {}).get("run")
    return CheckpointSummary(
        str(path),
        class_path,
        hyper_parameters,
        shapes(checkpoint["state_dict"]),
        run if isinstance(run, dict) else None,
    )


def _described(saved: object) -> str:
    """What torch.save saved, for a user: "a tensor of shape (3,)", "a list of 2 items"."""
    if isinstance(saved, torch.Tensor):
        return f"a tensor of shape {tuple(saved.shape)}"
    if isinstance(saved, (list, tuple)):
        return f"a {type(saved).__name__} of {len(saved)} items"
    return f"a {type(saved).__name__}"


def _resolve_class(class_path: str) -> object:
    """The class a dotted path names, or the path itself when it cannot be imported."""
    module_name, _, name = class_path.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError, ValueError):
        return class_path


def check_model_class(checkpoint: CheckpointSummary, configured_class_path: str) -> None:
    """Refuse a checkpoint of another LightningModule class (LightningCLI would silently build the checkpoint's)."""
    if checkpoint.class_path is None or checkpoint.class_path == configured_class_path:
        return  # no class saved (not made through LightningCLI): the shapes check decides
    if _resolve_class(checkpoint.class_path) != _resolve_class(configured_class_path):
        raise CheckpointError(
            f"checkpoint {checkpoint.path} was made with model {checkpoint.class_path}, but the config builds "
            f"{configured_class_path}. Fix: use the config it was trained with (model.class_path: "
            f"{checkpoint.class_path}), or a checkpoint of {configured_class_path}."
        )


def check_overrides(checkpoint: CheckpointSummary, overrides: dict[str, Any]) -> None:
    """Refuse a command-line model argument that contradicts the checkpoint's (LightningCLI would drop it silently)."""
    for key, value in overrides.items():
        if key in checkpoint.hyper_parameters and checkpoint.hyper_parameters[key] != value:
            stored = checkpoint.hyper_parameters[key]
            raise CheckpointError(
                f"--model.init_args.{key}={value} contradicts checkpoint {checkpoint.path}, which was trained with "
                f"{key}={stored}. Fix: drop --model.init_args.{key} to use the checkpoint's {stored}, or start a "
                "new run without --ckpt_path."
            )


def check_state_fits(checkpoint: CheckpointSummary, model: nn.Module) -> None:
    """The check Lightning's `load_state_dict` makes, before anything is written, in one line."""
    strict = getattr(model, "strict_loading", True)  # a LightningModule may allow missing or extra keys
    check_shapes(shapes(model.state_dict()), checkpoint.shapes, f"checkpoint {checkpoint.path}", strict=strict)


def load_net_weights(net: nn.Module, state: dict[str, torch.Tensor], source: str = "checkpoint") -> None:
    check_compatible(net, state, source)
    net.load_state_dict(state)


def exportable_state_dict(checkpoint: dict[str, Any], source: str = "checkpoint") -> dict[str, torch.Tensor]:
    """What `python -m app.export` writes: the bare network (`net.*` keys without the prefix) when the LightningModule
    has a `net`, else the module's own weights, exactly as in the checkpoint."""
    state = net_state_dict(checkpoint) or checkpoint["state_dict"]
    if not state:
        raise CheckpointError(
            f"{source} holds no weights to export (its 'state_dict' is empty). "
            "Fix: export a checkpoint written by a run that trained a model with parameters."
        )
    return state


def export_state_dict(ckpt_path: str | Path, out_path: str | Path) -> dict[str, torch.Tensor]:
    """Write the exportable state_dict of a Lightning checkpoint; it loads with weights_only=True."""
    state = exportable_state_dict(safe_load(ckpt_path), str(ckpt_path))
    atomic_torch_save(state, out_path)
    return state
