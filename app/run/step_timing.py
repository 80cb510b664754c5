"""Where each training step's time goes, on every rank of every fit: data, compute, communication, other.

`StepTiming` splits each step, from the previous step's end to this one's, into:

- data: the loader's `next()`, timed through `trainer.profiler` by ddp-app's `NoProfiler` (not measured under a config's
  own profiler);
- communication: under DDP, the all-reduce's exposed wait, from the last gradient's accumulation (a post-accumulate-grad
  hook) to the end of `backward`; overlapped all-reduce is hidden, waiting for a slower rank counts. Under FSDP2, the
  all-gathers and reduce-scatters inside forward and backward, with their bytes (app/parallel/collective_timing.py).
  Under diloco, the outer step's collectives, in the step whose optimizer step they follow (every sync_every /
  fragments steps; its `no_communication` ablation skips them);
- compute: `on_train_batch_start` to `on_train_batch_end` less communication;
- other: the rest (logging, other callbacks' hooks, ddp-app's checks).

Each epoch's first step and the first after validation are not counted. At the epoch's end `RunCoordinator` exchanges
every rank's means and this callback logs `step_ms`, the four shares and the slowest rank by own work against the
median; app/run/summary.py prints them.

`ablation` and `record_dir` are for `ddp-app diagnose`: `batch_in_memory` repeats the first batch (set up in
app/run/build.py `prepare_run`), `no_communication` registers PyTorch's `noop_hook` (no all-reduce; buffer broadcast
still runs); `record_dir` gets every step of every rank (`rank<N>.json`)."""

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
from app.parallel.collective_timing import CollectiveClock, time_fsdp_collectives
from app.parallel.compression import GradientCompression
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
        record_dir: write every step's times of every rank there (`ddp-app diagnose` sets it)."""

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
        self._collectives = CollectiveClock()
        self._collective_bytes = 0
        self._diloco: DiLoCoStrategy | None = None

    def _gradient_ready(self, parameter: torch.Tensor) -> None:
        self._last_gradient_at = time.perf_counter()

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        trained = [parameter for parameter in pl_module.parameters() if parameter.requires_grad]
        layout = getattr(trainer.strategy, "mesh_layout", None)
        hybrid = layout is not None and layout.replicas > 1
        sharded = time_fsdp_collectives(pl_module, self._collectives, hybrid) > 0
        diloco = trainer.strategy if isinstance(trainer.strategy, DiLoCoStrategy) else None
        # Under FSDP2 and diloco the collectives are timed where they run, not after the last gradient (diloco's
        # backward all-reduces nothing: that gap would only add noise).
        if not sharded and diloco is None:
            self._hooks = [parameter.register_post_accumulate_grad_hook(self._gradient_ready) for parameter in trained]
        self._profiler = trainer.profiler if hasattr(trainer.profiler, "training_fetch_s") else None
        self._previous_end = None
        self._record = []
        ddp = trainer.strategy.model
        if self.ablation == "no_communication" and isinstance(ddp, DistributedDataParallel):
            ddp.register_comm_hook(None, noop_hook)
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
            "collectives": "fsdp" if sharded else "ddp",
            # diagnose tries compression only where the run has none of its own
            "gradient_compression": next(
                (callback.method for callback in trainer.callbacks if isinstance(callback, GradientCompression)), "none"
            ),
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
        # An epoch resumed in its middle or at its end (no on_train_epoch_start) continues rank 0's sums (the
        # checkpoint's): an attempt that trains none of its steps still logs the epoch's figures.
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
        self._collectives.take()
        self._started = time.perf_counter()

    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._last_gradient_at is not None:
            self._communication += time.perf_counter() - self._last_gradient_at
            self._last_gradient_at = None

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        now = time.perf_counter()
        collective_s, collective_bytes = self._collectives.take()
        self._communication += collective_s
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
            self._collective_bytes = collective_bytes
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
            if self._facts.get("collectives") == "fsdp":  # the bytes of the last timed step (all alike)
                record["communication_bytes"] = self._collective_bytes
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
    """`batch_in_memory`: the source's `train_dataloader` returns `FirstBatchAgain` of its loader (`functools.wraps`
    keeps Lightning's `is_overridden` answering as for the method it wraps)."""
    method = source.train_dataloader
    source.train_dataloader = functools.wraps(method)(lambda: FirstBatchAgain(method()))
