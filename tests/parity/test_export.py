"""Export: a plain PyTorch script that knows nothing of the project classifies digits like the model."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from sklearn.datasets import load_digits

from app.models import MLPClassifier
from tests.helpers.run import REPO, run, train


@pytest.mark.distributed
def test_exported_model_classifies_like_the_trained_model(tmp_path: Path) -> None:
    last = train("configs/digits.yaml", tmp_path, epochs=5)
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


def test_export_of_a_missing_checkpoint_is_one_line(tmp_path: Path) -> None:
    result = run(
        [sys.executable, "-m", "app.export", "--ckpt", str(tmp_path / "nope.ckpt"), "--out", str(tmp_path / "m.pt")]
    )
    assert result.returncode == 2
    assert "does not exist" in result.stderr and "Traceback" not in result.stderr
