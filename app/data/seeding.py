"""Per-sample randomness: a sample's loading sees random generators seeded from (seed, epoch, index), so its
augmentation does not depend on worker, rank or resume. No Lightning here."""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, Subset, TensorDataset, get_worker_info

_MASK64 = (1 << 64) - 1
# The epoch evaluation samples are seeded with: no training epoch has it.
EVALUATION_EPOCH = 1 << 40


def _mix64(value: int) -> int:
    """SplitMix64's finaliser: neighbouring inputs give unrelated 64-bit outputs."""
    value = (value + 0x9E3779B97F4A7C15) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """The seed of one sample's loading in one epoch: a function of (seed, epoch, index) only."""
    return _mix64(_mix64(_mix64(seed & _MASK64) ^ epoch) ^ index)


def seed_generators(seed: int, epoch: int, index: int) -> None:
    """Seed torch's CPU generator, NumPy's and Python's global ones for one sample's loading."""
    seed = sample_seed(seed, epoch, index)
    torch.default_generator.manual_seed(seed)
    np.random.seed(seed & 0xFFFFFFFF)
    random.seed(seed)


@contextmanager
def generators_kept() -> Iterator[None]:
    """Put the generators `seed_generators` seeds back afterwards: the training step's own random stream (dropout) in
    this process stays untouched."""
    saved = (torch.default_generator.get_state(), np.random.get_state(), random.getstate())
    try:
        yield
    finally:
        torch.default_generator.set_state(saved[0])
        np.random.set_state(saved[1])
        random.setstate(saved[2])


def reads_without_randomness(dataset: Dataset) -> bool:
    """Whether reading a sample cannot draw a random number (exactly a TensorDataset or plain Subsets of one); seeding
    those is skipped (docs/performance.md)."""
    while type(dataset) is Subset:
        dataset = dataset.dataset
    return type(dataset) is TensorDataset


def training_loader_generator(seed: int) -> torch.Generator:
    """The generator a training DataLoader is given, seeded with its sampler's seed.

    Each epoch's iterator draws from it, not from the global generator, whose draw would fall on different sides of the
    RNG restore in a resumed and an uninterrupted run (dropout masks would differ)."""
    return torch.Generator().manual_seed(seed)


def evaluation_loader_generator(seed: int) -> torch.Generator:
    """The generator an evaluation (or prediction) DataLoader is given, for the same reason: with `persistent_workers`
    its iterator starts at a different validation in a resumed run, and a global draw would shift later dropout masks.
    """
    return torch.Generator().manual_seed(seed)


@dataclass(frozen=True)
class SampleKey:
    """What the training sampler yields when samples are seeded: the index and the epoch it is drawn in."""

    epoch: int
    index: int


class PerSampleSeeded(Dataset):
    """A map-style dataset whose every `__getitem__` sees random generators seeded from (seed, epoch, index).

    torch's CPU generator, NumPy's and Python's `random` are seeded before each sample, so augmentation no longer
    depends on worker, rank, `num_workers` or resume; in the main process they are restored once per batch (dropout
    untouched). A dataset's private generator is not reached (`ddp-app resume-check` names it). Other attributes are the
    wrapped dataset's."""

    def __init__(self, dataset: Dataset, seed: int) -> None:
        self.dataset = dataset
        self.seed = seed

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:
        if name == "dataset":  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def _load(self, key: SampleKey | int) -> Any:
        # A plain index comes from an evaluation sampler: the same draws in every evaluation.
        epoch, index = (key.epoch, key.index) if isinstance(key, SampleKey) else (EVALUATION_EPOCH, key)
        seed_generators(self.seed, epoch, index)
        return self.dataset[index]

    def __getitem__(self, key: SampleKey | int) -> Any:
        return self.__getitems__([key])[0]

    def __getitems__(self, keys: Sequence[SampleKey | int]) -> list[Any]:
        if get_worker_info() is not None:  # a worker process: its generators serve nobody else
            return [self._load(key) for key in keys]
        with generators_kept():
            return [self._load(key) for key in keys]
