"""Export: a plain PyTorch script that knows nothing of the project classifies digits like the model."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from sklearn.datasets import load_digits

from app.models import MLPClassifier
from tests.helpers.isolated import predict_in_isolation
from tests.helpers.run import REPO, run


@pytest.fixture(scope="module")
def last(digits_trained: Path) -> Path:
    """The default job, trained on 2 ranks for 3 epochs (the session's run); its last.ckpt."""
    return digits_trained / "checkpoints" / "last.ckpt"


@pytest.mark.distributed
def test_exported_model_classifies_like_the_trained_model(last: Path, tmp_path: Path) -> None:
    exported = run([sys.executable, "-m", "app.export", "--ckpt", str(last), "--out", str(tmp_path / "model.pt")])
    assert exported.returncode == 0, exported.stderr
    plain = run(
        [
            sys.executable,
            str(REPO / "examples" / "plain_pytorch_inference.py"),
            str(tmp_path / "model.pt"),
            str(tmp_path / "predictions.pt"),
        ],
        cwd=tmp_path,
    )
    assert plain.returncode == 0, plain.stderr
    plain_predictions = torch.load(tmp_path / "predictions.pt", weights_only=True)

    model = MLPClassifier.load_from_checkpoint(last, map_location="cpu", weights_only=True).eval()

    images, labels = load_digits(return_X_y=True)
    with torch.no_grad():
        model_predictions = model(torch.tensor(images / 16.0, dtype=torch.float32)).argmax(dim=1)
    assert torch.equal(plain_predictions, model_predictions)
    accuracy = float(plain.stdout.split()[1])
    assert accuracy == pytest.approx((model_predictions == torch.tensor(labels)).float().mean().item())
    assert accuracy > 0.9


@pytest.mark.distributed
def test_exported_program_of_the_digits_mlp_runs_without_the_project(last: Path, tmp_path: Path) -> None:
    # No --config: the model comes from the checkpoint's hyperparameters, the data from the
    # config.yaml that LightningCLI wrote into the run's log directory.
    out = tmp_path / "digits.pt2"
    exported = run(
        [sys.executable, "-m", "app.export", "--ckpt", str(last), "--out", str(out), "--format", "exported-program"]
    )
    assert exported.returncode == 0, exported.stderr
    assert "config.yaml" in exported.stdout, exported.stdout
    model = MLPClassifier.load_from_checkpoint(last, map_location="cpu", weights_only=True).eval()
    images = torch.tensor(load_digits(return_X_y=True)[0] / 16.0, dtype=torch.float32)
    with torch.no_grad():
        expected = model(images)
    predicted = predict_in_isolation(out, images, tmp_path / "plain")
    torch.testing.assert_close(predicted, expected, rtol=1e-5, atol=1e-6)
    assert torch.equal(predicted.argmax(dim=1), expected.argmax(dim=1))


def test_export_of_a_missing_checkpoint_is_one_line(tmp_path: Path) -> None:
    result = run(
        [sys.executable, "-m", "app.export", "--ckpt", str(tmp_path / "nope.ckpt"), "--out", str(tmp_path / "m.pt")]
    )
    assert result.returncode == 2
    assert "does not exist" in result.stderr and "Traceback" not in result.stderr
