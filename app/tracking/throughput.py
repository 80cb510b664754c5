"""Training samples/s: the one definition behind every number `ddp-app fit` reports as samples/s.

Training samples over all ranks (this rank's samples times the world size: every rank trains on as
many) per second of training, where training is the time from a training batch's start to the last
training batch's end, less any validation that ran in between (`val_check_interval` < 1). Outside
it: the loader's start before an epoch's first batch (worker processes, the sampler), the epoch-end
validation and the epoch-end save of last.ckpt; inside it: loading the next batch, every callback's
per-step work and a time-interval save within the epoch.

`app.tracking.run.Tracking` measures each epoch this way on every rank, `app.run.coordinator.RunCoordinator`
averages it over the ranks and logs it as `samples_per_s`: the value the epoch's progress line
(app/run/callbacks.py), the fit's summary (app/run/summary.py), the plot and the trackers all show.
One definition because two disagreed (issue 42): the progress line's own window also held the
epoch-end exchange between the ranks and the checkpoint saves.
"""

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
    """Samples and seconds of training as the module docstring defines them, since `reset`.

    The owner calls `batch_start` and `batch_end` around every training batch and `pause` when
    validation starts; a paused clock starts again at the next batch's start. Costs a clock read per
    call: no collective, no host read of a device value.
    """

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
