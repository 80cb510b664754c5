"""One line for bad input, the traceback for bugs, and DDP_APP_TRACEBACK=1 for the traceback anyway."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from app.cli.entry import report_user_error
from app.cluster.exit_codes import BAD_INPUT_EXIT_CODE, PEER_LOST_EXIT_CODE
from app.errors import InvalidConfigError, UserFacingError, failed_because_a_peer_died, one_line_message
from tests.helpers.run import clean_env, ddp_app

ONE_PROCESS = ["--trainer.devices=1", "--trainer.enable_progress_bar=false", "--trainer.max_epochs=1"]


def fit(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return ddp_app(
        "fit",
        "--config",
        "configs/digits.yaml",
        f"--trainer.default_root_dir={tmp_path}",
        *ONE_PROCESS,
        *args,
        timeout=180,
        env=clean_env(**env),
    )


def test_a_bug_in_a_users_model_keeps_its_traceback(tmp_path: Path) -> None:
    result = fit(tmp_path, "--model=tests.helpers.buggy_model.BuggyModule", "--optimizer=null", "--lr_scheduler=null")
    assert result.returncode != 0
    assert "Traceback" in result.stderr, result.stderr[-3000:]
    assert "compute_my_loss" in result.stderr and "ValueError: bug in my model" in result.stderr
    assert "ddp-app: error:" not in result.stderr


@pytest.mark.more_cases
def test_bad_input_is_one_line_and_ddp_app_traceback_shows_its_stack(tmp_path: Path) -> None:
    result = fit(tmp_path, "--data.init_args.num_workers=-1")
    assert result.returncode == 2
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert "ddp-app: error: data.num_workers must be >= 0" in result.stderr
    result = fit(tmp_path, "--data.init_args.num_workers=-1", DDP_APP_TRACEBACK="1")
    assert result.returncode == 2
    assert "Traceback" in result.stderr and "InvalidConfigError" in result.stderr, result.stderr[-3000:]
    assert "ddp-app: error: data.num_workers must be >= 0" in result.stderr


@pytest.mark.parametrize(
    ("error", "one_line"),
    [
        (ValueError("bug in my model"), False),
        (FileNotFoundError(2, "No such file", "my_lookup_table.csv"), False),
        (KeyError("x"), False),
        (InvalidConfigError("data.batch_size must be >= 1"), True),
        (UserFacingError("checkpoint x does not exist"), True),
        (RuntimeError("Error(s) in loading state_dict for Net:\n\tMissing key(s): 'w'"), True),
        (RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:1234"), True),
        (OSError(28, "No space left on device", "last.ckpt"), True),
    ],
)
def test_only_errors_we_raise_or_recognise_become_one_line(error: BaseException, one_line: bool) -> None:
    assert (one_line_message(error) is not None) == one_line


def test_a_rank_that_lost_a_peer_reports_it_in_one_line_but_not_as_bad_input(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Exit 2 means "do not run this again" (no restart, no Slurm requeue); a rank that stops because
    another died must not say that."""
    lost = RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:1234")
    assert failed_because_a_peer_died(lost) and not failed_because_a_peer_died(
        InvalidConfigError("data.batch_size must be >= 1")
    )
    assert report_user_error(lost) == PEER_LOST_EXIT_CODE != BAD_INPUT_EXIT_CODE
    assert "lost the connection to another rank" in capsys.readouterr().err
    assert report_user_error(InvalidConfigError("data.batch_size must be >= 1")) == BAD_INPUT_EXIT_CODE
    assert report_user_error(ValueError("bug in my model")) is None  # a bug keeps its traceback
