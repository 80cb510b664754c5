"""Where each training step's time goes, on every rank of every fit: data, compute, communication, other.

`StepTiming` (installed by app/run/build.py `build_trainer`) splits each training step on its rank,
from the end of the previous step to the end of this one, into:

- data: the training loader's `next()`. Lightning wraps that call in `trainer.profiler.start` and
  `stop` ("[_TrainingEpochLoop].train_dataloader_next"); ddp-app's default profiler (`NoProfiler`,
  app/run/build.py) adds up its time. Under a profiler of the config's own it is not measured (0,
  and the time counts as other).
- communication: the gradient all-reduce's exposed wait: from the moment the step's last gradient is
  accumulated (a post-accumulate-grad hook on every trained parameter; DDP launches the last bucket's
  all-reduce right then) to the end of `backward` (where DDP waits for every bucket). All-reduce
  that overlaps the backward pass is hidden and not counted; waiting for a slower rank is counted.
  Under strategy diloco (app/parallel/diloco.py) it is the outer step's collectives instead, in the
  step whose optimizer step they follow (every sync_every / fragments steps; its `no_communication`
  ablation skips them).
- compute: this callback's `on_train_batch_start` to its `on_train_batch_end` less communication:
  forward, backward, optimizer step, and the hooks of the callbacks after it inside the step.
- other: the rest: what Lightning and ddp-app do between steps (logging, the other callbacks'
  batch-end hooks, ddp-app's checks).

The first step of each epoch and the first after a validation have no previous end: not counted.
Each rank keeps its epoch's sums; at the epoch's end `app.run.coordinator.RunCoordinator` exchanges
every rank's means in its one message and this callback logs, from that same table on every rank:
`step_ms` (the ranks' mean step), the four shares in percent, and the slowest rank by its own work
(the step less communication, which is waiting for others) against the median rank. The fit's
summary (app/run/summary.py) prints them; the loggers and trackers get them as any logged value.

`ablation` and `record_dir` are for `ddp-app diagnose` (app/cli/diagnose.py), which runs the config
once per ablation: `batch_in_memory` trains on the first batch again and again (no data cost;
app/run/build.py `prepare_run` puts it in place), `no_communication` registers a DDP communication
hook that keeps each rank's own gradients (PyTorch's `noop_hook`, made for this headroom
analysis: no all-reduce, so no rank waits for another; DDP's buffer broadcast, for BatchNorm,
still runs). `record_dir` gets every step of every rank
(`rank<N>.json`) at the end of training.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import socket
import statistics
import time
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.distributed.algorithms.ddp_comm_hooks.debugging_hooks import noop_hook
from torch.nn.parallel import DistributedDataParallel

from app.checkpoints import state as checkpoint_state
from app.errors import InvalidConfigError
from app.parallel.diloco import DiLoCoStrategy
from app.tracking.layout import STEP_TIME_METRICS

ABLATIONS = ("none", "batch_in_memory", "no_communication")
PARTS = ("data", "compute", "communication", "other")
# Every rank logs the same value from the exchanged table: no sync_dist (and no collective) needed.
warnings.filterwarnings("ignore", message=r".*self\.log\('step_\w+', \.\.\., sync_dist=True\)")


class StepTiming(L.Callback):
    """The `step_timing:` config section; see the module docstring.

    Args:
        enabled: time every training step (its cost: docs/performance.md).
        ablation: none, or one of `ddp-app diagnose`'s variants (batch_in_memory, no_communication).
        record_dir: write every step's times of every rank there (`ddp-app diagnose` sets it).
    """

    def __init__(self, enabled: bool = True, ablation: str = "none", record_dir: str | None = None) -> None:
        if ablation not in ABLATIONS:
            raise InvalidConfigError(
                f"step_timing.ablation must be one of {', '.join(ABLATIONS)}, got {ablation!r}. "
                "Fix: leave it out (ddp-app diagnose sets it for its own runs)."
            )
        self.enabled = enabled
        self.ablation = ablation
        self.record_dir = record_dir
        self._hooks: list[Any] = []
        self._profiler: Any = None
        self._last_gradient_at: float | None = None
        self._previous_end: float | None = None
        self._fetched_before = 0.0
        self._started = 0.0
        self._communication = 0.0
        self._sums = [0.0] * 5  # step, data, compute, communication, other (seconds) this epoch
        self._steps = 0
        self._record: list[list[float]] = []
        self._facts: dict[str, Any] = {}
        self._diloco: DiLoCoStrategy | None = None

    def _gradient_ready(self, parameter: torch.Tensor) -> None:
        self._last_gradient_at = time.perf_counter()

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        trained = [parameter for parameter in pl_module.parameters() if parameter.requires_grad]
        self._hooks = [parameter.register_post_accumulate_grad_hook(self._gradient_ready) for parameter in trained]
        self._profiler = trainer.profiler if hasattr(trainer.profiler, "training_fetch_s") else None
        self._previous_end = None
        self._record = []
        ddp = trainer.strategy.model
        if self.ablation == "no_communication" and isinstance(ddp, DistributedDataParallel):
            ddp.register_comm_hook(None, noop_hook)
        diloco = trainer.strategy if isinstance(trainer.strategy, DiLoCoStrategy) else None
        if diloco is not None:  # its outer steps' collectives are its communication (in the step they end)
            diloco.communicate = self.ablation != "no_communication"
            diloco.communication_s = 0.0
        self._diloco = diloco
        loader = trainer.train_dataloader
        self._facts = {
            "rank": trainer.global_rank,
            "world_size": trainer.world_size,
            "host": socket.gethostname(),
            "cpu_count": os.cpu_count(),
            "gradient_bytes": sum(parameter.numel() * parameter.element_size() for parameter in trained),
            "num_workers": getattr(loader, "num_workers", None),
            "persistent_workers": getattr(loader, "persistent_workers", None),
            "pin_memory": getattr(loader, "pin_memory", None),
            "device": str(trainer.strategy.root_device),
            "data_measured": self._profiler is not None,
            # strategy diloco: steps between two outer steps (of a fragment), where the exchange happens
            "outer_every": diloco.sync_every // diloco.fragments if diloco is not None else None,
        }

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        checkpoint_state.put(checkpoint, "step_timing", {"sums": self._sums, "steps": self._steps})

    def on_load_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        # An epoch resumed in its middle or at its end (no on_train_epoch_start) continues rank 0's sums
        # (the checkpoint's): an attempt that trains none of its steps still logs the epoch's figures.
        saved = checkpoint_state.get(checkpoint, "step_timing") or {}
        self._sums, self._steps = list(saved.get("sums", [0.0] * 5)), int(saved.get("steps", 0))

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._previous_end = None
        self._sums = [0.0] * 5
        self._steps = 0

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._previous_end = None

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._communication = 0.0
        self._started = time.perf_counter()

    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._last_gradient_at is not None:
            self._communication += time.perf_counter() - self._last_gradient_at
            self._last_gradient_at = None

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        now = time.perf_counter()
        if self._diloco is not None:
            self._communication += self._diloco.communication_s
            self._diloco.communication_s = 0.0
        fetched = self._profiler.training_fetch_s if self._profiler is not None else 0.0
        if self._previous_end is not None:
            step = now - self._previous_end
            data = fetched - self._fetched_before
            compute = now - self._started - self._communication
            times = (step, data, compute, self._communication, max(step - data - compute - self._communication, 0.0))
            self._sums = [total + value for total, value in zip(self._sums, times, strict=True)]
            self._steps += 1
            if self.record_dir is not None:
                self._record.append(list(times))
        self._previous_end = now
        self._fetched_before = fetched

    def epoch_means(self) -> tuple[float, ...] | None:
        """This rank's mean step, data, compute, communication and other (seconds) this epoch; None: no step."""
        return tuple(total / self._steps for total in self._sums) if self._steps else None

    def log_epoch(self, pl_module: L.LightningModule, rows: list[list[float]]) -> None:
        """Log `STEP_TIME_METRICS` from every rank's `epoch_means` (the coordinator's exchanged table)."""
        for name, value in epoch_metrics(rows).items():
            pl_module.log(name, value, on_step=False, on_epoch=True)

    def _stop(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._stop()
        if self.record_dir is not None:
            directory = Path(self.record_dir)
            directory.mkdir(parents=True, exist_ok=True)
            record = {**self._facts, "ablation": self.ablation, "steps": self._record}
            path = directory / f"rank{trainer.global_rank}.json"
            path.with_suffix(".tmp").write_text(json.dumps(record))
            os.replace(path.with_suffix(".tmp"), path)  # whole or absent: diagnose reads it from another node

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._stop()


def epoch_metrics(rows: list[list[float]]) -> dict[str, float]:
    """The logged values (`STEP_TIME_METRICS`, in that order) from every rank's mean step and parts."""
    step = statistics.fmean(row[0] for row in rows)
    parts = [statistics.fmean(row[index] for row in rows) for index in range(1, 5)]
    own = [row[0] - row[3] for row in rows]  # a rank's own work: its step less waiting in the all-reduce
    slowest = max(range(len(rows)), key=lambda rank: own[rank])
    shares = [100 * part / step if step > 0 else 0.0 for part in parts]
    values = [1000 * step, *shares, float(slowest), 1000 * own[slowest], 1000 * statistics.median(own)]
    return dict(zip(STEP_TIME_METRICS, values, strict=True))


def step_line(metrics: dict[str, float]) -> str | None:
    """`step 41.0 ms: data 3%, compute 71%, communication 22%, other 4%; slowest rank 1 ...`, or None."""
    if STEP_TIME_METRICS[0] not in metrics:
        return None
    step, *shares, slowest, slowest_ms, median_ms = (metrics[name] for name in STEP_TIME_METRICS)
    parts = ", ".join(f"{part} {share:.0f}%" for part, share in zip(PARTS, shares, strict=True))
    return (
        f"step {step:.3g} ms (last epoch, mean of the ranks): {parts}; "
        f"slowest rank {slowest:.0f}: {slowest_ms:.3g} ms of its own work, median rank {median_ms:.3g} ms"
    )


class FirstBatchAgain:
    """A training loader's first batch, as many times as it has batches: steps without data cost."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Any:
        return itertools.repeat(next(iter(self.loader)), len(self.loader))


def serve_first_batch_again(source: L.LightningDataModule | L.LightningModule) -> None:
    """`batch_in_memory`: the source's `train_dataloader` returns `FirstBatchAgain` of its loader
    (`functools.wraps` keeps Lightning's `is_overridden` answering as for the method it wraps)."""
    method = source.train_dataloader
    source.train_dataloader = functools.wraps(method)(lambda: FirstBatchAgain(method()))
