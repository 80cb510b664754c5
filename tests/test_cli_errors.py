"""Bad command-line input: non-zero exit, one line that names the key, no traceback."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.cli import DDPAppCLI
from app.errors import UserFacingError
from tests.helpers.run import REPO, ddp_app


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("--trainer.max_epochs=oops", "trainer.max_epochs"),
        pytest.param("--model.init_args.hidden=wide", "model.init_args.hidden", marks=pytest.mark.more_cases),
        pytest.param("--trainer.no_such_key=1", "trainer.no_such_key", marks=pytest.mark.more_cases),
        pytest.param("--data.init_args.batch_size=0", "data.batch_size", marks=pytest.mark.more_cases),
    ],
)
def test_bad_override_names_the_key(override: str, named: str, tmp_path: Path) -> None:
    # A run directory of its own: after ./quickstart.sh train, runs/digits holds a run (issue 42).
    result = ddp_app(
        "fit", "--config", "configs/digits.yaml", override, f"--trainer.default_root_dir={tmp_path}", timeout=120
    )
    assert result.returncode != 0
    assert named in result.stderr
    assert "Traceback" not in result.stderr
    error_lines = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(error_lines) == 1, result.stderr


@pytest.mark.more_cases
def test_print_config_shows_the_resolved_config() -> None:
    result = ddp_app("fit", "--config", "configs/digits.yaml", "--trainer.max_epochs=3", "--print_config", timeout=120)
    assert result.returncode == 0, result.stderr
    assert "max_epochs: 3" in result.stdout
    assert "app.models.MLPClassifier" in result.stdout


@pytest.mark.more_cases
def test_an_object_store_url_is_refused_before_any_rank_starts(tmp_path: Path) -> None:
    result = ddp_app(
        "fit", "--config", str(REPO / "configs" / "digits.yaml"), "--trainer.default_root_dir=s3://bucket/runs",
        timeout=120, cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("ddp-app: error: trainer.default_root_dir=s3://bucket/runs is a URL"), result.stderr
    assert "NFS" in result.stderr and len(result.stderr.splitlines()) == 1, result.stderr
    assert "ddp-app: launched" not in result.stdout
    assert not list(tmp_path.iterdir()), "nothing may be written (no local directory named 's3:')"


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("--ckpt_path=gs://bucket/last.ckpt", "ckpt_path=gs://bucket/last.ckpt is a URL ddp-app does not read"),
        (
            "--trainer.callbacks+=ModelCheckpoint --trainer.callbacks.dirpath=s3://bucket/ckpts",
            "trainer.callbacks[1].init_args.dirpath=s3://bucket/ckpts is a URL",
        ),
    ],
)
def test_every_checkpoint_path_key_refuses_an_object_store_url(override: str, named: str, tmp_path: Path) -> None:
    args = ["fit", "--config", str(REPO / "configs" / "digits.yaml"), f"--trainer.default_root_dir={tmp_path}"]
    with pytest.raises(UserFacingError) as refused:
        DDPAppCLI(args=[*args, *override.split()], parse_only=True)
    assert str(refused.value).startswith(named) and "Fix:" in str(refused.value), refused.value


@pytest.mark.parametrize("nested", [False, True])
def test_a_yaml_syntax_error_names_the_file_and_the_line(
    nested: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """YAML's own error names "<unicode string>": the line names the config file instead (through
    jsonargparse's private `config_load_stack`, app/errors.py `_config_file_being_read`), also when
    the broken file is the second of two --config files."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "broken.yaml").write_text("trainer:\n  max_epochs: 3\n  devices: [2\n  logger: false\n")
    configs = ["--config", str(REPO / "configs" / "digits.yaml")] if nested else []
    with pytest.raises(SystemExit) as refused:
        DDPAppCLI(args=["fit", *configs, "--config", "broken.yaml", f"--trainer.default_root_dir={tmp_path}"])
    assert refused.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1, errors
    assert "broken.yaml is not valid YAML: line 3, column 12: while parsing a flow sequence" in errors[0], errors[0]
    assert "Fix: correct the YAML syntax at line 4 of broken.yaml" in errors[0], errors[0]


def test_a_missing_config_file_is_one_line_with_its_fix(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 56: jsonargparse's `Parser key "config": File does not exist` had no Fix."""
    from app.cli.entry import check_before_launch

    missing = tmp_path / "no_such.yaml"
    with pytest.raises(SystemExit) as exited:
        check_before_launch(["fit", "--config", str(missing)])
    assert exited.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(missing) in err and "Fix:" in err, err
