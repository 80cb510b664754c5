"""The sample order of an elastic resume: a run continued on another number of ranks (docs/resume.md).

No Lightning and no torch here: the sampler (`app.data.samplers`), the callback that keeps the run's
position (`app.resume`) and the reference trainer can all use it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ElasticLayout:
    """The sample order of a run that started on `order_world_size` ranks, cut into global
    micro-batches of `micro_batch` samples and split over the `world_size` ranks it continues on
    (elastic resume).

    The order is the one the run started with: each epoch's permutation from (seed, epoch), padded
    as `DistributedSampler` pads it for `order_world_size`, cut into global micro-batches of
    `micro_batch` consecutive samples: the starting run's per-rank batch x its world size (exactly
    what its ranks read together at each micro-step), or the global micro-batch a resume accepted
    knowingly (`exact_resume.global_batch_size`). Each global micro-batch is split over the current
    ranks with stride `world_size` (rank r takes its samples r, r + W, ...), so per-rank batches may
    differ by one sample: `weight` scales each rank's loss so that the all-reduced gradient is the
    mean over the global micro-batch, as in the starting run. A rank left without a sample (the
    epoch's last, short micro-batch) reads one sample again with weight 0. No Lightning here.
    """

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
