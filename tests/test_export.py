"""`python -m app.export` on a user's LightningModule without a `net` attribute, in both formats."""

from __future__ import annotations

import sys
from pathlib import Path

import lightning as L
import pytest
import torch

from app.export import main
from tests.helpers.isolated import predict_in_isolation
from tests.helpers.run import run
from tests.helpers.user_module import SeededRegressionData, TwoLayerRegressor

USER_CONFIG = """\
model:
  class_path: tests.helpers.user_module.TwoLayerRegressor
  init_args: {in_features: 6, hidden: 16}
data:
  class_path: tests.helpers.user_module.SeededRegressionData
  init_args: {in_features: 6, batch_size: 8}
"""


@pytest.fixture(scope="module")
def user_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A user's module trained for one epoch by a plain Trainer (no LightningCLI, no config.yaml)."""
    root = tmp_path_factory.mktemp("user")
    L.seed_everything(3)
    model = TwoLayerRegressor()
    trainer = L.Trainer(
        devices=1, accelerator="cpu", max_epochs=1, default_root_dir=root, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(model, datamodule=SeededRegressionData())
    trainer.save_checkpoint(root / "last.ckpt")
    (root / "user.yaml").write_text(USER_CONFIG)
    return root / "last.ckpt"


def export(*args: str | Path) -> tuple[int, str, str]:
    """The command as a user runs it: a fresh process, from the repository root."""
    result = run([sys.executable, "-m", "app.export", *map(str, args)], timeout=120)
    return result.returncode, result.stdout, result.stderr


def export_in_process(capsys: pytest.CaptureFixture[str], *args: str | Path) -> tuple[int, str, str]:
    """The same `main`, without paying a fresh interpreter's imports (about 5 s on a 2-core VM)."""
    try:
        main([str(arg) for arg in args])
        code = 0
    except SystemExit as stopped:
        code = int(stopped.code or 0)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_state_dict_of_a_module_without_net_is_its_own_weights(
    user_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, stdout, stderr = export_in_process(capsys, "--ckpt", user_checkpoint, "--out", tmp_path / "model.pt")
    assert code == 0, stderr
    assert "4 tensors" in stdout
    state = torch.load(tmp_path / "model.pt", weights_only=True)
    assert sorted(state) == ["hidden.bias", "hidden.weight", "output.bias", "output.weight"]
    fresh = TwoLayerRegressor()
    fresh.load_state_dict(state)
    trained = torch.load(user_checkpoint, weights_only=True)["state_dict"]
    assert all(torch.equal(fresh.state_dict()[key], trained[key]) for key in trained)


@pytest.mark.parametrize("export_format", ["state-dict", "exported-program"])
def test_a_checkpoint_without_weights_is_one_line_and_exit_2(
    tmp_path: Path, export_format: str, capsys: pytest.CaptureFixture[str]
) -> None:
    torch.save({"epoch": 0, "global_step": 0, "state_dict": {}}, tmp_path / "empty.ckpt")
    code, stdout, stderr = export_in_process(
        capsys, "--ckpt", tmp_path / "empty.ckpt", "--out", tmp_path / "model.out", "--format", export_format
    )
    assert code == 2, stdout + stderr
    assert stderr.count("\n") == 1 and "holds no weights to export" in stderr, stderr
    assert not (tmp_path / "model.out").exists()


@pytest.mark.more_cases
def test_exported_program_runs_without_the_project_or_the_user_code(user_checkpoint: Path, tmp_path: Path) -> None:
    out = tmp_path / "model.pt2"
    config = user_checkpoint.parent / "user.yaml"
    code, stdout, stderr = export(
        "--ckpt", user_checkpoint, "--out", out, "--format", "exported-program", "--config", config
    )
    assert code == 0, stderr
    assert "dynamic batch" in stdout, stdout
    model = TwoLayerRegressor()
    model.load_state_dict(torch.load(user_checkpoint, weights_only=True)["state_dict"])
    model.eval()
    inputs = torch.randn(5, 6, generator=torch.Generator().manual_seed(1))  # not the traced batch size (2)
    with torch.no_grad():
        expected = model(inputs)
    predicted = predict_in_isolation(out, inputs, tmp_path / "plain")
    torch.testing.assert_close(predicted, expected, rtol=1e-6, atol=1e-7)


def test_exported_program_without_a_config_names_the_fix(
    user_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A plain Trainer stores no class path and writes no config.yaml: nothing says which class to build.
    code, stdout, stderr = export_in_process(
        capsys, "--ckpt", user_checkpoint, "--out", tmp_path / "model.pt2", "--format", "exported-program"
    )
    assert code == 2, stdout + stderr
    assert stderr.count("\n") == 1 and "pass --config" in stderr, stderr
