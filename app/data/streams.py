"""Exact resume for a training `IterableDataset` that implements `state_dict` / `load_state_dict`.

A stream has no index that a sampler could skip to: its position is whatever its own state says.
Lightning checkpoints a loader's state only through the loader (torchdata's `StatefulDataLoader`),
only rank 0's, and ahead of the trained batches by the batch it prefetched. `PositionedStream`
instead records the dataset's `state_dict()` before each batch it starts, per rank, so that
`app.resume.ExactResume` saves the state at the first batch that no completed optimizer step has
consumed, and a resume loads it into that rank's stream before iterating. The state at the end of
the stream is recorded too: a run resumed at the next epoch's start sees the dataset as the
uninterrupted run's next epoch does.

The contract (the same as torchdata's): `state_dict()` describes the samples already yielded, and
`iter()` after `load_state_dict(state)` continues from there. Only with `num_workers: 0`: in worker
processes the stream's state lives where this process cannot read it (`ExactResume` says so in
one line at fit start).

Per-sample seeding as for map-style sets (`app.data.seeding`): the generators are seeded from
(seed, epoch, this rank's sample count) around each sample and put back afterwards, so random
augmentation drawn in `__iter__` is the same after a resume. No Lightning here.
"""

from __future__ import annotations

import copy
import random
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset

from app.data.seeding import sample_seed

# The key of the state recorded when the stream ran out (the epoch's end).
END = "end"


def has_state_methods(thing: Any) -> bool:
    """Whether `thing` has `state_dict()` and `load_state_dict()` (how Lightning and torchdata spot resumable data)."""
    return callable(getattr(thing, "state_dict", None)) and callable(getattr(thing, "load_state_dict", None))


def is_stateful_stream(dataset: Any) -> bool:
    return isinstance(dataset, IterableDataset) and has_state_methods(dataset)


class PositionedStream(IterableDataset):
    """Wraps a stateful training stream: records its state before each batch, resumes it, seeds its samples.

    Args:
        dataset: the user's `IterableDataset` with `state_dict` / `load_state_dict`.
        batch_size: the loader's batch size (batches are consecutive samples of the stream).
        start: called at each `iter()`: (epoch, batches of the epoch already trained, the state to
            load first or None to iterate the dataset as it is, whether all of the epoch's batches are
            trained).
        seed: the run's seed for per-sample seeding, or None to leave the generators alone.
        rank, world_size: this rank, for the sample seeds (a stream shards itself).
        keep: how many batch boundaries to remember (the trained batch lags the fetched one by the
            prefetched batch and the accumulated micro-batches).
    """

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
        self._states: OrderedDict[int | str, Any] = OrderedDict()

    def __getattr__(self, name: str) -> Any:
        if name == "dataset":  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]  (TypeError for an unsized stream, as DataLoader expects)

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
        saved = (torch.default_generator.get_state(), np.random.get_state(), random.getstate())
        seed = sample_seed(self.seed, epoch, count * self.world_size + self.rank)
        torch.default_generator.manual_seed(seed)
        np.random.seed(seed & 0xFFFFFFFF)
        random.seed(seed)
        try:
            return next(iterator)
        finally:
            torch.default_generator.set_state(saved[0])
            np.random.set_state(saved[1])
            random.setstate(saved[2])
