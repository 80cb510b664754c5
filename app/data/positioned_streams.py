"""Exact resume for a training `IterableDataset` that implements `state_dict` / `load_state_dict`.

Lightning saves a loader's state only through rank 0's loader, ahead of the trained batches. `PositionedStream` records
the dataset's `state_dict()` before each batch, per rank, so `app.resume.exact.ExactResume` saves the state at the first
batch no completed step consumed (`WorkerPositionedStream`: per worker). Contract (torchdata's): `state_dict()`
describes samples yielded, `iter()` after `load_state_dict` continues. Samples are seeded per sample. No Lightning here.
"""

from __future__ import annotations

import copy
import math
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from app.data.seeding import generators_kept, seed_generators
from app.errors import ResumeError

# The key of the state recorded when the stream ran out (the epoch's end).
END = "end"


def has_state_methods(thing: Any) -> bool:
    """Whether `thing` has `state_dict()` and `load_state_dict()` (how Lightning and torchdata spot resumable data)."""
    return callable(getattr(thing, "state_dict", None)) and callable(getattr(thing, "load_state_dict", None))


def is_stateful_stream(dataset: Any) -> bool:
    return isinstance(dataset, IterableDataset) and has_state_methods(dataset)


class _Positioned(IterableDataset):
    """What both positioned streams hold.

    Args:
        dataset: the user's `IterableDataset` with `state_dict` / `load_state_dict`.
        batch_size: the loader's batch size (batches are consecutive samples of the stream).
        start: called at each `iter()`: (epoch, batches of the epoch already trained, the state to
            load first or None to iterate the dataset as it is, whether all of the epoch's batches are
            trained).
        seed: the run's seed for per-sample seeding, or None to leave the generators alone.
        rank, world_size: this rank, for the sample seeds (a stream shards itself).
        keep: how many batch boundaries to remember (the trained batch lags the fetched one by the
            prefetched batch and the accumulated micro-batches)."""

    def __init__(
        self,
        dataset: IterableDataset,
        batch_size: int,
        start: Callable[[], tuple[int, int, Any, bool]],
        seed: int | None,
        rank: int,
        world_size: int,
        keep: int = 16,
    ) -> None:
        self.dataset = dataset
        self.batch_size = max(1, batch_size)
        self._start = start
        self.seed, self.rank, self.world_size, self.keep = seed, rank, world_size, keep

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]  (TypeError for an unsized stream, as DataLoader expects)


class PositionedStream(_Positioned):
    """Wraps a stateful training stream: records its state before each batch, resumes it, seeds its samples."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._states: OrderedDict[int | str, Any] = OrderedDict()

    def __getattr__(self, name: str) -> Any:
        if name == "dataset":  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def state_at(self, batches_done: int, epoch_end_done: bool) -> Any:
        """The dataset's state before batch `batches_done` of this epoch, or at its end."""
        key: int | str = END if epoch_end_done else batches_done
        if key not in self._states:
            raise AssertionError(
                f"ddp-app bug: the stream's state at batch {key} was not recorded (have {list(self._states)[-5:]})"
            )
        return self._states[key]

    def record_epoch_end(self) -> None:
        """The state the next epoch's `iter()` will find (also where `limit_train_batches` ended the epoch early)."""
        self._record(END)

    def _record(self, key: int | str) -> None:
        self._states[key] = copy.deepcopy(self.dataset.state_dict())
        while len(self._states) > self.keep:
            self._states.popitem(last=False)

    def __iter__(self) -> Iterator[Any]:
        epoch, batch, state, trained = self._start()
        if state is not None:
            self.dataset.load_state_dict(state)
        self._states.clear()
        if trained:  # resumed with only the epoch's validation and end left: nothing of it to read
            self._record(batch)
            return
        iterator = iter(self.dataset)
        count = batch * self.batch_size  # this rank's samples of the epoch so far
        while True:
            self._record(batch)
            for _ in range(self.batch_size):
                try:
                    sample = self._next(iterator, epoch, count)
                except StopIteration:
                    self._record(END)
                    return
                count += 1
                yield sample
            batch += 1

    def _next(self, iterator: Iterator[Any], epoch: int, count: int) -> Any:
        if self.seed is None:
            return next(iterator)
        with generators_kept():
            seed_generators(self.seed, epoch, count * self.world_size + self.rank)
            return next(iterator)


# What a worker's `next` gives when its stream has run out (no sample is this object).
RAN_OUT = object()


@dataclass(frozen=True)
class Boundary:
    """A worker's stream between two batches: its `state_dict()` and the samples it has yielded this epoch."""

    state: Any
    count: int


@dataclass(frozen=True)
class WorkerBatch:
    """What a worker sends with each batch: its id, and its stream before and after the batch."""

    worker: int
    before: Boundary
    after: Boundary
    last: bool  # its worker's stream ran out with it


@dataclass(frozen=True)
class WorkerDone:
    """Sent once by a worker whose stream ran out, after its last batch (not passed on to training)."""

    worker: int


@dataclass(frozen=True)
class WorkerPass:
    """A resumed worker's first turn when the batch that comes next is a later worker's (not passed on)."""

    worker: int


def _as_is(item: Any) -> Any:
    """The loader's collate function: the workers send batches already collated."""
    return item


class WorkerPositionedStream(_Positioned):
    """A stateful training stream read by `num_workers` loader workers, positioned per worker.

    Each worker builds its own batches from its copy of the stream and sends each with the stream's `state_dict()`
    before and after it (`WorkerBatch`), and `WorkerDone` at its end; `state_at(n)` gives every worker's state before
    its first unconsumed batch, loaded into each worker on resume (as torchdata's `StatefulDataLoader`).

    The order matches the uninterrupted run's: `in_order` hands batches out in turn, so a resumed cycle skips workers
    0..k-1 once (`rotation`, `WorkerPass`). Worker ids are kept; samples are seeded from (seed, epoch, worker, the
    worker's sample count, rank).

    Not with `persistent_workers` nor `in_order=False`: `app.data.rank_loaders` leaves those as they are, with a line at
    fit start. A checkpoint of another `num_workers` is refused in one line."""

    def __init__(
        self,
        dataset: IterableDataset,
        batch_size: int,
        num_workers: int,
        collate_fn: Callable[[list[Any]], Any],
        drop_last: bool,
        **positioning: Any,  # start, seed, rank, world_size, keep: see _Positioned
    ) -> None:
        super().__init__(dataset, batch_size, **positioning)
        self.num_workers = num_workers
        self.collate_fn = collate_fn
        self.drop_last = drop_last
        self._reset(0, 0, [Boundary(None, 0)] * num_workers, set(), 0, False)

    def _reset(
        self, epoch: int, rotation: int, starts: list[Boundary], done: set[int], first: int, trained: bool
    ) -> None:
        # What the workers are given (copied into them when the loader starts them):
        self._epoch, self._rotation, self._starts, self._done_at_start, self._trained = (
            epoch, rotation, starts, frozenset(done), trained
        )  # fmt: skip
        # What the training process learns from them, by batch index of the epoch:
        self._first = first
        self._batches: OrderedDict[int, WorkerBatch] = OrderedDict()
        self._floor: dict[int, WorkerBatch] = {}  # per worker, its latest batch dropped from _batches
        self._done = set(done)

    def __getstate__(self) -> dict[str, Any]:
        # Sent to spawned workers: without the callback (it holds the Trainer) and the batch records.
        state = self.__dict__.copy()
        state.update(_start=None, _batches=OrderedDict(), _floor={})
        return state

    # ----- in the training process -----

    def begin(self) -> None:
        """Called as the loader starts its workers: what each of them loads, from the resume's state."""
        epoch, batch, state, trained = self._start()
        # A state saved in an earlier epoch (its last batch trained, its end not reached: Lightning may build no
        # iterator for what is left of it) does not reach into this one.
        if state is None or state.get("fresh") or state["epoch"] != epoch:
            # A new epoch: every worker starts from this process's copy, as in the uninterrupted run.
            self._reset(epoch, 0, [Boundary(None, 0)] * self.num_workers, set(), batch, trained)
            return
        if state["num_workers"] != self.num_workers:
            raise ResumeError(
                f"the checkpoint's training stream was read by {state['num_workers']} loader workers per rank, "
                f"this run's by {self.num_workers}: each worker's position is its own. Fix: "
                f"num_workers: {state['num_workers']} to continue it, or resume from an epoch-end checkpoint."
            )
        starts = [Boundary(worker["state"], worker["count"]) for worker in state["workers"]]
        done = {index for index, worker in enumerate(state["workers"]) if worker["done"]}
        self._reset(epoch, state["rotation"], starts, done, batch, trained)

    def received(self, index: int, batch: WorkerBatch) -> None:
        self._batches[index] = batch
        while len(self._batches) > self.keep * (self.num_workers + 1):
            _, dropped = self._batches.popitem(last=False)
            self._floor[dropped.worker] = dropped

    def finished(self, worker: int) -> None:
        self._done.add(worker)

    def record_epoch_end(self) -> None:
        pass  # after the epoch's end the next one starts from this process's copy: state_at says so

    def state_at(self, batches_done: int, epoch_end_done: bool) -> Any:
        """Every worker's stream before batch `batches_done` of this epoch, or {"fresh": True} after its end."""
        if epoch_end_done:
            return {"fresh": True}
        workers = []
        for worker in range(self.num_workers):
            mine = [(index, batch) for index, batch in self._batches.items() if batch.worker == worker]
            ahead = [batch.before for index, batch in mine if index >= batches_done]
            behind = [batch for index, batch in mine if index < batches_done]
            if ahead:
                boundary, done = ahead[0], False
            else:
                earlier = behind[-1] if behind else self._floor.get(worker)
                boundary = earlier.after if earlier else self._starts[worker]
                done = worker in self._done or bool(earlier and earlier.last)
            workers.append({"state": boundary.state, "count": boundary.count, "done": done})
        rotation = self._worker_of(batches_done)
        return {"epoch": self._epoch, "num_workers": self.num_workers, "rotation": rotation, "workers": workers}

    def _worker_of(self, index: int) -> int:
        """The worker whose turn gives batch `index` (if it has finished, its turn is dropped, as it would have
        been)."""
        if index in self._batches:
            return self._batches[index].worker
        if index - 1 in self._batches:
            return (self._batches[index - 1].worker + 1) % self.num_workers
        if index == self._first:
            return self._rotation
        raise AssertionError(
            f"ddp-app bug: no record of the training stream's batch {index - 1} (have {list(self._batches)[-5:]})"
        )

    # ----- in a loader worker -----

    def __iter__(self) -> Iterator[WorkerPass | WorkerDone | tuple[Any, WorkerBatch]]:
        info = get_worker_info()
        if info is None:
            raise AssertionError("ddp-app bug: WorkerPositionedStream iterated outside a loader worker")
        worker = info.id
        if self._trained or worker in self._done_at_start:
            return  # its turns are dropped by DataLoader from now on
        if worker < self._rotation:
            yield WorkerPass(worker)
        start = self._starts[worker]
        if start.state is not None:
            self.dataset.load_state_dict(start.state)
        iterator = iter(self.dataset)
        state, count = copy.deepcopy(self.dataset.state_dict()), start.count
        # One sample is read ahead, after the state of the batch's end is taken: a batch then says whether it was its
        # worker's last (a stream may start a new pass when iterated at its end).
        upcoming = self._next(iterator, worker, count)
        while upcoming is not RAN_OUT:
            before, samples = Boundary(state, count), [upcoming]
            while (
                len(samples) < self.batch_size
                and (sample := self._next(iterator, worker, count + len(samples))) is not RAN_OUT
            ):
                samples.append(sample)
            count += len(samples)
            state = copy.deepcopy(self.dataset.state_dict())
            upcoming = self._next(iterator, worker, count) if len(samples) == self.batch_size else RAN_OUT
            if not (self.drop_last and len(samples) < self.batch_size):
                yield self.collate_fn(samples), WorkerBatch(worker, before, Boundary(state, count), upcoming is RAN_OUT)
        yield WorkerDone(worker)

    def _next(self, iterator: Iterator[Any], worker: int, count: int) -> Any:
        """The worker's next sample (RAN_OUT when its stream ran out), seeded as sample `count` of `worker`."""
        if self.seed is not None:
            index = (count * self.num_workers + worker) * self.world_size + self.rank
            seed_generators(self.seed, self._epoch, index)
        return next(iterator, RAN_OUT)


class WorkerStreamLoader(DataLoader):
    """The loader of a `WorkerPositionedStream`: starts it, passes its batches on, keeps what the workers say about
    their streams. `batch_size` is the stream's (the workers build the batches)."""

    def __init__(self, stream: WorkerPositionedStream, **options: Any) -> None:
        self._stream_batch_size = stream.batch_size
        super().__init__(stream, batch_size=None, collate_fn=_as_is, **options)

    @property
    def batch_size(self) -> int:  # type: ignore[override]
        return self._stream_batch_size

    @batch_size.setter
    def batch_size(self, value: int | None) -> None:
        pass  # DataLoader sets None: it does not batch the workers' batches again

    def __len__(self) -> int:
        # What a plain DataLoader(batch_size=...) reports for the stream: Lightning's epoch length.
        samples = len(self.dataset)  # type: ignore[arg-type]
        return samples // self.batch_size if self.dataset.drop_last else math.ceil(samples / self.batch_size)

    def __iter__(self) -> Iterator[Any]:
        stream: WorkerPositionedStream = self.dataset  # type: ignore[assignment]
        stream.begin()
        index = stream._first
        for item in super().__iter__():
            if isinstance(item, WorkerDone):
                stream.finished(item.worker)
                continue
            if isinstance(item, WorkerPass):
                continue
            batch, record = item
            stream.received(index, record)
            index += 1
            yield batch

    def state_dict(self) -> dict[str, int]:
        return {}  # the position is ExactResume's (see ResumableDataLoader)

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        pass
