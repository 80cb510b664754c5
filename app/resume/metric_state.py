"""What a rank accumulates during an epoch outside the model's state_dict, kept per rank in checkpoints.

A training epoch's metrics (every torchmetrics state, and what a module returns from
`per_rank_state()`) are per-rank running sums: resumed in an epoch's middle without them, the
epoch's logged metrics would cover only the batches after the resume. `app.resume.exact.ExactResume`
saves them with each rank's random state (one gather per save) and loads them when training starts.
"""

from __future__ import annotations

import copy
from typing import Any

import lightning as L


def per_rank_module_state(pl_module: L.LightningModule) -> dict[str, Any]:
    """What a rank accumulates during an epoch outside the state_dict: every torchmetrics metric's
    state, and what the module returns from `per_rank_state()` if it has one (our classifiers' training
    accuracy counts). Resumed mid-epoch, the epoch's metrics then cover the whole epoch."""
    from torchmetrics import Metric

    metrics = {
        name: {key: copy.deepcopy(value) for key, value in module.metric_state.items()}
        | {"_update_count": module._update_count}
        for name, module in pl_module.named_modules()
        if isinstance(module, Metric)
    }
    own = pl_module.per_rank_state() if hasattr(pl_module, "per_rank_state") else {}
    return {"metrics": metrics, "own": own}


def load_per_rank_module_state(pl_module: L.LightningModule, state: dict[str, Any]) -> None:
    modules = dict(pl_module.named_modules())
    for name, values in state.get("metrics", {}).items():
        metric = modules.get(name)
        if metric is None:
            continue
        for key, value in values.items():
            if key == "_update_count":
                metric._update_count = value
            elif isinstance(value, list):
                setattr(metric, key, [item.to(pl_module.device) for item in value])
            else:
                setattr(metric, key, value.to(pl_module.device))
    if state.get("own") and hasattr(pl_module, "load_per_rank_state"):
        pl_module.load_per_rank_state(state["own"])
