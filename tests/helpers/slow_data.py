"""A DataModule whose training samples are slow to load (a slow disk or decoder): diagnose's data case."""

from __future__ import annotations

import time
from typing import Any

from torch.utils.data import Dataset

from app.data import DigitsDataModule, FakeImageDataModule
from tests.helpers.hangs import WrappedDataset


class SlowSamples(WrappedDataset):
    def __init__(self, dataset: Dataset, seconds: float) -> None:
        super().__init__(dataset)
        self.seconds = seconds

    def __getitem__(self, index: int) -> Any:
        time.sleep(self.seconds)  # waits as on I/O: loader workers overlap it
        return self.dataset[index]


class SlowTrainingSamples:
    """A DataModule mixin: its training samples take `load_ms` each to load."""

    load_ms: float

    def make_splits(self) -> tuple[Dataset, Dataset, Dataset]:
        train, val, test = super().make_splits()  # type: ignore[misc]
        return SlowSamples(train, self.load_ms / 1000), val, test


class SlowLoadingDigits(SlowTrainingSamples, DigitsDataModule):
    """Digits whose training samples take `load_ms` each to load."""

    def __init__(self, load_ms: float = 5.0, **loader_options: Any) -> None:
        super().__init__(**loader_options)
        self.load_ms = load_ms


class SlowLoadingImages(SlowTrainingSamples, FakeImageDataModule):
    """configs/bench_cnn.yaml's images whose training samples take `load_ms` each to load: a step
    long enough (a CNN at batch 64) that loader workers can hide the loading, where a batch's own
    trip from a worker (about 1.3 ms on the 2-core VM) is a small part of it."""

    def __init__(self, load_ms: float = 5.0, **options: Any) -> None:
        super().__init__(**options)
        self.load_ms = load_ms
