"""A user's own classes: `class_path` resolves from where they run, and a bad one fails in one line."""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from app.cli import DDPAppCLI
from app.user_code import add_user_code_directories
from tests.helpers.run import REPO, clean_env, ddp_app


@pytest.fixture
def saved_sys_path() -> Iterator[None]:
    saved = list(sys.path)
    yield
    sys.path[:] = saved


def test_current_directory_then_config_directories_come_first(saved_sys_path, tmp_path: Path, monkeypatch) -> None:
    config = tmp_path / "elsewhere" / "config.yaml"
    config.parent.mkdir()
    config.write_text("{}")
    monkeypatch.chdir(tmp_path)
    sys.path.insert(0, "")
    added = add_user_code_directories(["fit", "--config", str(config), "-c=inline: yaml", "--config", str(config)])
    assert added == [str(tmp_path), str(config.parent)]
    assert sys.path[:2] == added
    assert "" not in sys.path and sys.path.count(str(tmp_path)) == 1


def test_a_copied_example_resolves_from_its_directory_without_pythonpath(tmp_path: Path) -> None:
    for name in ("mymodels.py", "config.yaml"):
        shutil.copy(REPO / "examples" / "custom" / name, tmp_path / name)
    env = clean_env()
    assert str(tmp_path) not in env.get("PYTHONPATH", "")
    result = ddp_app("fit", "--config", "config.yaml", "--print_config", cwd=tmp_path, env=env, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "class_path: mymodels.MyNet" in result.stdout


def parse_error(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    with pytest.raises(SystemExit) as exit_info:
        DDPAppCLI(args=["fit", "--config", str(REPO / "configs" / "digits.yaml"), *args])
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        (
            ["--model", "app.models.MLPClasifier"],
            "app.models has no class MLPClasifier. Did you mean app.models.MLPClassifier?",
        ),
        (["--model", "app.model.MLPClassifier"], "app has no module model. Did you mean app.models.MLPClassifier?"),
        (["--model", "MLPClasifier"], "Did you mean app.models.MLPClassifier?"),
        (
            ["--model", "theirmodels.MyNet"],
            "cannot import theirmodels.MyNet: no module named 'theirmodels' (looked in ",
        ),
        (["--data", "torch.utils.data.TensorDataset"], "torch.utils.data.TensorDataset is not a LightningDataModule"),
        (["--model", "torch.nn.Linear"], "torch.nn.Linear is not a LightningModule"),
    ],
    ids=["class-typo", "module-typo", "no-module", "missing-module", "dataset-as-data", "module-as-model"],
)
def test_a_bad_class_path_says_what_is_wrong(
    saved_sys_path, capsys: pytest.CaptureFixture[str], override: list[str], expected: str
) -> None:
    line = parse_error(capsys, *override)
    assert expected in line, line
    if "looked in" in line:
        assert os.getcwd() in line and str(REPO / "configs") in line


@pytest.mark.more_cases
def test_the_issue_command_exits_2_and_suggests_the_class(tmp_path: Path) -> None:
    result = ddp_app(
        "fit", "--config", "configs/digits.yaml", "--model", "app.models.MLPClasifier",
        f"--trainer.default_root_dir={tmp_path}", timeout=120,
    )  # fmt: skip
    assert result.returncode == 2
    (line,) = [line for line in result.stderr.splitlines() if "error:" in line]
    assert "MLPClassifier" in line and "Traceback" not in result.stderr
