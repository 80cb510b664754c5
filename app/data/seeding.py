"""Per-sample randomness: a sample's loading sees random generators seeded from (seed, epoch, index).

A random augmentation drawn from a stream depends on which worker, which rank and which process
happened to load the sample; after a resume, or with another `num_workers`, it is a different one.
Seeded from the sample's identity it is the same everywhere (JAX's explicit keys make the same
point). No Lightning here: the reference trainer can use it too.
"""

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
    """Put the generators `seed_generators` seeds back afterwards: the training step's own random
    stream (dropout) in this process stays untouched."""
    saved = (torch.default_generator.get_state(), np.random.get_state(), random.getstate())
    try:
        yield
    finally:
        torch.default_generator.set_state(saved[0])
        np.random.set_state(saved[1])
        random.setstate(saved[2])


def reads_without_randomness(dataset: Dataset) -> bool:
    """Whether reading a sample of `dataset` cannot draw a random number: a plain TensorDataset, or
    plain Subsets of one (exactly these classes: a subclass may override `__getitem__`).

    Seeding such a sample costs time (docs/performance.md) and changes nothing, so it is skipped.
    """
    while type(dataset) is Subset:
        dataset = dataset.dataset
    return type(dataset) is TensorDataset


def training_loader_generator(seed: int) -> torch.Generator:
    """The generator a training DataLoader is given, seeded with the seed its sampler shuffles with.

    A generator of its own: creating each epoch's iterator draws a seed from it, not from the global
    generator, whose state the checkpoint holds. Otherwise that draw falls after an epoch-end
    checkpoint in an uninterrupted run but before the RNG restore in a resumed one, and dropout
    masks differ. (Worker processes' streams do not matter: samples are seeded one by one.)
    """
    return torch.Generator().manual_seed(seed)


def evaluation_loader_generator(seed: int) -> torch.Generator:
    """The generator an evaluation (or prediction) DataLoader is given, for the same reason.

    Starting its iterator draws a seed from the loader's generator, the global one if it has none.
    With `persistent_workers` the iterator is started once per process: an uninterrupted run starts
    it at its first validation and reuses it after, a run resumed mid-epoch starts it at the next
    validation, so a draw from the global generator there would shift every later dropout mask
    (found by the resume matrix on real data: ImageFolder, persistent workers, a kill mid-epoch).
    """
    return torch.Generator().manual_seed(seed)


@dataclass(frozen=True)
class SampleKey:
    """What the training sampler yields when samples are seeded: the index and the epoch it is drawn in."""

    epoch: int
    index: int


class PerSampleSeeded(Dataset):
    """A map-style dataset whose every `__getitem__` sees random generators seeded from (seed, epoch, index).

    torch's CPU generator, NumPy's global generator and Python's `random` are seeded right before the
    wrapped dataset loads a sample, so augmentation drawn from them (torchvision transforms use
    torch's) no longer depends on the worker, the rank, `num_workers`, `persistent_workers` or a
    resume. In the main process (`num_workers: 0`) the generators are put back afterwards, once per
    batch, so the training step's own random stream (dropout) is untouched. A generator the dataset
    keeps privately (`numpy.random.default_rng()` at import) is not reached: `ddp-app resume-check`
    names that case. Other attributes are the wrapped dataset's.
    """

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
