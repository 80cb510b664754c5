"""Samplers that shard a dataset across ranks.

Training uses PyTorch's `DistributedSampler` (padded so every rank runs the same number of
steps; a shuffled order per epoch via `set_epoch`, which Lightning's fit loop calls every epoch).
Evaluation uses `UnpaddedDistributedSampler`: the default sampler pads the set with repeated
samples so that it divides evenly, and those duplicates would be counted twice in the metrics.
"""

from __future__ import annotations

from collections.abc import Iterator, Sized

from torch.utils.data import DistributedSampler


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
            raise ValueError(
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


def train_sampler(dataset: Sized, num_replicas: int, rank: int, shuffle: bool, seed: int) -> DistributedSampler:
    """The training sampler: the same for Lightning and the reference trainer, also at world size 1.

    Using a `DistributedSampler` even with one process keeps the sample order a function of
    (seed, epoch, world size) only, which is what makes the parity checks possible.
    """
    return DistributedSampler(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed)
