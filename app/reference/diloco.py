"""DiLoCo written plainly on `torch.distributed`, for the reference trainer (`strategy: diloco` in the
YAML; no Lightning): the replicas take their optimizer steps alone, and after every `sync_every`-th
the mean of (anchor - replica) is all-reduced, an outer SGD steps the anchor, and every replica
continues from it. With `overlap_steps` T the all-reduce starts T inner steps before its outer step
and runs beside them; the fragment then continues from the new anchor plus its progress since the send.
The same operations in the same order as app/parallel/diloco.py, written again
here so that `python -m app.parity` compares two implementations (docs/parity.md, P10).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from app.parallel.fragments import fragment_indices, trainable

# `DiLoCoStrategy`'s defaults (app/parallel/diloco.py; tests/parallel/test_diloco.py keeps them equal).
DEFAULTS = {
    "sync_every": 10,
    "outer_lr": 0.7,
    "outer_momentum": 0.9,
    "outer_nesterov": True,
    "fragments": 1,
    "outer_dtype": "float32",
    "overlap_steps": 0,
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def diloco_settings(trainer_config: dict[str, Any]) -> dict[str, Any] | None:
    """`trainer.strategy` as DiLoCo's settings (defaults filled in), or None for any other strategy."""
    strategy = trainer_config.get("strategy")
    if strategy == "diloco":
        return dict(DEFAULTS)
    if isinstance(strategy, dict) and str(strategy.get("class_path", "")).endswith(".DiLoCoStrategy"):
        given = strategy.get("init_args") or {}
        return {key: given.get(key, default) for key, default in DEFAULTS.items()}
    return None


@torch.no_grad()
def broadcast(tensor: torch.Tensor) -> None:
    """Rank 0's values into `tensor` (gloo takes only contiguous tensors: a channels_last weight is copied)."""
    source = tensor if tensor.is_contiguous() else tensor.contiguous()
    dist.broadcast(source, src=0)
    if source is not tensor:
        tensor.copy_(source)


class DiLoCo:
    """The outer loop: call `after_inner_step()` after every `optimizer.step()`."""

    def __init__(self, net: nn.Module, world_size: int, settings: dict[str, Any]) -> None:
        self.net, self.world_size = net, world_size
        self.sync_every, self.fragments = settings["sync_every"], settings["fragments"]
        self.dtype = DTYPES[settings["outer_dtype"]]
        if world_size > 1:  # every replica starts from rank 0's weights (as DDP's constructor does)
            for tensor in net.state_dict().values():
                broadcast(tensor)
        self.parameters = [parameter for _, parameter in trainable(net)]
        self.anchors = [parameter.detach().float().clone() for parameter in self.parameters]
        # Which parameters sync together: the same cut as the strategy's (a definition, not the algorithm).
        self.parts = fragment_indices(net, self.fragments)
        momentum = settings["outer_momentum"]
        self.outer = [
            torch.optim.SGD(
                [self.anchors[i] for i in part],
                lr=settings["outer_lr"],
                momentum=momentum,
                nesterov=settings["outer_nesterov"] and momentum > 0,
            )
            for part in self.parts
        ]
        self.inner_steps = 0
        self.overlap = settings["overlap_steps"]
        # fragment -> (its outer gradient, the all-reduce's handle, its parameters when sent)
        self.in_flight: dict[int, tuple[torch.Tensor, Any, list[torch.Tensor]]] = {}

    def due(self, step: int) -> list[int]:
        every = self.sync_every // self.fragments
        return [f for f in range(self.fragments) if step % self.sync_every == ((f + 1) * every) % self.sync_every]

    def after_inner_step(self) -> None:
        self.inner_steps += 1
        for fragment in self.due(self.inner_steps):
            self.sync(fragment)
        if self.overlap:  # the exchange of the outer step `overlap` steps ahead starts now
            for fragment in self.due(self.inner_steps + self.overlap):
                self.in_flight[fragment] = self.start(fragment)

    @torch.no_grad()
    def start(self, fragment: int) -> tuple[torch.Tensor, Any, list[torch.Tensor]]:
        part = self.parts[fragment]
        anchors, parameters = [self.anchors[i] for i in part], [self.parameters[i] for i in part]
        # The outer gradient: how far this replica moved since the last sync, averaged over the replicas.
        flat = torch.cat([(a - p.float()).reshape(-1) for a, p in zip(anchors, parameters, strict=True)]).to(self.dtype)
        work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, async_op=True) if self.world_size > 1 else None
        # With overlap, the parameters as sent: the progress since is what the replica keeps.
        return flat, work, [p.detach().float().clone() if self.overlap else p for p in parameters]

    def finish(self) -> None:
        """Wait for an exchange still in flight (at the end of training): its result is not applied."""
        for _, work, _ in self.in_flight.values():
            if work is not None:
                work.wait()

    @torch.no_grad()
    def sync(self, fragment: int) -> None:
        part = self.parts[fragment]
        anchors, parameters = [self.anchors[i] for i in part], [self.parameters[i] for i in part]
        flat, work, sent = self.in_flight.pop(fragment, None) or self.start(fragment)
        if work is not None:
            work.wait()
        flat.div_(self.world_size)
        offset = 0
        for anchor in anchors:
            anchor.grad = flat[offset : offset + anchor.numel()].view_as(anchor).float()
            offset += anchor.numel()
        self.outer[fragment].step()
        for anchor, parameter, then in zip(anchors, parameters, sent, strict=True):
            anchor.grad = None
            # In line (no overlap) the replica is the anchor; with overlap, its progress since the send is kept.
            parameter.copy_(anchor + (parameter.float() - then) if self.overlap else anchor)
        if self.world_size > 1:
            for buffer in self.net.buffers():
                broadcast(buffer)
