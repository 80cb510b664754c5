"""Strategy fsdp's checkpoint I/O: every rank writes its shards through DCP into a fresh directory, published atomically
(layout: app/checkpoints/sharded.py); a load reshards onto this run's mesh.

Same save, load, remove and `prepare_write` as `SafeCheckpointIO`, so `BackgroundCheckpointIO` writes either through the
one `BackgroundWriter`. It is the strategy's `checkpoint_io`; `FSDP2Strategy` calls its save on every rank and its load
with the module and optimizers. A disk that refuses a save on any rank ends it on every rank in one line
(`write_failed`), the previous checkpoint still published."""

from __future__ import annotations

import functools
import shutil
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from app.checkpoints.io import CheckpointError, atomic_torch_save, disk_error_in, safe_load
from app.checkpoints.plugin import (
    CheckpointWriteError,
    Write,
    changed_while_copied,
    snapshot,
    stage,
    write_failed,
)
from app.checkpoints.sharded import (
    META_NAME,
    SafeFileSystemReader,
    SafeLoadPlanner,
    is_sharded_checkpoint,
    load_whole,
    new_shards_directory,
    publish,
    remove_sharded,
    remove_unpublished,
)
from app.checkpoints.staging import HostStaging


class ShardedCheckpointIO(CheckpointIO):
    """Sharded checkpoints, written by every rank and published by rank 0 (app/checkpoints/sharded.py).

    Args:
        timeout: of the checkpoints' own process group (gloo, made at the first save), where the
            path is agreed and background writes run their collectives; None: torch's default."""

    def __init__(self, timeout: timedelta | None = None) -> None:
        self.timeout = timeout
        self._group: dist.ProcessGroup | None = None

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        """Every rank writes its shards (DCP, over the default process group); rank 0 writes meta.pt first and publishes
        the directory under `path` once DCP's index is written after every rank's shards. A collective: every rank calls
        it."""
        if storage_options is not None:
            raise TypeError("ShardedCheckpointIO takes no storage_options (checkpoints go to a path).")
        tensors, path, shards = self._begin(checkpoint, path)
        try:
            dcp.save(tensors, storage_writer=SafeFileSystemWriter(shards))
        except CheckpointException as error:
            self._failed(path, shards, error)
        self._publish(shards, path)

    def prepare_write(self, checkpoint: dict[str, Any], path: Any, staging: HostStaging, late: dict[int, str]) -> Write:
        """A background save's training-thread part: path agreed, meta.pt written, this rank's shards copied to host
        (`late` storages copied by `stage` on the writer thread).

        The writes, DCP's index and publishing run on the writer thread over the checkpoints' own gloo group (DCP's
        background collectives need a CPU group apart from training's)."""
        tensors, path, shards = self._begin(checkpoint, path)
        staged = snapshot(tensors, staging, late)
        copy_late = functools.partial(self._copy_late, staging) if late else None
        return self._write_staged, (staged, path, shards, None), copy_late

    def load_checkpoint(
        self,
        path: Any,
        map_location: Any = None,
        weights_only: bool | None = None,
        *,
        module: nn.Module | None = None,
        optimizers: list[torch.optim.Optimizer] | tuple = (),
        strict: bool = True,
    ) -> dict[str, Any]:
        """With `module` (a collective): this rank's weights and optimizer states loaded in place (DCP reshards), the
        rest returned. Without: the whole checkpoint in this process (`load_whole`). Nothing read runs code."""
        path = Path(self._from_rank_zero([str(path)], dist.group.WORLD)[0]) if _distributed() else Path(path)
        if not is_sharded_checkpoint(path):
            raise CheckpointError(
                f"{path} is not a sharded checkpoint, which strategy fsdp resumes from (loading a DDP checkpoint "
                "into a sharded model is not built yet). Fix: resume it with the strategy it was trained with."
            )
        if module is None:
            return load_whole(path)
        model_state = {"state_dict": get_model_state_dict(module)}
        dcp.load(model_state, storage_reader=SafeFileSystemReader(path), planner=SafeLoadPlanner())
        set_model_state_dict(module, model_state["state_dict"], options=StateDictOptions(strict=strict))
        # One load per optimizer, after the weights (as Lightning's own sharded load does).
        for index, optimizer in enumerate(optimizers):
            key = f"optimizer_{index}"
            optimizer_state = {key: get_optimizer_state_dict(module, optimizer)}
            dcp.load(optimizer_state, storage_reader=SafeFileSystemReader(path), planner=SafeLoadPlanner())
            set_optimizer_state_dict(module, optimizer, optimizer_state[key])
        return safe_load(path / META_NAME, name=f"--ckpt_path {path}")

    def remove_checkpoint(self, path: Any) -> None:
        """Rank 0 (Lightning's `Strategy.remove_checkpoint`): the link and the directory it points to."""
        remove_sharded(Path(path))

    def _begin(self, checkpoint: dict[str, Any], path: Any) -> tuple[dict[str, Any], Path, Path]:
        """On the training thread, every rank: the tensors taken out of `checkpoint` (for DCP); rank 0 makes the new
        shards directory and writes the rest into its meta.pt, and every rank learns rank 0's path, directory and
        outcome (a refused write ends the save on every rank alike)."""
        group = self._checkpoint_group()
        tensors = {"state_dict": checkpoint.pop("state_dict")}
        for index, optimizer_state in enumerate(checkpoint.pop("optimizer_states", [])):
            tensors[f"optimizer_{index}"] = optimizer_state
        agreed: list[Any] = [None, None, None]
        if _rank_zero():
            path = Path(path)
            shards = new_shards_directory(path)
            agreed = [str(path), str(shards), None]
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                remove_unpublished(path)  # directories of saves a kill or a full disk interrupted
                shards.mkdir()
                atomic_torch_save(checkpoint, shards / META_NAME)
            except OSError as error:
                shutil.rmtree(shards, ignore_errors=True)
                agreed[2] = str(write_failed(path, error))
        path, shards, failure = self._from_rank_zero(agreed, group)
        if failure is not None:
            raise CheckpointWriteError(failure)
        return tensors, Path(path), Path(shards)

    def _copy_late(self, staging: HostStaging, staged: dict[str, Any], path: Path, shards: Path, _: Any) -> tuple:
        """On the writer's thread (`last_checkpoint.overlap_copy`): the late copies made (`stage`); a change seen while
        they were made is held for `_write_staged` to fail the save on every rank."""
        try:
            staged, *_ = stage(staging, staged, path)
        except CheckpointWriteError as torn:
            return staged, path, shards, torn
        return staged, path, shards, None

    def _write_staged(
        self, staged: dict[str, Any], path: Path, shards: Path, torn: CheckpointWriteError | None
    ) -> None:
        """On the writer thread: a blocking `dcp.save` of the staged shards, then rank 0 moves the link.

        One all-reduce first tells every rank whether any late copy was `torn`, so all fail that save alike. Not
        `dcp.async_save`: its upload thread ran at training's priority (docs/performance.md)."""
        changed = torch.tensor([dist.get_rank() + 1 if torn is not None else 0], dtype=torch.int32)
        dist.all_reduce(changed, op=dist.ReduceOp.MAX, group=self._group)
        if changed.item():
            if _rank_zero():
                shutil.rmtree(shards, ignore_errors=True)
            other = f"a parameter or optimizer state on rank {int(changed.item()) - 1}"
            raise torn or changed_while_copied(path, other)
        try:
            dcp.save(staged, storage_writer=SafeFileSystemWriter(shards), process_group=self._group)
        except CheckpointException as error:
            self._failed(path, shards, error)
        self._publish(shards, path, self._group)

    def _publish(self, shards: Path, path: Path, group: Any = None) -> None:
        """Rank 0 moves the link; every rank learns whether it could (one broadcast)."""
        failure = None
        if _rank_zero():
            try:
                publish(shards, path)
            except OSError as error:
                if path.resolve() != shards.resolve():  # not published: the previous checkpoint stays
                    shutil.rmtree(shards, ignore_errors=True)
                failure = str(write_failed(path, error))
        (failure,) = self._from_rank_zero([failure], group if group is not None else dist.group.WORLD)
        if failure is not None:
            raise CheckpointWriteError(failure)

    @staticmethod
    def _failed(path: Path, shards: Path, error: CheckpointException) -> None:
        """Every rank, after DCP raised on every rank: the one line of a save the disk refused on some rank, else DCP's
        own error (a bug's tracebacks); rank 0 removes the unfinished shards."""
        one_line = sharded_write_error(path, error)
        if _rank_zero():
            shutil.rmtree(shards, ignore_errors=True)  # space a full disk needs back; never published
        if one_line is None:
            raise error
        raise one_line from error

    def _checkpoint_group(self) -> Any:
        """The checkpoints' own process group, made at the first save (on every rank: a collective)."""
        if self._group is None and _distributed():
            self._group = dist.new_group(backend="gloo", timeout=self.timeout)
        return self._group

    @staticmethod
    def _from_rank_zero(values: list[Any], group: Any) -> list[Any]:
        if _distributed():
            dist.broadcast_object_list(values, src=0, group=group)
        return values


def sharded_write_error(path: Path, error: CheckpointException) -> CheckpointWriteError | None:
    """The one line for a sharded save the disk refused on some rank, as a file's save says it (`write_failed`); None
    for any other failure, which keeps DCP's per-rank tracebacks."""
    for rank, (failure, _) in sorted(error.failures.items()):
        refused = disk_error_in(failure, path.parent)  # torch's zip writer's errors too
        if refused is not None:
            return write_failed(path, refused, f" (rank {rank}'s shards)")
    return None


class SafeFileSystemWriter(FileSystemWriter):
    """DCP's file writer, raising refused writes as their OSError (errno kept) on the failing rank, since DCP's pickled
    failures drop the cause (`disk_error_in`)."""

    def write_data(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().write_data(*args, **kwargs)
        except Exception as error:
            _raise_disk_error(error, self.path)
            raise

    def finish(self, *args: Any, **kwargs: Any) -> None:
        try:
            super().finish(*args, **kwargs)
        except Exception as error:
            _raise_disk_error(error, self.path)
            raise


def _raise_disk_error(error: Exception, directory: Any) -> None:
    """Raise the OSError a refused write into `directory` hides in `error`; return for any other."""
    refused = disk_error_in(error, directory)
    if refused is not None and refused is not error:
        raise OSError(refused.errno, refused.strerror) from error


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank_zero() -> bool:
    return not _distributed() or dist.get_rank() == 0
