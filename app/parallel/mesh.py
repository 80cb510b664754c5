"""How strategy fsdp lays out its ranks: one group that shards the model (full sharding), or several groups that each
hold a whole sharded copy (hybrid sharding). Shared by the strategy's resolution (app/parallel/strategy.py) and the
strategy itself (app/parallel/fsdp.py), so neither imports the other's module for it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from app.errors import UserFacingError

# `trainer.strategy.init_args.shard_group_size` of strategy fsdp: the ranks that shard the model between them (null:
# every rank; `node`: the ranks of one node; N: groups of N consecutive ranks).
ShardGroupSize = int | Literal["node"] | None


@dataclass(frozen=True)
class MeshLayout:
    """Strategy fsdp's ranks as `replicas` groups of `shards` consecutive ranks, each group one sharded copy of the
    model. One replica is FSDP; more is HSDP (gather and reduce-scatter within a group, gradient shards all-reduced
    between groups). Data is sharded over every rank."""

    replicas: int
    shards: int

    @property
    def is_hybrid(self) -> bool:
        return self.replicas > 1

    def describe(self) -> str:
        """ "2 replicas x 2 shards": the words of the run's first line and of the resume notice."""
        replicas = f"{self.replicas} replica{'s' if self.replicas != 1 else ''}"
        return f"{replicas} x {self.shards} shard{'s' if self.shards != 1 else ''}"


def check_shard_group_size(shard_group_size: Any) -> None:
    """A value that is no group size at all (0, -2, "nodes") is refused where the strategy is built."""
    if shard_group_size in (None, "node"):
        return
    if not isinstance(shard_group_size, int) or isinstance(shard_group_size, bool) or shard_group_size < 1:
        raise UserFacingError(
            f"trainer.strategy.init_args.shard_group_size={shard_group_size!r} is not a group size. Fix: a "
            "number of ranks (at least 1), `node` (the ranks of one node), or null (every rank)."
        )


def mesh_layout(shard_group_size: ShardGroupSize, world_size: int, ranks_per_node: int) -> MeshLayout:
    """The layout `shard_group_size` asks for on `world_size` ranks, `ranks_per_node` per node; a size that does not
    divide the ranks into equal groups is refused in one line, before any process group exists (every rank computes the
    same answer)."""
    check_shard_group_size(shard_group_size)
    if shard_group_size is None:
        size = world_size
    elif shard_group_size == "node":
        size = ranks_per_node
    else:
        size = int(shard_group_size)
    if size > world_size or world_size % size:
        divisors = [str(n) for n in range(1, world_size + 1) if world_size % n == 0]
        raise UserFacingError(
            f"trainer.strategy.init_args.shard_group_size={shard_group_size} ({size} ranks) does not divide the "
            f"run's {world_size} ranks into equal shard groups. Fix: one of {', '.join(divisors)}, `node`, or "
            "null (every rank)."
        )
    return MeshLayout(world_size // size, size)
