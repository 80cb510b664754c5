"""The Lightning side of the bench's timing: a Callback around `StepRecorder`."""

from __future__ import annotations

from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer

from app.bench.recorder import StepRecorder


class BenchTimer(Callback):
    """The Lightning side's recorder; the bench adds it to `trainer.callbacks` in its config copy."""

    def __init__(self) -> None:
        self.recorder: StepRecorder | None = None

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self.recorder = StepRecorder.from_env("lightning", trainer.global_rank, trainer.world_size)

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self.recorder is not None:
            self.recorder.step_start(trainer.current_epoch)

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.recorder is not None:
            self.recorder.step_end()

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.recorder is not None:
            self.recorder.finish(trainer.strategy.root_device)
