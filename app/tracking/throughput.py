"""Training samples/s: the one definition behind every samples/s `ddp-app fit` reports.

Training samples over all ranks per second of training: from a training batch's start to the last batch's end, less any
validation in between. Outside: the loader's start, epoch-end validation and last.ckpt's epoch-end save; inside: batch
loading, callbacks and in-epoch saves. `Tracking` measures it per rank, `RunCoordinator` averages and logs
`samples_per_s`, shown by the progress line, summary, plot and trackers (one definition since issue 42)."""

from __future__ import annotations

import time
from typing import Any

import torch


def batch_size_of(batch: Any) -> int:
    """The first dimension of the first tensor in a batch (tuple, list or dict of tensors)."""
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.dim() else 1
    items = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (list, tuple)) else ()
    for item in items:
        size = batch_size_of(item)
        if size:
            return size
    return 0


class TrainingClock:
    """Samples and seconds of training, as the module docstring defines them, since `reset`: `batch_start`/`batch_end`
    around every batch, `pause` at validation; a clock read per call, nothing else."""

    def __init__(self) -> None:
        self.reset()

    def reset(self, samples: float = 0.0, seconds: float = 0.0) -> None:
        """Start from (samples, seconds) measured before: an earlier attempt's share of a resumed epoch."""
        self._samples = samples
        self._closed_s = seconds  # seconds of the stretches closed by a pause
        self._open_at: float | None = None  # start of the stretch being timed
        self._last_end = 0.0

    def batch_start(self) -> None:
        if self._open_at is None:
            self._open_at = self._last_end = time.perf_counter()

    def batch_end(self, samples: float) -> None:
        self._samples += samples
        self._last_end = time.perf_counter()

    def pause(self) -> None:
        if self._open_at is not None:
            self._closed_s += self._last_end - self._open_at
            self._open_at = None

    def totals(self) -> tuple[float, float]:
        """(samples, seconds) of training since `reset`."""
        open_s = self._last_end - self._open_at if self._open_at is not None else 0.0
        return self._samples, self._closed_s + open_s


def samples_per_s(samples: float, seconds: float) -> float | None:
    """The rate, or None where nothing was measured."""
    return samples / seconds if samples and seconds > 0 else None
