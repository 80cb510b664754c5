"""A user's module that initialises CUDA when it is imported, as `x = torch.zeros(1, device="cuda")` at
module level would on a machine with a GPU.

This machine has none, so the state that line leaves behind is simulated: `torch.cuda.is_initialized()`
answers True from now on in this process (what ddp-app's launcher asks before it forks the ranks).
"""

from __future__ import annotations

import torch

from tests.helpers.user_module import TwoLayerRegressor

torch.cuda.is_initialized = lambda: True  # what `torch.zeros(1, device="cuda")` here would leave behind


class ModelImportedWithCuda(TwoLayerRegressor):
    pass
