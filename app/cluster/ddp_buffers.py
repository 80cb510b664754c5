"""DistributedDataParallel's buffer broadcast, left out at one rank, where it reaches no one.

At one rank it changes nothing but still costs a flatten, a collective and a copy-back per forward (docs/performance.md,
the profile). Both trainers use this rule; on more ranks the user's setting stands. The switch is `forward_sync_buffers`
from torch 2.14 (`broadcast_buffers` before). No Lightning here: the reference trainer imports it."""

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
