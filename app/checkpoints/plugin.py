"""The Trainer's checkpoint I/O: Lightning's own, made atomic and safe to load, written in the background by default.

`SafeCheckpointIO` (a file from rank 0) or, under fsdp, `ShardedCheckpointIO` (app/checkpoints/sharded_io.py), each
wrapped in `BackgroundCheckpointIO` for background saves; both go through the one `BackgroundWriter`."""

from __future__ import annotations

import contextlib
import copy
import functools
import os
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.plugins.io import AsyncCheckpointIO
from lightning_utilities.core.apply_func import apply_to_collection

from app.checkpoints.io import (
    atomic_torch_save,
    forget_read_checkpoint,
    refuse_url,
    remove_stale_temporaries,
    safe_load,
    take_read_checkpoint,
    take_supplied_checkpoint,
)
from app.checkpoints.staging import HostStaging, storage_key
from app.errors import UserFacingError
from app.private_apis import require

Stage = Callable[..., tuple[Any, ...]]  # a write's arguments -> the ones it writes, copied (`stage`)
# What a checkpoint I/O hands the writer for a background save (`prepare_write`): the write, its arguments, and the late
# copy to make of them first on the writer thread (None: none).
Write = tuple[Callable[..., None], tuple[Any, ...], Stage | None]
OVERLAP_CHECK = "last_checkpoint.overlap_copy's check that no parameter changed while a save copied it"
WRITER_NICENESS = 10  # about a tenth of a core's time against a training thread at 0 (the kernel's weights)


class CheckpointWriteError(UserFacingError):
    """A checkpoint that could not be written (disk full, read-only or missing directory)."""


def write_failed(path: Any, error: OSError, part: str = "") -> CheckpointWriteError:
    """The one line for a checkpoint the disk refused (full, read-only, missing directory); `part` names what of it
    failed where several processes write one (`" (rank 1's shards)"`)."""
    reason = error.strerror or str(error)
    return CheckpointWriteError(
        f"could not write the checkpoint {path}{part}: {reason[:1].lower()}{reason[1:]}; the previous checkpoint "
        f"there, if any, is unchanged. Fix: free space on, or make writable, {Path(path).parent} (or set "
        "trainer.default_root_dir elsewhere), then continue with --ckpt_path last."
    )


class SafeCheckpointIO(TorchCheckpointIO):
    """Lightning's checkpoint I/O with atomic, fsynced saves and `weights_only=True` loads."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None:  # as Lightning's TorchCheckpointIO: they would be ignored
            raise TypeError(
                "SafeCheckpointIO takes no storage_options: those configure fsspec's remote storage, and "
                "ddp-app writes checkpoints to a filesystem path only (docs/resume.md)."
            )
        refuse_url(path, "checkpoint path")
        try:
            remove_stale_temporaries(Path(path))
            atomic_torch_save(checkpoint, path)
        except OSError as error:
            raise write_failed(path, error) from error

    def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: bool | None = None) -> dict[str, Any]:
        checkpoint = take_supplied_checkpoint(path)
        if checkpoint is not None:  # a peer's state (a restarted replica group): the summary's read is stale
            forget_read_checkpoint()
        elif map_location in (None, "cpu"):
            checkpoint = take_read_checkpoint(path)
        if checkpoint is None:
            checkpoint = safe_load(path, map_location=map_location if map_location is not None else "cpu")
        # Lightning calls the callbacks' on_load_checkpoint only if the checkpoint has a "callbacks" entry
        # (`call._call_callbacks_on_load_checkpoint`); a converted one (app.parity) may not, and ExactResume must see
        # every checkpoint a run resumes from, or it counts from epoch 0.
        if isinstance(checkpoint, dict):
            checkpoint.setdefault("callbacks", {})
        return checkpoint

    def prepare_write(self, checkpoint: dict[str, Any], path: Any, staging: HostStaging, late: dict[int, str]) -> Write:
        """A background save's part on the training thread: the whole checkpoint copied to host memory (`snapshot`, less
        the `late` storages, copied on the writer thread by `stage`)."""
        copied = snapshot(checkpoint, staging, late)
        return self.save_checkpoint, (copied, path, None), functools.partial(stage, staging) if late else None


def version(tensor: torch.Tensor) -> int:
    """How many in-place changes torch counted on `tensor` and the views that share its counter (a state dict's detached
    entries). A DTensor counts its own: an in-place op on a DTensor parameter leaves its local shard's counter as it
    was."""
    return require(tensor, "_version", "torch", OVERLAP_CHECK, owner_name="torch.Tensor")  # docs/private_apis.md


def snapshot(checkpoint: dict[str, Any], staging: HostStaging, late: dict[int, str] | None = None) -> dict[str, Any]:
    """A copy of `checkpoint` the next steps cannot change: tensors copied to host (`staging`'s buffers), the rest
    deep-copied.

    Tensors in the storages `late` (what an optimizer step changes) are held as `LateCopy`, for `stage` to copy on the
    writer thread."""
    copies: dict[int, Any] = {}  # deepcopy's memo: these are copies already (or held as they are)
    staging.begin()

    def to_host(tensor: torch.Tensor) -> Any:
        name = (late or {}).get(storage_key(tensor))
        copied: Any = LateCopy(tensor, name) if name else staging.copy(tensor)
        copies[id(copied)] = copied
        return copied

    copied = copy.deepcopy(apply_to_collection(checkpoint, torch.Tensor, to_host), copies)
    staging.finish()
    return copied


class LateCopy:
    """A tensor of a `snapshot` still shared with training, and its in-place version at the save."""

    def __init__(self, tensor: torch.Tensor, name: str) -> None:
        self.tensor = tensor
        self.name = name
        self.version = version(tensor)

    def copied(self, path: Any, staging: HostStaging) -> torch.Tensor:
        copied = staging.copy(self.tensor)
        if version(self.tensor) != self.version:
            raise changed_while_copied(path, self.name)
        return copied


def changed_while_copied(path: Any, name: str) -> CheckpointWriteError:
    """The one line for a save whose late copy a change outside the optimizer's step may have torn (`name`, as
    `stepped_storages` names it, or "a parameter or optimizer state on rank N")."""
    return CheckpointWriteError(
        f"could not write the checkpoint {path}: {name} changed "
        "outside an optimizer step while the save copied it (last_checkpoint.overlap_copy: true); the previous "
        "checkpoint there, if any, is unchanged. Fix: set last_checkpoint.overlap_copy: false where the module "
        "changes its weights itself (an EMA swap, a clamp), then continue with --ckpt_path last."
    )


def stage(staging: HostStaging, checkpoint: dict[str, Any], path: Any, *rest: Any) -> tuple[Any, ...]:
    """On the writer thread: the `snapshot`'s late tensors copied into `staging`, the snapshot's own, before the next
    optimizer step."""
    checkpoint = apply_to_collection(checkpoint, LateCopy, lambda late: late.copied(path, staging))
    staging.finish()
    return checkpoint, path, *rest


class BackgroundWriter:
    """Checkpoint writes on one background thread, for both I/Os `BackgroundCheckpointIO` wraps.

    - at most one write in flight (a save waits for the previous one, and says so when it took long), so host memory
      holds one copy;
    - writes and removals run in order, on a lower-priority thread;
    - a failed write stops every later write and removal, and its one line (`CheckpointWriteError`) is raised by the
      next save, `wait` or teardown;
    - only training's saves are in the background (`start_background_writes`); stops and the end of training wait for
      them (`finish_writes`), later saves are synchronous;
    - `saves_started` / `saves_written` count saves asked for and on disk (app/tracking/run.py reads them);
    - with `overlap_copy`, parameters and optimizer state are copied on the writer thread during the next step's forward
      and backward, and its optimizer step waits for the copy (`watch`, `wait_for_staging`), as torchtitan does."""

    SLOW_WAIT_S = 1.0  # a wait for the previous write at least this long is said in the log...
    NOTICE_EVERY_S = 600.0  # ...at most this often

    def __init__(self, overlap_copy: bool = False) -> None:
        self.overlap_copy = overlap_copy
        self._thread: ThreadPoolExecutor | None = None
        self._in_flight: Future | None = None
        self._failure: BaseException | None = None
        self._next_notice = 0.0
        self.in_background = False
        self.saves_started = 0
        self.saves_written = 0
        # Called on the writer thread as each background write starts (before its late copy, if any). resume-check's
        # StopAt holds a write there, so that its kill lands while the write is in flight however fast the disk is.
        self.before_write: Callable[[], None] | None = None
        # The copy the next optimizer step waits for (`overlap_copy`): a Future done once it is made.
        self._staging: Future | None = None
        self.staging_wait_s = 0.0  # how long optimizer steps waited for it, in all
        # The writer thread's CPU time in its writes (late copies included), in all: on a CPU that training keeps busy,
        # about what the steps beside the writes lose (`python -m app.bench.save_fits`).
        self.write_cpu_s = 0.0
        self._watched: list[Any] = []  # (the module and optimizers whose state is copied late, hook handles)

    def begin_save(self, name: str) -> bool:
        """Where every save starts: wait for the previous write. True: write this one with `write_in_background`, from a
        copy the training steps cannot change; False: write it now, then call `written`."""
        started = time.monotonic()
        self.saves_started += 1
        self.wait()
        waited = time.monotonic() - started
        if self.in_background and waited >= self.SLOW_WAIT_S and started >= self._next_notice:
            self._next_notice = started + self.NOTICE_EVERY_S
            print(
                f"ddp-app: this save of {name} waited {waited:.1f} s for the previous checkpoint write: saves come "
                "faster than the disk writes them (last_checkpoint.every_n_seconds / every_n_steps, ModelCheckpoint's "
                "every_n_*).",
                flush=True,
            )
        return self.in_background

    def written(self) -> None:
        """A save `begin_save` said to write now is on disk."""
        self.saves_written += 1

    def write_in_background(self, write: Callable[..., None], *args: Any, stage: Stage | None = None) -> None:
        """`write(*args)` on the writer thread; the save counts as written once it returns. With `stage`,
        `write(*stage(*args))`, and the next optimizer step waits until `stage` returned."""
        staging: Future | None = None
        if stage is not None:
            staging = self._staging = Future()
        self._submit(self._write, write, stage, staging, *args)

    def _write(self, write: Callable[..., None], stage: Stage | None, staging: Future | None, *args: Any) -> None:
        started = time.thread_time()
        try:
            try:
                if self.before_write is not None:
                    self.before_write()
                if stage is not None:
                    args = stage(*args)
            finally:
                if staging is not None:
                    staging.set_result(None)  # a failed copy is this write's failure, reported as any other
            write(*args)
            self.saves_written += 1
        finally:
            self.write_cpu_s += time.thread_time() - started

    def watch(self, module: torch.nn.Module, optimizers: list[torch.optim.Optimizer]) -> None:
        """From training's start (`start_background_writes`), with `overlap_copy`: every optimizer's `step` first waits
        for the last save's copy of the state it changes."""
        self.unwatch()
        hooks = [optimizer.register_step_pre_hook(self._before_optimizer_step) for optimizer in optimizers]
        self._watched = [module, optimizers, hooks]

    def unwatch(self) -> None:
        if self._watched:
            for hook in self._watched[2]:
                hook.remove()
        self._watched = []

    @property
    def copies_late(self) -> bool:
        """Whether saves copy the parameters and optimizer state late (`overlap_copy`, during training): the same on
        every rank, so every rank takes the same save path and its collectives."""
        return self.overlap_copy and bool(self._watched)

    def stepped_storages(self) -> dict[int, str]:
        """The storages an optimizer step changes, by their names (`parameter 0.weight`, `optimizer 0's exp_avg of
        0.weight`), of the watched module: a save copies them late, on the writer thread. Empty without `overlap_copy`.
        """
        if not self.copies_late:
            return {}
        module, optimizers, _ = self._watched
        names = {id(parameter): name for name, parameter in module.named_parameters()}
        late = {storage_key(parameter): f"parameter {name}" for name, parameter in module.named_parameters()}
        for index, optimizer in enumerate(optimizers):
            for parameter, state in optimizer.state.items():
                owner = names.get(id(parameter), "a parameter outside the module")
                for key, value in state.items():
                    if isinstance(value, torch.Tensor):
                        late.setdefault(storage_key(value), f"optimizer {index}'s {key} of {owner}")
        late.pop(0, None)
        return late

    def _before_optimizer_step(self, optimizer: Any, args: tuple, kwargs: dict) -> None:
        # Given a closure (Lightning's automatic optimization: the forward and backward run inside `step`), the update
        # comes after it: Lightning's `on_before_optimizer_step`, inside the closure, waits there
        # (app/run/coordinator.py), so that the copy overlaps them. `args` are `step`'s own, the optimizer first.
        if kwargs.get("closure") is not None or len(args) > 1 and args[1] is not None:
            return
        self.wait_for_staging()

    def wait_for_staging(self) -> None:
        """Block until the last save's late copy (if any) is made."""
        staging, self._staging = self._staging, None
        if staging is not None and not staging.done():
            started = time.monotonic()
            wait_futures([staging])  # its failure, if any, is the write's: reported by `wait`
            self.staging_wait_s += time.monotonic() - started

    def remove(self, remove: Callable[..., None], *args: Any) -> None:
        """`remove(*args)` queued behind the write before it: a ModelCheckpoint removes its previous best once the new
        one is on disk."""
        self._submit(remove, *args)
        if not self.in_background:
            self.wait()

    def _submit(self, task: Callable[..., None], *args: Any) -> None:
        if self._thread is None:
            self._thread = ThreadPoolExecutor(1, "ddp-app-checkpoint-writer", initializer=_yield_to_training)
        self._in_flight = self._thread.submit(self._run, task, *args)

    def _run(self, task: Callable[..., None], *args: Any) -> None:
        if self._failure is not None:  # after a failed write, nothing on disk changes until it is reported
            return
        try:
            task(*args)
        except BaseException as error:  # a CheckpointWriteError, or a bug raised with its traceback by `wait`
            self._failure = error

    def writing(self) -> bool:
        """Whether a write is in flight now."""
        return self._in_flight is not None and not self._in_flight.done()

    def wait(self) -> None:
        """Block until every write queued so far is on disk; raise a failed one's error (once)."""
        self.wait_for_staging()
        if self._in_flight is not None:
            self._in_flight.result()  # `_run` raises nothing; the writes are in order (one thread)
            self._in_flight = None
        failure, self._failure = self._failure, None
        if failure is not None:
            raise failure

    def teardown(self) -> None:
        """At the Trainer's teardown, also after an exception: the writes finish; a failed one is raised, or printed if
        the run already fails with another error (which keeps its own report)."""
        handling = sys.exc_info()[1]
        try:
            self.wait()
        except Exception as failure:
            if handling is None:
                raise
            print(f"ddp-app: error: {failure}", file=sys.stderr, flush=True)
        finally:
            self.unwatch()
            if self._thread is not None:
                self._thread.shutdown(wait=True)
                self._thread = None


class BackgroundCheckpointIO(AsyncCheckpointIO):
    """A checkpoint I/O's saves written by a `BackgroundWriter`: a save blocks training only for its `prepare_write` (a
    copy to host memory).

    Lightning's `AsyncCheckpointIO` is the base for its wrapping and loads, not its saves (unbounded queue, on-device
    clones, a failed write raised raw later). `checkpoint_io`: one with a `prepare_write`."""

    def __init__(self, checkpoint_io: CheckpointIO | None = None, overlap_copy: bool = False) -> None:
        super().__init__(checkpoint_io or SafeCheckpointIO())
        self.writer = BackgroundWriter(overlap_copy)
        self.staging = HostStaging()

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        checkpoint_io = self.checkpoint_io
        if self.writer.begin_save(Path(path).name):
            if storage_options is not None:
                raise TypeError("BackgroundCheckpointIO takes no storage_options (checkpoints go to a path).")
            late = self.writer.stepped_storages()  # empty unless `overlap_copy`; alike on every rank
            write, arguments, staged = checkpoint_io.prepare_write(checkpoint, path, self.staging, late)
            self.writer.write_in_background(write, *arguments, stage=staged)
        else:
            checkpoint_io.save_checkpoint(checkpoint, path, storage_options)
            self.writer.written()

    def remove_checkpoint(self, path: Any) -> None:
        self.writer.remove(self.checkpoint_io.remove_checkpoint, path)

    def teardown(self) -> None:
        """The writes finish (a failed one is said); the last save's host copy is released."""
        try:
            self.writer.teardown()
        finally:
            self.staging = HostStaging()


def _yield_to_training() -> None:
    """The writer thread at a lower priority (Linux: a thread's own nice value): where training keeps every core busy (a
    CPU run), its steps take the CPU first and the write the rest; a stop waits for the write with training idle.
    `python -m app.bench.saves` measures it."""
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICENESS)


def background_writer(trainer: L.Trainer) -> BackgroundWriter | None:
    """The writer of this Trainer's background saves, if it has one (its BackgroundCheckpointIO's)."""
    checkpoint_io = trainer.strategy.checkpoint_io
    return checkpoint_io.writer if isinstance(checkpoint_io, BackgroundCheckpointIO) else None


def start_background_writes(trainer: L.Trainer) -> None:
    """From here on, this Trainer's saves are written in the background (if it has a writer for them)."""
    writer = background_writer(trainer)
    if writer is not None:
        writer.in_background = True
        if writer.overlap_copy:
            writer.watch(trainer.lightning_module, trainer.optimizers)


def save_ticket(trainer: L.Trainer) -> int | None:
    """A number for the save being made now, to ask `is_on_disk` later (call from `on_save_checkpoint`); None where
    saves are synchronous.

    A save's values are final only once it is on disk: app/tracking/run.py settles them then."""
    writer = background_writer(trainer)
    return writer.saves_started + 1 if writer is not None else None


def is_on_disk(trainer: L.Trainer, ticket: int | None) -> bool:
    """Whether the save `save_ticket` numbered is on disk (for None: it was written when it returned)."""
    writer = background_writer(trainer)
    return ticket is None or writer is None or writer.saves_written >= ticket


def wait_for_staging(trainer: L.Trainer) -> None:
    """Before an optimizer step's update: the last save's overlapped copy (if any) is made."""
    writer = background_writer(trainer)
    if writer is not None:
        writer.wait_for_staging()


def finish_writes(trainer: L.Trainer) -> None:
    """Block until every checkpoint this rank saved is on disk; later saves are written before they return."""
    writer = background_writer(trainer)
    if writer is not None:
        writer.wait()
        writer.in_background = False
        writer.unwatch()
