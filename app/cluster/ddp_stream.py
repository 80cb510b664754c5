"""Lightning's DistributedDataParallel, built on the CUDA stream the training steps run on.

Lightning 2.6 builds DDP under a side stream (`DDPStrategy._setup_model`), so DDP's AccumulateGrad nodes live there and
every gradient crosses streams at every backward (torch 2.11 warns). Fixed upstream (Lightning PR #21746); until then
`build_ddp_on_the_current_stream` builds the wrapper as Lightning does, minus the side stream (and, at one rank, the
buffer broadcast: app/cluster/ddp_buffers.py).

Private (docs/private_apis.md); tests/test_private_apis.py says when Lightning no longer needs it."""

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
    """Make a DDPStrategy (as Lightning ships it) wrap its model on the current stream; `kind`: the plan's strategy
    kind. Other strategies, and subclasses with their own `_setup_model`, are left alone."""
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
