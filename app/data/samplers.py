"""Samplers that shard a dataset across ranks.

Training: PyTorch's padded `DistributedSampler` (shuffled per `set_epoch`), chunk-wise for chunked data
(`chunked_shard`, each rank its own chunks). Evaluation: `UnpaddedDistributedSampler`, since padding's duplicates would
count twice in metrics."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator, Sequence, Sized
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DistributedSampler

from app.data.seeding import SampleKey
from app.errors import InvalidConfigError


@dataclass(frozen=True)
class ElasticLayout:
    """The sample order of a run started on `order_world_size` ranks, cut into global micro-batches of `micro_batch`
    samples and split over the `world_size` ranks it continues on (elastic resume).

    Each epoch's padded permutation from (seed, epoch) is cut into global micro-batches (the starting run's per-rank
    batch x world size, or `exact_resume.global_batch_size`), each split over the current ranks with stride
    `world_size`. `weight` scales each rank's loss so that the all-reduced gradient is the global micro-batch's mean; a
    rank left without a sample reads one with weight 0. No Lightning here."""

    order_world_size: int
    micro_batch: int
    world_size: int

    def rank_batch_size(self, rank: int) -> int:
        return len(range(rank, self.micro_batch, self.world_size))

    def per_rank_sizes(self) -> list[int]:
        return [self.rank_batch_size(rank) for rank in range(self.world_size)]

    def padded_length(self, dataset_length: int) -> int:
        return -(-dataset_length // self.order_world_size) * self.order_world_size

    def blocks(self, dataset_length: int) -> int:
        """Micro-batches per epoch: the same on every number of ranks."""
        return -(-self.padded_length(dataset_length) // self.micro_batch)

    def block_length(self, dataset_length: int, block: int) -> int:
        start = block * self.micro_batch
        return min(self.micro_batch, self.padded_length(dataset_length) - start)

    def rank_share(self, block_length: int, rank: int) -> int:
        """This rank's real samples of a micro-batch of `block_length`."""
        return len(range(rank, block_length, self.world_size))

    def weight(self, dataset_length: int, block: int, rank: int) -> float:
        """The factor on this rank's mean loss for micro-batch `block`: W x share / block length."""
        length = self.block_length(dataset_length, block)
        return self.world_size * self.rank_share(length, rank) / length

    def rank_indices(self, order: list[Any], rank: int, skip_blocks: int) -> list[Any]:
        """This rank's samples of every micro-batch after the first `skip_blocks`, in reading order."""
        indices: list[Any] = []
        for start in range(skip_blocks * self.micro_batch, len(order), self.micro_batch):
            block = order[start : start + self.micro_batch]
            mine = block[rank :: self.world_size]
            indices.extend(mine if mine else block[:1])  # weight 0: read, but contributes nothing
        return indices

    def rank_length(self, dataset_length: int, rank: int) -> int:
        blocks = self.blocks(dataset_length)
        last = self.block_length(dataset_length, blocks - 1)
        return (blocks - 1) * self.rank_batch_size(rank) + max(1, self.rank_share(last, rank))


class UnpaddedDistributedSampler(DistributedSampler):
    """Rank r reads samples r, r + world_size, ...: nothing repeated, nothing dropped.

    Shards may differ by one sample: safe for evaluation (metrics reduce sums), given every rank has one. A
    `DistributedSampler` subclass, so Lightning does not replace it with a padded one."""

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


# How many chunks' samples a chunked training order shuffles together (`chunked_shard`).
DEFAULT_SHUFFLE_CHUNKS = 4


@functools.lru_cache(maxsize=4)
def _chunked_order(chunk_sizes: tuple[int, ...], shuffle: bool, seed: int, epoch: int, window: int) -> list[int]:
    """One epoch's order of a chunked data set: chunks in a permuted order, the samples of each window of `window`
    consecutive chunks permuted together (LitData's way, a function of (seed, epoch) only)."""
    starts = [0]
    for size in chunk_sizes[:-1]:
        starts.append(starts[-1] + size)
    generator = torch.Generator().manual_seed(seed + epoch)  # as DistributedSampler seeds its permutation
    chunks = torch.randperm(len(chunk_sizes), generator=generator).tolist() if shuffle else range(len(chunk_sizes))
    chunks = list(chunks)
    order: list[int] = []
    for first in range(0, len(chunks), window):
        samples = [
            i
            for chunk in chunks[first : first + window]
            for i in range(starts[chunk], starts[chunk] + chunk_sizes[chunk])
        ]
        if shuffle:
            samples = [samples[j] for j in torch.randperm(len(samples), generator=generator).tolist()]
        order.extend(samples)
    return order


def chunked_shard(
    chunk_sizes: Sequence[int], rank: int, num_replicas: int, shuffle: bool, seed: int, epoch: int, window: int
) -> list[int]:
    """Rank `rank`'s padded shard of chunked data: a contiguous run of `_chunked_order`, so each rank reads its own
    chunks (as LitData shards), padded as DistributedSampler pads."""
    order = _chunked_order(tuple(int(size) for size in chunk_sizes), shuffle, seed, epoch, max(1, window))
    per_rank = math.ceil(len(order) / num_replicas)
    padded = list(order)
    while len(padded) < per_rank * num_replicas:
        padded += order[: per_rank * num_replicas - len(padded)]
    return padded[rank * per_rank : (rank + 1) * per_rank]


# (epoch, batches of that epoch already trained) at the moment an epoch's iteration starts:
# `app.data.positioning.sampler_position`, the position the application owns (never Lightning's loop counters).
TrainingPosition = Callable[[], tuple[int, int]]


class ResumableDistributedSampler(DistributedSampler):
    """A `DistributedSampler` that can start an epoch part-way through, for exact mid-epoch resume.

    At iteration start it asks `position()` for (epoch, batches trained) and skips them; `len()` stays the full shard
    (Lightning counts skipped batches as fetched). With `keyed`, it yields `SampleKey(epoch, index)` for
    `PerSampleSeeded`; with `layout`, this rank's share of an `ElasticLayout` (batch size
    `layout.rank_batch_size(rank)`). Used at world size 1 too, so the order depends only on (seed, epoch, world size).
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

    def _shard(self, rank: int, num_replicas: int) -> list[int]:
        """Rank `rank`'s whole padded shard of this epoch at `num_replicas`: DistributedSampler's, or `chunked_shard`'s
        for chunked data."""
        chunk_sizes = getattr(self.dataset, "chunk_sizes", None)
        if chunk_sizes is not None:
            window = getattr(self.dataset, "shuffle_chunks", DEFAULT_SHUFFLE_CHUNKS)
            return chunked_shard(chunk_sizes, rank, num_replicas, self.shuffle, self.seed, self.epoch, window)
        sampler = DistributedSampler(
            self.dataset, num_replicas=num_replicas, rank=rank, shuffle=self.shuffle, seed=self.seed
        )
        sampler.set_epoch(self.epoch)
        return list(sampler)

    def _order(self) -> list[int]:
        """The whole padded order of the starting run's world size (its shards, rank by rank interleaved)."""
        assert self.layout is not None
        world_size = self.layout.order_world_size
        shards = [self._shard(rank, world_size) for rank in range(world_size)]
        return [index for group in zip(*shards, strict=True) for index in group]

    def __iter__(self) -> Iterator[Any]:
        skip = 0
        if self.position is not None:
            epoch, skip = self.position()
            self.set_epoch(epoch)
        if self.layout is not None:
            indices = self.layout.rank_indices(self._order(), self.rank, skip)
        else:
            indices = self._shard(self.rank, self.num_replicas)[skip * self.batch_size :]
        if self.keyed:
            return iter([SampleKey(self.epoch, index) for index in indices])
        return iter(indices)
