"""Lightning's DistributedDataParallel, built on the CUDA stream the training steps run on.

Lightning 2.6 builds the DDP wrapper under a CUDA stream of its own (`DDPStrategy._setup_model`,
`torch.cuda.stream(torch.cuda.Stream())`, kept for whole-network CUDA graph capture, which ddp-app
does not do). DDP's reducer creates and keeps every parameter's `AccumulateGrad` node there, and
autograd runs a gradient's accumulation on the stream its node was created on: every backward then
moves every parameter's gradient from the default stream to that side stream and back (an event
record and a stream wait per gradient, and the DDP hooks on the side stream). torch 2.11 warns
about it at the first backward ("The AccumulateGrad node's stream does not match ..."). The
plain-PyTorch reference builds DDP on the default stream. Lightning fixed this upstream (Lightning
PR #21746, after 2.6); until the pinned version has it, `build_ddp_on_the_current_stream` builds
the wrapper the way Lightning does, with the same arguments, minus the side stream (and, at one
rank, minus the buffer broadcast that reaches no one: app/cluster/ddp_buffers.py).

Private (docs/private_apis.md); tests/test_private_apis.py says when Lightning no longer needs it.
"""

from __future__ import annotations

from lightning.pytorch.strategies import DDPStrategy
from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel

from app.cluster.ddp_buffers import without_single_rank_broadcast
from app.parallel.strategy import StrategyKind
from app.private_apis import require

# The DDPStrategy method that wraps the model, and the attribute holding DDP's own arguments.
LIGHTNING_DDP_WRAP = "_setup_model"
LIGHTNING_DDP_KWARGS = "_ddp_kwargs"


def build_ddp_on_the_current_stream(strategy: object, kind: StrategyKind) -> None:
    """Make a DDPStrategy (as Lightning ships it) wrap its model on the stream current at the time.

    `kind`: the run plan's strategy kind. A strategy that is not a DDPStrategy, or a subclass with its
    own `_setup_model`, is left alone.
    """
    if kind is not StrategyKind.DDP:
        return
    needed_for = "building DistributedDataParallel on the training stream (app/cluster/ddp_stream.py)"
    own = require(DDPStrategy, LIGHTNING_DDP_WRAP, "lightning", needed_for)
    if getattr(type(strategy), LIGHTNING_DDP_WRAP) is not own:
        return
    require(strategy, LIGHTNING_DDP_KWARGS, "lightning", needed_for)

    def wrap_on_the_current_stream(model: Module) -> DistributedDataParallel:
        # Read when the model is wrapped, as Lightning does: the strategy's arguments may change until then.
        ddp_kwargs = without_single_rank_broadcast(getattr(strategy, LIGHTNING_DDP_KWARGS), strategy.world_size)
        return DistributedDataParallel(module=model, device_ids=strategy.determine_ddp_device_ids(), **ddp_kwargs)

    setattr(strategy, LIGHTNING_DDP_WRAP, wrap_on_the_current_stream)
