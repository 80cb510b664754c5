"""A sharded process's checkpoint as a peer can receive it: each DTensor replaced by this process's local shard.

Fault tolerance under `strategy: fsdp` sends this to the healing process of the same rank in another replica group
(app/parallel/ft_shards.py puts the shards back; docs/fault_tolerance.md). Here, in app/checkpoints/, because it
rewrites a checkpoint's top-level entries, which only this package does (tests/checkpoints/test_one_writer.py).
"""

from __future__ import annotations

from typing import Any

from torch.distributed.tensor import DTensor

LOCAL_SHARDS_KEY = "ddp_app_ft_local_shards"  # in a checkpoint whose DTensors were replaced by their local shards


def has_shards(checkpoint: dict[str, Any]) -> bool:
    """The checkpoint holds DTensors (a process of a sharded group)."""
    return any(isinstance(value, DTensor) for value in checkpoint.get("state_dict", {}).values())


def to_local_shards(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """The checkpoint with every DTensor of its weights and optimizer states replaced by a copy of this process's
    shard (a copy: the process trains on while the peer fetches it), and marked."""

    def local(value: Any) -> Any:
        if isinstance(value, DTensor):
            return value.to_local().detach().clone()
        if isinstance(value, dict):
            return {key: local(item) for key, item in value.items()}
        if isinstance(value, list):
            return [local(item) for item in value]
        return value

    checkpoint["state_dict"] = local(checkpoint["state_dict"])
    checkpoint["optimizer_states"] = local(checkpoint.get("optimizer_states", []))
    checkpoint[LOCAL_SHARDS_KEY] = True
    return checkpoint
