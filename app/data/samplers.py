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
from app.elastic import ElasticLayout
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
    With `layout` (a run resumed on another number of ranks), it yields this rank's share of the
    starting run's global micro-batches instead (`ElasticLayout`); the loader's batch size is then
    `layout.rank_batch_size(rank)`.
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
        layout: ElasticLayout | None = None,
    ) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed)
        self.batch_size = batch_size
        self.position = position
        self.keyed = keyed
        self.layout = layout
        if layout is not None:
            self.num_samples = layout.rank_length(len(dataset), rank)

    def _order(self) -> list[int]:
        """The whole padded order of the starting run's world size (DistributedSampler's, rank by rank interleaved)."""
        assert self.layout is not None
        starting = DistributedSampler(
            self.dataset, num_replicas=self.layout.order_world_size, rank=0, shuffle=self.shuffle, seed=self.seed
        )
        starting.set_epoch(self.epoch)
        shards = []
        for rank in range(self.layout.order_world_size):
            starting.rank = rank
            shards.append(list(starting))
        return [index for group in zip(*shards, strict=True) for index in group]

    def __iter__(self) -> Iterator[Any]:
        skip = 0
        if self.position is not None:
            epoch, skip = self.position()
            self.set_epoch(epoch)
        if self.layout is not None:
            indices = self.layout.rank_indices(self._order(), self.rank, skip)
        else:
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
    layout: ElasticLayout | None = None,
) -> DistributedSampler:
    """The training sampler: the same for Lightning and the reference trainer, also at world size 1.

    Using a `DistributedSampler` even with one process keeps the sample order a function of
    (seed, epoch, world size) only, which is what makes the parity checks possible.
    """
    return ResumableDistributedSampler(dataset, num_replicas, rank, shuffle, seed, batch_size, position, keyed, layout)
