"""`compile: true`: run a LightningModule's networks through `torch.compile`.

Lightning compiles only a module's `forward` (`torch.compile(model)` before `fit`), but a
`training_step` usually calls its networks directly (`self.net(x)`), so that would compile nothing
the step runs. Here every direct child of the LightningModule that holds parameters is compiled in
place (`nn.Module.compile`): the step's forward and backward through it run compiled, the
`state_dict` keys stay as they are (checkpoints load into an uncompiled model and back), and DDP
wraps the LightningModule as before. Losses without parameters and torchmetrics metrics stay eager.

Compiled code sums in another order than eager code: weights differ from an eager run by float
rounding (tests/models/test_compiling.py states and checks the tolerance). The first step of each
shape compiles (seconds to minutes; `python -m app.bench` reports it as the first step's time).
"""

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
