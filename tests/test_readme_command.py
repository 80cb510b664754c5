"""The README's training command, run as a user would: 2 DDP processes on the digits."""

from __future__ import annotations

import csv
import re
from pathlib import Path

import pytest
import torch

from app.models import MLPClassifier
from tests.helpers.run import REPO, ddp_app

pytestmark = pytest.mark.distributed


def test_readme_documents_the_commands() -> None:
    readme = (REPO / "README.md").read_text()
    assert "./quickstart.sh train" in readme
    assert "./quickstart.sh test" in readme
    quickstart = (REPO / "quickstart.sh").read_text()
    assert 'ddp-app" fit --config configs/digits.yaml' in quickstart


@pytest.mark.quick
def test_default_job_trains_with_two_processes(tmp_path: Path) -> None:
    result = ddp_app("fit", "--config", "configs/digits.yaml", f"--trainer.default_root_dir={tmp_path}", timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    output = result.stdout + result.stderr
    # Rank 0 says once that both ranks met (each rank's own "MEMBER: r/2" line is kept quiet).
    assert "All distributed processes registered. Starting with 2 processes" in output
    assert "distributed_backend=gloo" not in output  # Lightning's banner is off the console (app/run/console.py)
    # The run ends with its summary: how it went, where the checkpoints and logs are.
    summary = output[output.index("ddp-app: fit done in") :]
    assert "15 epochs, 300 steps on 2 processes" in summary and "best val_acc=" in summary
    assert f"last checkpoint: {tmp_path / 'checkpoints' / 'last.ckpt'}" in summary

    last = list(tmp_path.rglob("last.ckpt"))
    assert len(last) == 1, last
    assert len(list(tmp_path.rglob("best-*.ckpt"))) == 1

    assert last[0].parent == tmp_path / "checkpoints"
    (metrics,) = tmp_path.rglob("metrics.csv")
    rows = list(csv.DictReader(metrics.open()))
    val_acc = [float(row["val_acc"]) for row in rows if row.get("val_acc")]
    assert val_acc[-1] >= 0.90, val_acc

    model = MLPClassifier.load_from_checkpoint(last[0], map_location="cpu", weights_only=True)
    assert isinstance(model.net.fc1, torch.nn.Linear)
    # The checkpoint holds the final weights: 15 epochs x 20 steps.
    checkpoint = torch.load(last[0], map_location="cpu", weights_only=True)
    assert checkpoint["global_step"] == 15 * 20
    assert re.search(r"val_acc=0\.9\d+", result.stdout + result.stderr)
