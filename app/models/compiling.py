"""`compile: true`: run a LightningModule's networks through `torch.compile`.

Lightning compiles only `forward`, which a `training_step` calling `self.net(x)` never runs. Here every direct child
holding parameters is compiled in place (`nn.Module.compile`): `state_dict` keys stay (checkpoints load either way) and
DDP wraps as before; parameterless losses and metrics stay eager. Compiled sums differ by float rounding
(tests/models/test_compiling.py checks the tolerance); each shape's first step compiles."""

from __future__ import annotations

import torch
from torchmetrics import Metric


def compile_networks(module: torch.nn.Module) -> list[str]:
    """Compile, in place, every direct child of `module` that holds parameters; returns their names."""
    compiled = []
    for name, child in module.named_children():
        if isinstance(child, Metric) or next(child.parameters(), None) is None:
            continue
        child.compile()
        compiled.append(name)
    return compiled
