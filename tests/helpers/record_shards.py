"""Run Lightning DDP over the digits and record which training samples each rank sees per epoch.

Usage: python -m tests.helpers.record_shards OUT_DIR [--no-shuffle]
Writes OUT_DIR/rank{R}.json: {"epoch0": [indices...], "epoch1": [...]}.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import Dataset

from app.cluster.threads import configure_cpu_threads
from app.data import DigitsDataModule
from app.models import MLPClassifier


class WithIndex(Dataset):
    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, index: int):
        inputs, target = self.dataset[index]
        return inputs, target, index


class IndexedDigits(DigitsDataModule):
    def make_splits(self):
        train, val, test = super().make_splits()
        return WithIndex(train), val, test


class RecordingClassifier(MLPClassifier):
    def __init__(self) -> None:
        super().__init__()
        self.seen: dict[str, list[int]] = {}

    def training_step(self, batch, batch_idx):
        inputs, targets, indices = batch
        self.seen.setdefault(f"epoch{self.current_epoch}", []).extend(indices.tolist())
        return super().training_step((inputs, targets), batch_idx)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def main() -> None:
    out_dir = Path(sys.argv[1])
    shuffle = "--no-shuffle" not in sys.argv
    configure_cpu_threads()
    L.seed_everything(0)
    model = RecordingClassifier()
    trainer = L.Trainer(
        accelerator="cpu",
        strategy="ddp",
        devices=2,
        max_epochs=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        limit_val_batches=0,
    )
    trainer.fit(model, datamodule=IndexedDigits(batch_size=16, shuffle=shuffle, seed=7))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"rank{trainer.global_rank}.json").write_text(json.dumps(model.seen))
    # As the DDP tutorials do: Lightning leaves the process group up, and a gloo thread still running
    # at interpreter exit was seen to abort the process ("terminate called without an active exception").
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
