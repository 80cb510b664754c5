"""`python -m app.plot`: versions of a resumed run joined into one curve, drawn into one PNG with a
panel per kind and scale of quantity, the epochs named as the console names them."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from app.plot import join_versions, main, read_metrics
from app.tracking.history import Call
from app.tracking.sinks import CsvView
from tests.helpers.plots import drawn_panels, names_by_panel
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


def plot_of(run_dir: Path, out: Path, *args: str) -> list[dict]:
    main([str(run_dir), "--out", str(out), *args])
    return drawn_panels(out)


@pytest.mark.distributed
def test_the_default_jobs_curves_put_losses_accuracies_and_throughput_on_panels_of_their_own(
    digits_trained: Path, tmp_path: Path
) -> None:
    panels = plot_of(digits_trained, tmp_path / "curves.png")
    assert names_by_panel(panels) == [{"train_loss", "val_loss"}, {"train_acc", "val_acc"}, {"samples_per_s"}]
    assert [panel["ylabel"] for panel in panels] == ["losses", "metrics in [0, 1]", "throughput (per second)"]
    accuracies = panels[1]
    assert accuracies["ylim"][0] >= 0.0 and accuracies["ylim"][1] <= 1.05
    # The console says "Epoch 0" to "Epoch 2": the top axis names the same epochs, each inside the x range.
    (epochs,) = panels[0]["top_axes"]
    assert epochs["tick_labels"] == ["0", "1", "2"], epochs
    assert all(panels[0]["xlim"][0] < tick < panels[0]["xlim"][1] for tick in epochs["ticks"])
    logged = {int(values["epoch"]) for values in read_metrics(next(digits_trained.rglob("metrics.csv"))).values()}
    assert logged == {0, 1, 2}


def test_each_kind_and_scale_of_metric_gets_a_readable_panel(tmp_path: Path) -> None:
    # A metrics.csv written by the app's own writer: a loss, [0, 1] metrics, two throughputs 100x apart,
    # a learning-rate monitor, an accuracy in percent and two other quantities 1000x apart.
    log_dir = tmp_path / "lightning_logs" / "version_0"
    log_dir.mkdir(parents=True)
    calls = []
    for step in range(9, 200, 10):
        epoch = step // 20
        values = {"epoch": float(epoch), "train_loss": 2.0 / (1 + step / 5), "lr-Adam": 0.002 / (1 + epoch // 5)}
        if step % 20 == 19:
            values |= {"val_acc": 0.6 + 0.035 * epoch, "val_f1": 0.5 + 0.04 * epoch, "val_percent": 60.0 + 3.5 * epoch}
            values |= {"samples_per_s": 9000.0 + 700 * (epoch % 3), "tokens_per_s": 1.2e6 - 5e4 * (epoch % 4)}
            values |= {"grad_norm": 5.0 - 0.3 * epoch, "parameters_mb": 2000.0 + epoch}
        calls.append(Call(len(calls), step, time.time(), values))
    CsvView(log_dir).rewrite(calls)
    panels = plot_of(tmp_path, tmp_path / "curves.png")
    assert names_by_panel(panels) == [
        {"train_loss"},
        {"val_acc", "val_f1"},
        {"samples_per_s"},
        {"tokens_per_s"},
        {"lr-Adam"},
        {"grad_norm"},
        {"parameters_mb"},
        {"val_percent"},
    ]
    assert [panel["yscale"] for panel in panels][:2] == ["log", "linear"]
    assert panels[0]["top_axes"][0]["tick_labels"][:2] == ["0", "1"]


@pytest.mark.distributed
def test_the_mlflow_history_draws_the_same_panels_as_the_csv(digits_trained: Path, tmp_path: Path) -> None:
    from app.tracking.sinks import MlflowSink

    run_dir = tmp_path / "run"
    log_dir = run_dir / "lightning_logs" / "version_0"
    log_dir.mkdir(parents=True)
    sink = MlflowSink(f"sqlite:///{tmp_path / 'mlflow.db'}", "plots", None)
    run_id = sink.open_run(None, "digits")
    logged = read_metrics(next(digits_trained.rglob("metrics.csv")))
    sink.send([Call(seq, step, time.time(), values) for seq, (step, values) in enumerate(logged.items())])
    identity = {"run_id": "r", "log_version": "version_0", "created": "2026-11-27T00:00:00+00:00"}
    identity["mlflow"] = {"tracking_uri": sink.tracking_uri, "run_id": run_id}
    (log_dir / "run.json").write_text(json.dumps(identity))
    from_mlflow = plot_of(run_dir, tmp_path / "mlflow.png", "--source", "mlflow")
    from_csv = plot_of(digits_trained, tmp_path / "csv.png")
    assert names_by_panel(from_mlflow) == names_by_panel(from_csv)
    assert from_mlflow[0]["top_axes"] == from_csv[0]["top_axes"]
