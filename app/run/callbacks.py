"""Callbacks every `ddp-app` run gets: a guard against NaN/Inf, the writer of `ddp-app predict`'s output, and the
progress display (a bar on a terminal, lines in a log). Exact resume: `app.resume.exact`."""

from __future__ import annotations

import logging
import math
import os
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import BasePredictionWriter, ModelSummary, ProgressBar, TQDMProgressBar

from app.checkpoints.io import atomic_torch_save
from app.checkpoints.last import find_last_checkpoint
from app.errors import NonFiniteLossError
from app.run.console import is_verbose
from app.tracking.throughput import TrainingClock, batch_size_of, samples_per_s


class NonFiniteGuard(L.Callback):
    """Stops training at the first optimizer step whose gradients are NaN or Inf, and never lets a checkpoint hold its
    weights.

    Reading a verdict on the host every step would stall a GPU (issue 22), so each step keeps its gradients' total norm
    on the device and the host reads them, stacked, only every `trainer.log_every_n_steps` steps, before any checkpoint
    is written (`on_save_checkpoint`), and at the end of training; then it raises `NonFiniteLossError` naming the first
    bad step and the last good checkpoint. Under a gradient scaler it checks nothing (the scaler skips such steps). The
    check runs after DDP's all-reduce, so every rank reaches the same verdict without a collective."""

    DEFAULT_READ_INTERVAL = 50  # optimizer steps between reads when logging is off

    def __init__(self) -> None:
        self._parameters: list[torch.nn.Parameter] = []
        # On the training device: each checked step's total gradient norm since the last read. A norm is finite exactly
        # when every gradient is (short of an overflow past 1e19 in the sum of squares, itself a diverged run); the read
        # stacks them and finds the first bad one.
        self._norms: list[torch.Tensor] = []
        self._first_step = 0  # trainer.global_step at train start: checked step i is global step _first_step + i
        self._steps_read = 0  # checked steps before those in `_norms`

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Collected once: walking `pl_module.parameters()` every step (through every submodule, metrics included) costs
        # 14x the cached list (`python -m app.bench.per_call`).
        self._parameters = [parameter for parameter in pl_module.parameters() if parameter.requires_grad]
        if getattr(trainer.precision_plugin, "scaler", None) is not None:  # MixedPrecision's public attribute
            self._parameters = []
        self._norms = []
        self._first_step = trainer.global_step
        self._steps_read = 0

    def on_before_optimizer_step(
        self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        grads = [parameter.grad for parameter in self._parameters if parameter.grad is not None]
        if grads:  # one norm over all gradients, kept on the device: no host read, no other op
            self._norms.append(torch.nn.utils.get_total_norm(grads, foreach=True))

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        interval = trainer.log_every_n_steps or self.DEFAULT_READ_INTERVAL
        if self._norms and trainer.global_step % interval == 0:
            self.raise_if_diverged(trainer)

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        self.raise_if_diverged(trainer)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.raise_if_diverged(trainer)

    def raise_if_diverged(self, trainer: L.Trainer) -> None:
        """The one host read of the steps checked since the last; raises if one had non-finite gradients."""
        if not self._norms:
            return
        finite = torch.stack(self._norms).isfinite()
        self._norms = []
        if bool(finite.all()):
            self._steps_read += len(finite)
            return
        first_bad = self._steps_read + int((~finite).nonzero()[0, 0])
        last = find_last_checkpoint(trainer) or "none written yet"
        raise NonFiniteLossError(
            f"the loss diverged: non-finite gradients at global step {self._first_step + first_bad} "
            f"(seen at step {trainer.global_step}, epoch {trainer.current_epoch}); no checkpoint holds weights "
            f"from that step on, last good checkpoint: {last}. "
            "Fix: lower the learning rate, clip gradients (trainer.gradient_clip_val) or check the data."
        )


class PredictionWriter(BasePredictionWriter):
    """`ddp-app predict` writes `<default_root_dir>/predictions.pt` ({"indices", "predictions"}): each rank predicts its
    unpadded shard, rank 0 merges them in dataset order."""

    def __init__(self) -> None:
        super().__init__(write_interval="epoch")

    def write_on_epoch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, predictions: Any, batch_indices: Any
    ) -> None:
        # With one dataloader Lightning passes the predictions as a flat list of batches but the indices still nested
        # per dataloader.
        if predictions and isinstance(predictions[0], list):
            predictions = predictions[0]
        if batch_indices and batch_indices[0] and isinstance(batch_indices[0][0], list):
            batch_indices = batch_indices[0]
        indices = torch.tensor([index for batch in batch_indices for index in batch], dtype=torch.long)
        merged = torch.cat([torch.as_tensor(batch) for batch in predictions]) if predictions else torch.empty(0)
        directory = Path(trainer.default_root_dir)
        shard = directory / f".predictions-rank{trainer.global_rank}.pt"
        directory.mkdir(parents=True, exist_ok=True)
        torch.save({"indices": indices, "predictions": merged}, shard)
        trainer.strategy.barrier("predictions written")
        if trainer.global_rank == 0:
            shards = [
                torch.load(directory / f".predictions-rank{rank}.pt", weights_only=True)
                for rank in range(trainer.world_size)
            ]
            all_indices = torch.cat([part["indices"] for part in shards])
            all_predictions = torch.cat([part["predictions"] for part in shards])
            order = torch.argsort(all_indices)
            atomic_torch_save(
                {"indices": all_indices[order], "predictions": all_predictions[order]}, directory / "predictions.pt"
            )
            for rank in range(trainer.world_size):
                (directory / f".predictions-rank{rank}.pt").unlink(missing_ok=True)
            print(f"ddp-app: wrote {len(order)} predictions to {directory / 'predictions.pt'}")


class ThrottledProgressBar(TQDMProgressBar):
    """Lightning's TQDM bar, redrawn during training at most every `min_interval_s` (the stock bar redraws every step, a
    real cost on a CPU); the epoch's last step is always drawn. A bar configured in `trainer.callbacks` is left alone.
    """

    def __init__(self, min_interval_s: float = 0.2, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.min_interval_s = min_interval_s
        self._last_redraw = -math.inf

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        now = time.monotonic()
        if now - self._last_redraw < self.min_interval_s and batch_idx + 1 != self.train_progress_bar.total:
            return
        self._last_redraw = now
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)


def batches_done_this_epoch(trainer: L.Trainer) -> int:
    """Training batches this rank has run in the current epoch (restored on a resume)."""
    return trainer.fit_loop.epoch_loop.batch_progress.current.processed


class LogLineProgressBar(ProgressBar):
    """Progress for a log file, not a terminal: one line per epoch, and within an epoch at most one every `interval_s`
    seconds:

        epoch=3 step=80 batch=20/20 samples/s=5120 train_loss=0.2311 val_loss=0.2050 val_acc=0.9630

    tqdm's redraws make one unreadable line in an sbatch log or CI. Values are the progress-bar metrics; samples/s is
    app/tracking/throughput.py's (the epoch's on its line, passed by `RunCoordinator`; since the last line within an
    epoch). Rank 0 prints; per step it costs two clock reads, no collective. The epoch line is printed after every rank
    reduced the epoch's values (`print_epoch_line`)."""

    def __init__(self, interval_s: float = 30.0) -> None:
        super().__init__()
        self.interval_s = interval_s
        self._enabled = True
        self._next_line_at = math.inf
        # This rank's training since the epoch's start (or this attempt's, for an epoch resumed in its middle), and its
        # (samples, seconds) at the previous line within the epoch.
        self._clock = TrainingClock()
        self._at_previous_line = (0.0, 0.0)
        # Who prints the epoch's line: `app.run.coordinator.RunCoordinator` sets itself here in a ddp-app fit (after
        # every rank has reduced the epoch's values); None: this bar, in its on_train_epoch_end.
        self.epoch_lines_by: Any = None

    def disable(self) -> None:
        self._enabled = False
        self._next_line_at = math.inf

    def enable(self) -> None:
        self._enabled = True

    def _restart(self) -> None:
        self._clock.reset()
        self._at_previous_line = (0.0, 0.0)
        self._next_line_at = time.monotonic() + self.interval_s if self._enabled else math.inf

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._restart()  # a resume in the middle of an epoch starts without on_train_epoch_start

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._restart()

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._clock.batch_start()

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._clock.batch_end(batch_size_of(batch) * trainer.world_size)
        if time.monotonic() >= self._next_line_at:
            samples, seconds = self._clock.totals()
            before_samples, before_seconds = self._at_previous_line
            self._print_line(trainer, pl_module, samples_per_s(samples - before_samples, seconds - before_seconds))

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._clock.pause()

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # In a Trainer without ddp-app's coordinator (a plain Lightning one), as Lightning's own bars do.
        if self.epoch_lines_by is None:
            self.print_epoch_line(trainer, pl_module)

    def print_epoch_line(
        self, trainer: L.Trainer, pl_module: L.LightningModule, epoch_samples_per_s: float | None = None
    ) -> None:
        """The epoch's line, called by `RunCoordinator` at the epoch's end after every rank reduced the logged values,
        so reading them here reduces nothing. `epoch_samples_per_s`: the epoch's logged samples/s; None: this rank's own
        measure."""
        if self._enabled:
            if epoch_samples_per_s is None:
                epoch_samples_per_s = samples_per_s(*self._clock.totals())
            self._print_line(trainer, pl_module, epoch_samples_per_s)

    def _print_line(self, trainer: L.Trainer, pl_module: L.LightningModule, rate: float | None) -> None:
        batches = batches_done_this_epoch(trainer)
        # The epoch's batches; not `total_train_batches`, which with max_epochs=-1 is the steps left to max_steps as of
        # the moment it is read (`batch=20/5` at an epoch's end).
        total = trainer.num_training_batches
        fields = [f"epoch={trainer.current_epoch}", f"step={trainer.global_step}"]
        fields.append(f"batch={batches}/{total if math.isfinite(total) else '?'}")
        if rate is not None:
            fields.append(f"samples/s={rate:.0f}")
        for name, value in self.get_metrics(trainer, pl_module).items():
            if name != "v_num":
                fields.append(f"{name}={value:.4g}" if isinstance(value, float) else f"{name}={value}")
        print(" ".join(fields), flush=True)
        self._at_previous_line = self._clock.totals()
        self._next_line_at = time.monotonic() + self.interval_s


# The summary table's column and line of FLOPs counts (Lightning 2.6 `ModelSummary`).
FLOPS_COLUMN = "FLOPs"
TOTAL_FLOPS_LINE = "Total Flops"


class PlainModelSummary(ModelSummary):
    """Every run's model summary (max_depth=1): Lightning's plain table whatever is installed, without the all-zero
    FLOPs column and "Total Flops" line (no `example_input_array`) unless `DDP_APP_VERBOSE=1`. `summarize` is the hook
    for how the table is shown."""

    @staticmethod
    def summarize(
        summary_data: list[tuple[str, list[str]]],
        total_parameters: int,
        trainable_parameters: int,
        model_size: float,
        total_training_modes: dict[str, int],
        total_flops: int,
        **summarize_kwargs: Any,
    ) -> None:
        if total_flops or is_verbose(os.environ):
            ModelSummary.summarize(
                summary_data, total_parameters, trainable_parameters, model_size, total_training_modes,
                total_flops, **summarize_kwargs,
            )  # fmt: skip
            return
        columns = [column for column in summary_data if column[0] != FLOPS_COLUMN]
        table_logger = logging.getLogger(ModelSummary.__module__)
        table_logger.addFilter(_drop_total_flops_line)
        try:
            ModelSummary.summarize(
                columns, total_parameters, trainable_parameters, model_size, total_training_modes,
                total_flops, **summarize_kwargs,
            )  # fmt: skip
        finally:
            table_logger.removeFilter(_drop_total_flops_line)


def _drop_total_flops_line(record: logging.LogRecord) -> bool:
    """Lightning's table ends with the total FLOPs line; a filter may rewrite the record it passes."""
    lines = record.getMessage().splitlines()
    if lines and lines[-1].split() == ["0", *TOTAL_FLOPS_LINE.split()]:
        record.msg, record.args = "\n".join(lines[:-1]), ()
    return True
