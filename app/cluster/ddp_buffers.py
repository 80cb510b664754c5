"""DistributedDataParallel's buffer broadcast, left out where it has no one to reach: one rank.

DDP broadcasts the module's buffers (BatchNorm's running statistics) from rank 0 before every
forward pass (by default), so that every rank normalises with rank 0's statistics. With one rank
the broadcast goes from rank 0 to itself and changes no value, but it is still paid: DDP flattens
the buffers, runs the collective and copies them back (`dist._broadcast_coalesced`), 0.8 to
1.0 ms of main-thread time per resnet18 step on the H100 machine (docs/performance.md, the
profile). Both trainers use this rule, so the benchmark still compares the trainers. On more ranks
the user's setting stands.

The switch is `forward_sync_buffers` from torch 2.14 on (`broadcast_buffers`, which it replaces,
now warns on every construction), `broadcast_buffers` before. No Lightning here: the reference
trainer imports it.
"""

from __future__ import annotations

import inspect
from typing import Any

from torch.nn.parallel import DistributedDataParallel

FORWARD_SYNC = "forward_sync_buffers"


def without_single_rank_broadcast(ddp_kwargs: dict[str, Any], world_size: int) -> dict[str, Any]:
    """`ddp_kwargs` for DistributedDataParallel at `world_size`: no buffer broadcast at one rank."""
    if world_size != 1:
        return dict(ddp_kwargs)
    if FORWARD_SYNC in inspect.signature(DistributedDataParallel.__init__).parameters:
        kwargs = {key: value for key, value in ddp_kwargs.items() if key != "broadcast_buffers"}
        return {**kwargs, FORWARD_SYNC: False}
    return {**ddp_kwargs, "broadcast_buffers": False}
