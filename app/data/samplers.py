"""Samplers that shard a dataset across ranks.

Training uses PyTorch's `DistributedSampler` (padded so every rank runs the same number of
steps; a shuffled order per epoch via `set_epoch`, which Lightning's fit loop calls every epoch).
Evaluation uses `UnpaddedDistributedSampler`: the default sampler pads the set with repeated
samples so that it divides evenly, and those duplicates would be counted twice in the metrics.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sized
from typing import Any

from torch.utils.data import DistributedSampler

from app.data.seeding import SampleKey
from app.errors import InvalidConfigError


class UnpaddedDistributedSampler(DistributedSampler):
    """Rank r reads samples r, r + world_size, r + 2 * world_size, ...; nothing repeated, nothing dropped.

    Shards may differ in length by one sample. That is safe for evaluation (no gradient
    all-reduce) as long as every rank has at least one sample; metrics are then reduced with
    sums (torchmetrics states), so the result equals a single-process evaluation exactly.
    It subclasses `DistributedSampler` so that Lightning does not replace it with a padded one.
    """

    def __init__(self, dataset: Sized, num_replicas: int, rank: int) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=False, drop_last=False)
        if len(dataset) < num_replicas:
            raise InvalidConfigError(
                f"The evaluation set has {len(dataset)} samples, fewer than the {num_replicas} ranks, "
                "so some ranks would have nothing to evaluate. Use a larger validation/test split "
                "or fewer devices."
            )
        self.num_samples = len(range(rank, len(dataset), num_replicas))
        self.total_size = len(dataset)

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.rank, len(self.dataset), self.num_replicas))

    def __len__(self) -> int:
        return self.num_samples


# (epoch, batches of that epoch already trained) at the moment an epoch's iteration starts:
# `app.resume.sampler_position`, the position the application owns (never Lightning's loop counters).
TrainingPosition = Callable[[], tuple[int, int]]


class ResumableDistributedSampler(DistributedSampler):
    """A `DistributedSampler` that can start an epoch part-way through, for exact mid-epoch resume.

    When iteration starts it asks `position()` for (epoch, batches already trained in it) and
    skips that many batches of this rank's shard: the remaining batches are exactly those an
    uninterrupted run would see next. `len()` stays the full shard length, because Lightning
    counts the skipped batches as already fetched (it resumes its batch counter, see
    `_TrainingEpochLoop.on_run_start`). Without `position` it is a plain `DistributedSampler`.
    With `keyed`, it yields `SampleKey(epoch, index)` for `app.resume.PerSampleSeeded` datasets.
    """

    def __init__(
        self,
        dataset: Sized,
        num_replicas: int,
        rank: int,
        shuffle: bool,
        seed: int,
        batch_size: int,
        position: TrainingPosition | None = None,
        keyed: bool = False,
    ) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed)
        self.batch_size = batch_size
        self.position = position
        self.keyed = keyed

    def __iter__(self) -> Iterator[Any]:
        skip = 0
        if self.position is not None:
            epoch, skip = self.position()
            self.set_epoch(epoch)
        indices = list(super().__iter__())[skip * self.batch_size :]
        if self.keyed:
            return iter([SampleKey(self.epoch, index) for index in indices])
        return iter(indices)


def train_sampler(
    dataset: Sized,
    num_replicas: int,
    rank: int,
    shuffle: bool,
    seed: int,
    batch_size: int = 1,
    position: TrainingPosition | None = None,
    keyed: bool = False,
) -> DistributedSampler:
    """The training sampler: the same for Lightning and the reference trainer, also at world size 1.

    Using a `DistributedSampler` even with one process keeps the sample order a function of
    (seed, epoch, world size) only, which is what makes the parity checks possible.
    """
    return ResumableDistributedSampler(dataset, num_replicas, rank, shuffle, seed, batch_size, position, keyed)
