"""What a run says at its end: one short block after fit, validate, test and predict (rank 0): how it went, where the
checkpoints, logs and predictions are, where the tracker shows it, and how long it took.

`scalar_metrics` reads `trainer.callback_metrics`, which reduces unread `sync_dist=True` values, so it is called on
every rank and only rank 0 prints."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint

from app.checkpoints.last import LAST_NAME, checkpoint_directory
from app.parallel.fault_tolerance import FaultTolerancePlan
from app.run.step_timing import step_line
from app.tracking.layout import SAMPLES_PER_S, STEP_TIME_METRICS
from app.tracking.throughput import batch_size_of


def duration(seconds: float) -> str:
    """`8.2 s`, `3 min 05 s`, `2 h 04 min`: as a person reads a wall time."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(int(round(seconds)), 60)
    if minutes < 60:
        return f"{minutes} min {secs:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"


def scalar_metrics(trainer: L.Trainer) -> dict[str, float]:
    """The run's logged scalars as they stand (epoch-level values after an epoch or an evaluation)."""
    metrics = {}
    for name, value in trainer.callback_metrics.items():
        if (isinstance(value, torch.Tensor) and value.numel() == 1) or isinstance(value, (int, float)):
            metrics[name] = float(value)
    return metrics


def metric_fields(metrics: dict[str, float], leave_out: tuple[str, ...] = ()) -> str:
    """`val_acc=0.9722 val_loss=0.09121`: validation first, then the rest, alphabetically within each."""
    names = sorted(
        (name for name in metrics if name not in leave_out), key=lambda name: (not name.startswith("val"), name)
    )
    return " ".join(f"{name}={metrics[name]:.4g}" for name in names)


def monitored(trainer: L.Trainer) -> list[str]:
    """`best val_acc=0.975 (max): <path>` per ModelCheckpoint that monitors a metric, and EarlyStopping's state."""
    lines = []
    for callback in trainer.callbacks:
        if isinstance(callback, ModelCheckpoint) and callback.monitor and callback.best_model_score is not None:
            where = f": {callback.best_model_path}" if callback.best_model_path else ""
            lines.append(f"best {callback.monitor}={float(callback.best_model_score):.4g} ({callback.mode}){where}")
        elif isinstance(callback, EarlyStopping) and callback.stopped_epoch:
            lines.append(
                f"early stopping: {callback.monitor} stopped improving; stopped at epoch {callback.stopped_epoch}"
            )
    return lines


def log_folder(trainer: L.Trainer) -> str | None:
    logger = trainer.logger
    return str(logger.log_dir) if logger is not None and getattr(logger, "log_dir", None) else None


def fit_summary(
    trainer: L.Trainer,
    metrics: dict[str, float],
    elapsed_s: float,
    tracker_lines: list[str],
    replica_groups: FaultTolerancePlan | None = None,
) -> list[str]:
    """The block after a fit: see the module docstring. `metrics`: `scalar_metrics`, read on every rank.
    `replica_groups`: a fault-tolerant run's groups, each a Lightning run of its own (said as such)."""
    processes = f"{trainer.world_size} process{'es' if trainer.world_size > 1 else ''}"
    if replica_groups is not None:
        processes = f"{replica_groups.groups} replica groups of {replica_groups.group_size} process(es)"
    head = (
        f"ddp-app: fit done in {duration(elapsed_s)}: {trainer.current_epoch} epochs, "
        f"{trainer.global_step} steps on {processes}"
    )
    if SAMPLES_PER_S in metrics:
        head += f", {metrics[SAMPLES_PER_S]:,.0f} samples/s (last epoch)"
    lines = [head]
    shown = metric_fields(metrics, leave_out=(SAMPLES_PER_S, "epoch", "step", *STEP_TIME_METRICS))
    if shown:
        lines.append(f"  last: {shown}")
    steps = step_line(metrics)
    if steps:
        lines.append(f"  {steps}")
    lines += [f"  {line}" for line in monitored(trainer)]
    last = checkpoint_directory(trainer) / LAST_NAME
    if last.exists():  # a file, or a link to a sharded checkpoint (strategy fsdp)
        lines.append(f"  last checkpoint: {last} (continue: --ckpt_path last)")
    logs = log_folder(trainer)
    if logs:
        lines.append(f"  logs: {logs} (curves: python -m app.plot {trainer.default_root_dir})")
    lines += [f"  {line}" for line in tracker_lines]
    return lines


class EvaluationThroughput(L.Callback):
    """Samples per second of validate, test and predict: rank 0's batches times the world size (the sampler gives every
    rank as many), from the first batch's start to the last one's end."""

    def __init__(self) -> None:
        self.samples = 0
        self.first_start: float | None = None
        self.last_end = 0.0

    def _start(self, *args: Any) -> None:
        if self.first_start is None:
            self.first_start = time.perf_counter()

    def _end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, *args: Any) -> None:
        self.samples += batch_size_of(batch) * trainer.world_size
        self.last_end = time.perf_counter()

    on_validation_batch_start = on_test_batch_start = on_predict_batch_start = _start
    on_validation_batch_end = on_test_batch_end = on_predict_batch_end = _end

    def samples_per_s(self) -> float | None:
        if self.first_start is None or self.last_end <= self.first_start:
            return None
        return self.samples / (self.last_end - self.first_start)


def evaluation_summary(
    subcommand: str,
    trainer: L.Trainer,
    metrics: dict[str, float],
    elapsed_s: float,
    ckpt_path: str | None,
    throughput: EvaluationThroughput | None,
) -> list[str]:
    """The block after validate, test or predict."""
    processes = f"{trainer.world_size} process{'es' if trainer.world_size > 1 else ''}"
    head = f"ddp-app: {subcommand} done in {duration(elapsed_s)} on {processes}"
    rate = throughput.samples_per_s() if throughput is not None else None
    if throughput is not None and throughput.samples:
        head += f": {throughput.samples:,} samples"
        if rate:
            head += f", {rate:,.0f} samples/s"
    lines = [head]
    lines.append(f"  checkpoint: {ckpt_path}" if ckpt_path else "  checkpoint: none (the model as initialised)")
    if subcommand != "predict":
        shown = metric_fields(metrics)
        if shown:
            lines.append(f"  metrics: {shown}")
        logs = log_folder(trainer)
        if logs:
            lines.append(f"  logs: {logs}")
    else:
        predictions = Path(trainer.default_root_dir) / "predictions.pt"
        if predictions.is_file():
            lines.append(f"  predictions: {predictions}")
    return lines
