"""A test-only callback: every rank writes what its process environment holds as training starts."""

from __future__ import annotations

import json
import os
from pathlib import Path

import lightning as L


class RecordEnvironment(L.Callback):
    """Writes `<dirpath>/rank<global rank>.json`: the value of each of `names` (null when unset)."""

    def __init__(self, dirpath: str, names: list[str]) -> None:
        self.dirpath = Path(dirpath)
        self.names = names

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.dirpath.mkdir(parents=True, exist_ok=True)
        values = {name: os.environ.get(name) for name in self.names}
        (self.dirpath / f"rank{trainer.global_rank}.json").write_text(json.dumps(values))
