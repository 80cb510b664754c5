"""What a rank accumulates during an epoch outside the model's state_dict (torchmetrics states, `per_rank_state()`),
kept per rank in checkpoints so a mid-epoch resume logs the whole epoch. Saved and loaded by
`app.resume.exact.ExactResume`."""

from __future__ import annotations

import copy
from typing import Any

import lightning as L

from app.private_apis import require

# Our key for a metric's update count in the saved state (checkpoints written before it was read through the public
# `update_count` use the same key).
UPDATE_COUNT = "_update_count"


def per_rank_module_state(pl_module: L.LightningModule) -> dict[str, Any]:
    """What a rank accumulates during an epoch outside the state_dict: every torchmetrics metric's state, and what the
    module returns from `per_rank_state()` if it has one (our classifiers' training accuracy counts). Resumed mid-epoch,
    the epoch's metrics then cover the whole epoch."""
    from torchmetrics import Metric

    metrics = {
        name: {key: copy.deepcopy(value) for key, value in module.metric_state.items()}
        | {UPDATE_COUNT: module.update_count}
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
        device = pl_module.device
        states = {
            key: [item.to(device) for item in value] if isinstance(value, list) else value.to(device)
            for key, value in values.items()
            if key != UPDATE_COUNT
        }
        # torchmetrics' Metric._load_from_state_dict sets every state the dict holds, persistent or not: the public load
        # path. strict=False: the metric's own parameters and buffers (and its child metrics', saved under their own
        # names) are not in it.
        metric.load_state_dict(states, strict=False)
        # torchmetrics has no setter for update_count; a metric whose states reduce by "mean" weighs the batches before
        # a resume by it in forward() (docs/private_apis.md).
        needed_for = "restoring a metric's update count on a mid-epoch resume"
        require(metric, UPDATE_COUNT, "torchmetrics", needed_for, owner_name="Metric")
        metric._update_count = values.get(UPDATE_COUNT, 0)
    if state.get("own") and hasattr(pl_module, "load_per_rank_state"):
        pl_module.load_per_rank_state(state["own"])
