"""A test-only callback: every rank prints a timestamped line when it enters a phase of `fit`, and
phases can be slowed down, so that a signal sent when a test reads the line lands inside the phase.

    phase rank=1 t=1718000000.123456 save step=20

The slowdowns stand for what a real job spends there (a large model's checkpoint takes minutes to
write, a validation set minutes to run); they change no number that training computes.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import lightning as L

PHASE_LINE_PREFIX = "phase rank="


class PhaseMarker(L.Callback):
    """Prints `phase rank=R t=T NAME step=S` on entering each phase; sleeps in the slowed ones.

    Args:
        setup_s: sleep in the `setup` hook (a DataModule that prepares its data; the process group is up).
        train_step_s: sleep before every training batch.
        validation_step_s: sleep before every validation batch (the sanity check's too).
        save_s: sleep while a checkpoint is being made (in `on_save_checkpoint`, on every rank).
    """

    def __init__(
        self, setup_s: float = 0.0, train_step_s: float = 0.0, validation_step_s: float = 0.0, save_s: float = 0.0
    ) -> None:
        self.setup_s = setup_s
        self.train_step_s = train_step_s
        self.validation_step_s = validation_step_s
        self.save_s = save_s

    def _mark(self, trainer: L.Trainer, name: str) -> None:
        # One write per line: two ranks write to the same file, unbuffered under the tests.
        line = f"{PHASE_LINE_PREFIX}{trainer.global_rank} t={time.time():.6f} {name} step={trainer.global_step}\n"
        sys.stdout.write(line)
        sys.stdout.flush()

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._mark(trainer, "setup")
        time.sleep(self.setup_s)

    def on_sanity_check_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._mark(trainer, "sanity_check")

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._mark(trainer, "train_start")

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._mark(trainer, "train")
        time.sleep(self.train_step_s)

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking:
            self._mark(trainer, "validation")

    def on_validation_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        time.sleep(self.validation_step_s)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking:
            self._mark(trainer, "validation_end")

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        self._mark(trainer, "save")
        time.sleep(self.save_s)
        self._mark(trainer, "save_end")

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._mark(trainer, "train_end")

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._mark(trainer, "teardown")
