"""`ddp-app --help` names every subcommand; validate / test / predict on a trained checkpoint, as a user runs them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from lightning.pytorch.cli import LightningCLI

from app.cli.entry import SUBCOMMANDS_HELP
from app.data import DigitsDataModule
from app.models import MLPClassifier
from tests.helpers.run import REPO, ddp_app

# Subcommands `ddp-app` takes besides LightningCLI's, each dispatched in app/__main__.py.
OWN_SUBCOMMANDS = ["resume-check", "diagnose"]


def test_help_names_every_subcommand_on_one_line_each() -> None:
    """Issue 42: `resume-check` was in docs/resume.md only. `ddp-app --help` lists LightningCLI's
    subcommands and ddp-app's own, one line each, and each listed one answers `--help` itself."""
    result = ddp_app("--help", timeout=180)
    assert result.returncode == 0, result.stderr[-2000:]
    assert SUBCOMMANDS_HELP in result.stdout
    listed = re.findall(r"^  ([a-z-]+)  +\S.*$", SUBCOMMANDS_HELP, re.MULTILINE)
    assert listed == [*LightningCLI.subcommands(), *OWN_SUBCOMMANDS], listed
    for subcommand in OWN_SUBCOMMANDS:
        assert f'["{subcommand}"]' in (REPO / "app" / "__main__.py").read_text()
        own = ddp_app(subcommand, "--help", timeout=180)
        assert own.returncode == 0 and own.stdout.startswith(f"usage: ddp-app {subcommand}"), own.stdout + own.stderr


@pytest.fixture(scope="module")
def trained(digits_trained: Path) -> Path:
    """The session's digits run's last.ckpt (read only)."""
    return digits_trained / "checkpoints" / "last.ckpt"


@pytest.mark.distributed
@pytest.mark.parametrize("subcommand", ["validate", "test"])
def test_evaluation_subcommands_report_accuracy(trained: Path, subcommand: str, tmp_path: Path) -> None:
    result = ddp_app(
        subcommand,
        "--config",
        "configs/digits.yaml",
        f"--ckpt_path={trained}",
        f"--trainer.default_root_dir={tmp_path}",
        "--trainer.enable_progress_bar=false",
        timeout=180,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    metric = "val_acc" if subcommand == "validate" else "test_acc"
    assert metric in result.stdout
    # Its logs go beside the training run's, not among its attempts in lightning_logs/ (issue 56).
    assert (tmp_path / "evaluations" / subcommand / "version_0" / "metrics.csv").is_file()
    assert not (tmp_path / "lightning_logs").exists()


@pytest.mark.distributed
def test_predict_writes_the_same_predictions_at_any_world_size(trained: Path, tmp_path: Path) -> None:
    outputs = {}
    for devices in (1, 2):
        root = tmp_path / f"devices{devices}"
        result = ddp_app(
            "predict",
            "--config",
            "configs/digits.yaml",
            f"--ckpt_path={trained}",
            f"--trainer.devices={devices}",
            f"--trainer.default_root_dir={root}",
            "--trainer.enable_progress_bar=false",
            timeout=180,
        )
        assert result.returncode == 0, result.stderr[-2000:]
        outputs[devices] = torch.load(root / "predictions.pt", weights_only=True)
        assert not list(root.glob(".predictions-rank*.pt"))
    assert torch.equal(outputs[1]["predictions"], outputs[2]["predictions"])
    data = DigitsDataModule()
    data.setup("predict")
    assert outputs[2]["indices"].tolist() == list(range(len(data.test_dataset)))
    model = MLPClassifier.load_from_checkpoint(trained, map_location="cpu", weights_only=True).eval()
    with torch.no_grad():
        expected = model(data.test_dataset.tensors[0]).argmax(dim=1)
    assert torch.equal(outputs[2]["predictions"], expected)
