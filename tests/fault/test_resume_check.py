"""`ddp-app resume-check` as a user runs it: EXACT on code that resumes exactly, DIFFERS with the cause
named on code that cannot (a dataset drawing from a generator of its own)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from app.cli.resume_check import CHECK_CASES, STATE_OUTSIDE, check_runner, format_table, likely_cause
from tests.helpers.run import ddp_app, run_logged

pytestmark = [pytest.mark.fault, pytest.mark.distributed]

TIMEOUT_S = 600


def resume_check(tmp_path: Path, *args: str) -> tuple[int, str, dict]:
    report = tmp_path / "report.json"
    result = ddp_app("resume-check", *args, "--json", str(report), timeout=TIMEOUT_S)
    output = result.stdout + result.stderr
    assert report.exists(), output[-3000:]
    return result.returncode, output, json.loads(report.read_text())


def test_a_users_own_module_resumes_exactly_at_every_moment(tmp_path: Path) -> None:
    """examples/custom: a model and DataModule from outside app/, with a ModelCheckpoint of its own,
    at every moment `ddp-app resume-check` checks, through the command's own harness (its fits forked
    from the tests' zygote); the command itself, its exit code and report, is the next test."""
    runner = check_runner(["--config", "examples/custom/config.yaml"], tmp_path, run_command=run_logged)
    outcomes = [runner.run(case) for case in CHECK_CASES]
    assert len(outcomes) == 4 and all(outcome.exact for outcome in outcomes), format_table(outcomes)
    assert all(outcome.weights_diff == 0 and outcome.optimizer_diff == 0 for outcome in outcomes)


def test_a_dataset_with_a_private_generator_differs_and_the_cause_is_named(tmp_path: Path) -> None:
    """An unseeded numpy.random.default_rng() created at import: no seeding can reach it. `--fail-fast`
    ends at the first moment that differs (here the first: one stopped run instead of four)."""
    code, output, report = resume_check(
        tmp_path, "--config", "tests/helpers/augmenting.yaml", "--data.init_args.private=true", "--fail-fast"
    )
    assert code == 1, output[-3000:]
    assert not report["exact"] and [case["result"] for case in report["cases"]] == ["DIFFERS"], report
    assert "generator of its own" in report["cause"] and "numpy.random.default_rng()" in report["cause"]
    assert "most likely cause: randomness drawn outside the seeded paths" in output


def test_the_cause_named_for_data_read_as_whole_tensors_is_state_outside_the_checkpoint(tmp_path: Path) -> None:
    """configs/digits.yaml's training loader cuts batches from whole tensors (no dataset to read twice):
    the cause is not the data's, and naming it must not fail (it once raised a TypeError)."""
    assert likely_cause(["--config", "configs/digits.yaml", f"--trainer.default_root_dir={tmp_path}"]) == STATE_OUTSIDE


@pytest.mark.slow
def test_digits_resumes_exactly_at_every_moment(tmp_path: Path) -> None:
    code, output, report = resume_check(tmp_path, "--config", "configs/digits.yaml")
    assert code == 0 and report["exact"], output[-3000:]
