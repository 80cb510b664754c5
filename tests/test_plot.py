"""`python -m app.plot`: versions of a resumed run joined into one curve, drawn into one PNG."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from app.plot import join_versions, main, read_metrics
from tests.helpers.run import run, train

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
HEADER = "epoch,step,train_loss,val_acc,val_loss\n"


def write_version(run_dir: Path, name: str, rows: str) -> Path:
    path = run_dir / "lightning_logs" / name / "metrics.csv"
    path.parent.mkdir(parents=True)
    path.write_text(HEADER + rows)
    return path


def test_rows_of_one_step_merge_and_versions_join_with_the_later_winning_overlaps(tmp_path: Path) -> None:
    # version_0 ran to step 39; it crashed after its last checkpoint at step 20, and the resume
    # (version_1) redid steps 20..39 and went on. version_10 sorts after version_1, not before.
    first = write_version(tmp_path, "version_0", "0,9,2.0,,\n0,19,1.5,,\n0,19,,0.8,1.4\n1,29,1.0,,\n1,39,0.9,,\n")
    second = write_version(tmp_path, "version_1", "1,29,0.95,,\n1,39,0.85,0.9,0.7\n2,49,0.6,,\n")
    third = write_version(tmp_path, "version_10", "2,49,0.5,,\n2,59,0.4,0.95,0.5\n")
    assert read_metrics(first)[19] == {"epoch": 0.0, "train_loss": 1.5, "val_acc": 0.8, "val_loss": 1.4}
    joined = join_versions([read_metrics(path) for path in (third, first, second)])
    assert list(joined) == [9, 19, 29, 39, 49, 59]
    assert [joined[step]["train_loss"] for step in joined] == [2.0, 1.5, 0.95, 0.85, 0.5, 0.4]
    assert joined[39]["val_acc"] == 0.9


def test_versions_starting_at_the_same_step_keep_the_later_version(tmp_path: Path) -> None:
    # A fresh run into the same directory: the newer version replaces the older one entirely.
    old = write_version(tmp_path, "version_0", "0,9,2.0,,\n0,19,1.5,,\n0,29,1.2,,\n")
    new = write_version(tmp_path, "version_1", "0,9,1.9,,\n0,19,1.4,,\n")
    joined = join_versions([read_metrics(old), read_metrics(new)])
    assert {step: values["train_loss"] for step, values in joined.items()} == {9: 1.9, 19: 1.4}


@pytest.mark.parametrize("make", ["missing", "empty"])
def test_nothing_to_plot_is_one_line_and_exit_2(tmp_path: Path, make: str, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = tmp_path / "run" if make == "missing" else tmp_path
    with pytest.raises(SystemExit) as stopped:
        main([str(run_dir)])
    assert stopped.value.code == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and error.startswith("app.plot: error:") and "Fix:" in error, error


@pytest.mark.distributed
def test_plot_of_a_resumed_two_rank_run_reads_its_one_log_version(tmp_path: Path) -> None:
    train("configs/digits.yaml", tmp_path, 1)
    train("configs/digits.yaml", tmp_path, 2, "--ckpt_path=last")
    files = sorted(tmp_path.rglob("metrics.csv"))
    assert [path.parent.name for path in files] == ["version_0"]  # the resume continued the run's version
    result = run([sys.executable, "-m", "app.plot", str(tmp_path), "--out", str(tmp_path / "curves.png")])
    assert result.returncode == 0, result.stderr
    assert "from version_0 (csv)" in result.stdout, result.stdout
    steps = list(read_metrics(files[0]))
    assert steps == sorted(set(steps)) and steps[-1] == 2 * 20 - 1
    png = (tmp_path / "curves.png").read_bytes()
    assert png.startswith(PNG_MAGIC) and len(png) > 20_000
