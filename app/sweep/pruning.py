"""Optuna's pruner at epoch ends, in every rank of a search trial's run: rank 0 reports the metric and asks the pruner,
the verdict reaches every rank through `reduce_boolean_decision`, and a pruned trial stops like an early stop
(last.ckpt, exit 0, `pruned.json` for the worker)."""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L

from app.sweep.spec import SweepSpec
from app.sweep.study import open_study, trial_of

PRUNED_FILE = "pruned.json"


class OptunaPruning(L.Callback):
    """Added to a search trial's `ddp-app fit` by `python -m app.sweep` (not for configs).

    Args:
        sweep_dir: the sweep's directory (its sweep.json and study.journal).
        trial: the Optuna trial number this run is."""

    def __init__(self, sweep_dir: str, trial: int) -> None:
        self.sweep_dir = Path(sweep_dir)
        self.trial = trial
        self._spec = SweepSpec.load(self.sweep_dir)
        self._study = None

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        prune = False
        value = trainer.callback_metrics.get(self._spec.metric)
        if trainer.is_global_zero and value is not None:
            if self._study is None:
                self._study = open_study(self.sweep_dir, self._spec)
            trial = trial_of(self._study, self.sweep_dir, self.trial)
            trial.report(float(value), step=trainer.current_epoch)
            prune = trial.should_prune()
        prune = trainer.strategy.reduce_boolean_decision(prune, all=False)
        if prune:
            trainer.should_stop = True
            if trainer.is_global_zero:
                marker = {
                    "epoch": trainer.current_epoch,
                    self._spec.metric: float(value) if value is not None else None,
                }
                (Path(trainer.default_root_dir) / PRUNED_FILE).write_text(json.dumps(marker))
                print(f"app.sweep: trial {self.trial} pruned at epoch {trainer.current_epoch}", flush=True)
