"""A one-line warning when a LightningModule logs an evaluation metric that is not exact across ranks.

`self.log("val_loss", loss, sync_dist=True)` averages per-rank means, but ranks hold different sample counts;
torchmetrics objects or summed states are exact. Lightning keeps what was logged only privately (`trainer._results`), so
`ddp-app` wraps the module instance's `log` before the run."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

import lightning as L
import torch
from torchmetrics import Metric

# The attribute of a wrapped `log` that holds the current run's Trainer (a later run updates it).
WRAPPED = "_ddp_app_checks_sync_dist_for"


def per_rank_mean_warning(module_name: str, metric_name: str) -> str:
    return (
        f"ddp-app: warning: {module_name} logs {metric_name!r} during evaluation with sync_dist=True, a mean of "
        "per-rank means: the ranks hold different numbers of samples, so it is not the mean over the whole set. "
        "Fix: log a torchmetrics object (e.g. MeanMetric updated with weight=batch size), or log sums with "
        "reduce_fx='sum'."
    )


def warn_on_per_rank_means(trainer: L.Trainer, module: L.LightningModule) -> None:
    """Make `module.log` print `per_rank_mean_warning` once (on global rank 0) when it applies."""
    log: Callable[..., Any] = module.log
    run = getattr(log, WRAPPED, None)
    if run is not None:
        run["trainer"] = trainer
        return
    run = {"trainer": trainer}
    warned: list[str] = []

    @functools.wraps(log)
    def checked_log(name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        # sync_dist first: the other conditions are only read for the few calls that set it.
        if kwargs.get("sync_dist") and not warned:
            trainer = run["trainer"]
            per_rank_mean = kwargs.get("reduce_fx", "mean") in ("mean", torch.mean) and not isinstance(value, Metric)
            if per_rank_mean and not trainer.training and trainer.world_size > 1:
                warned.append(name)
                if trainer.is_global_zero:
                    print(per_rank_mean_warning(type(module).__name__, name), file=sys.stderr, flush=True)
        return log(name, value, *args, **kwargs)

    setattr(checked_log, WRAPPED, run)
    module.log = checked_log  # type: ignore[method-assign]
