"""`python -m app.sweep` on this machine: a grid and an Optuna search on digits, a sweep stopped
with Ctrl-C and resumed (the stopped point continues from its checkpoint to an uninterrupted run's
weights), and bad specs refused in one line before anything is written."""

from __future__ import annotations

import csv
import json
import logging
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from app.checkpoints.io import safe_load
from app.sweep.__main__ import default_directory, main, parse
from app.sweep.spec import SweepError, build_spec
from tests.helpers.run import REPO, clean_env, ddp_app, kill_job, run

CONFIG = str(REPO / "configs" / "digits.yaml")
ONE_RANK = ["--trainer.devices=1", "--trainer.max_epochs=2", "--trainer.enable_progress_bar=false"]


def sweep(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return run([sys.executable, "-m", "app.sweep", *args], timeout=timeout)


def results(directory: Path) -> list[dict[str, str]]:
    with (directory / "results.csv").open() as file:
        return list(csv.DictReader(file))


def weights(run_dir: Path) -> dict:
    return safe_load(run_dir / "checkpoints" / "last.ckpt")["state_dict"]


def assert_same_weights(expected: dict, actual: dict) -> None:
    assert expected.keys() == actual.keys()
    assert all(expected[name].equal(actual[name]) for name in expected)


@pytest.mark.distributed
@pytest.mark.slow  # about 60 s; the default run has optuna in the pruning test and a sweep in the grid test
def test_an_optuna_search_records_every_trial_in_its_journal_study(tmp_path: Path) -> None:
    import optuna

    out = tmp_path / "search"
    result = sweep("run", "--config", CONFIG, "--out", str(out), "--search",
                   "optimizer.init_args.lr=loguniform:1e-4:1e-1", "--trials", "3", *ONE_RANK)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:] + result.stdout[-2000:]
    rows = results(out)
    lrs = [float(row["optimizer.init_args.lr"]) for row in rows]
    assert len(set(lrs)) == 3 and all(1e-4 <= lr <= 1e-1 for lr in lrs), lrs
    study = optuna.load_study(study_name="sweep", storage=optuna.storages.JournalStorage(
        optuna.storages.journal.JournalFileBackend(str(out / "study.journal"))))  # fmt: skip
    assert [trial.state.name for trial in study.trials] == ["COMPLETE"] * 3
    assert [trial.params["optimizer.init_args.lr"] for trial in study.trials] == lrs
    for trial, row in zip(study.trials, rows, strict=True):
        assert math.isclose(trial.value, float(row["best val_acc"]), rel_tol=1e-5)
    assert (out / "results.png").stat().st_size > 10_000


@pytest.mark.distributed
@pytest.mark.fault
def test_a_grid_runs_every_point_as_an_ordinary_fit_and_resumes_one_stopped_with_ctrl_c(tmp_path: Path) -> None:
    """One grid sweep, stopped with Ctrl-C after point 000's first checkpoint and resumed: every point
    done, its results table and plot written, and the stopped point continued from its checkpoint to the
    weights of `ddp-app fit` run alone with its values (a point is an ordinary fit)."""
    out = tmp_path / "grid"
    # 6 epochs: point 000 is still training when its first epoch-end checkpoint appears.
    args = ["--trainer.devices=1", "--trainer.max_epochs=6", "--trainer.enable_progress_bar=false"]
    command = [sys.executable, "-m", "app.sweep", "run", "--config", CONFIG, "--out", str(out),
               "--grid", "optimizer.init_args.lr=0.002,0.004", *args]  # fmt: skip
    process = subprocess.Popen(command, cwd=REPO, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not (out / "points" / "000" / "checkpoints" / "last.ckpt").exists():
            assert process.poll() is None and time.monotonic() < deadline, "point 000 saved no checkpoint"
            time.sleep(0.1)
        os.killpg(process.pid, signal.SIGINT)  # Ctrl-C in the terminal reaches the whole group
        output, _ = process.communicate(timeout=120)
    finally:
        kill_job(process.pid)
    assert "point 000 preempted" in output, output[-3000:]
    status = sweep("status", str(out))
    assert "| 000 | 0.002 | preempted |" in status.stdout and "2 point(s): 1 preempted, 1 pending" in status.stdout, (
        status.stdout
    )

    resumed = sweep("resume", str(out))
    assert resumed.returncode == 0, resumed.stderr[-3000:] + resumed.stdout[-3000:]
    rows = results(out)
    assert [(row["optimizer.init_args.lr"], row["state"]) for row in rows] == [("0.002", "done"), ("0.004", "done")]
    assert all(0.5 < float(row["best val_acc"]) <= 1 and 0 <= int(row["epoch"]) < 6 for row in rows), rows
    assert "| 001 | 0.004 | done |" in (out / "results.md").read_text()
    assert (out / "results.png").stat().st_size > 10_000
    point = json.loads((out / "points" / "000" / "point.json").read_text())
    assert [attempt["exit_code"] for attempt in point["attempts"]] == [130, 0]
    assert "resuming from" in (out / "points" / "000" / "fit.log").read_text()
    alone = ddp_app("fit", "--config", CONFIG, *args, "--optimizer.init_args.lr=0.002",
                    f"--trainer.default_root_dir={tmp_path / 'alone'}")  # fmt: skip
    assert alone.returncode == 0, alone.stderr[-3000:]
    assert_same_weights(weights(tmp_path / "alone"), weights(out / "points" / "000"))


@pytest.mark.parametrize(
    "spec, message",
    [
        (["--grid", "optimizer.init_args.lrr=0.1,0.2"], "unknown key optimizer.init_args.lrr"),
        (["--grid", "optimizer.init_args.lr="], "--grid optimizer.init_args.lr: no values"),
        (["--search", "optimizer.init_args.lr=uniform:0.1:0.1", "--trials", "2"], "empty range"),
        (["--search", "optimizer.init_args.lr=gaussian:0:1", "--trials", "2"], "unknown distribution 'gaussian'"),
        (["--search", "optimizer.init_args.lr=loguniform:0:1", "--trials", "2"], "a log scale needs low > 0"),
        (["--search", "optimizer.init_args.lr=uniform:0:1"], "--search needs --trials >= 1"),
        (["--grid", "trainer.max_epochs=1,x"], "trainer.max_epochs"),
    ],
)
def test_a_bad_spec_is_one_line_and_writes_nothing(
    spec: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as stopped:
        main(["run", "--config", CONFIG, "--out", str(tmp_path / "bad"), *spec])
    assert stopped.value.code == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and error.startswith("app.sweep: error: ") and message in error, error
    assert not (tmp_path / "bad").exists()


@pytest.mark.distributed
def test_a_trial_below_the_median_is_pruned_at_an_epoch_end_by_every_rank(tmp_path: Path) -> None:
    """Two finished trials reached val_acc 0.9 at every epoch; a third with a hopeless learning rate is
    stopped by Optuna's median pruner after epoch 1 (2 ranks agree), recorded as pruned in the table
    and in the study."""
    import optuna

    from app.sweep.results import write_results
    from app.sweep.spec import build_spec
    from app.sweep.store import PRUNED, SweepStore
    from app.sweep.study import distributions, open_study
    from app.sweep.worker import run_point

    out = tmp_path / "sweep"
    fit_args = ["--config", CONFIG, "--trainer.max_epochs=5", "--trainer.enable_progress_bar=false"]
    spec = build_spec(
        fit_args, [], ["optimizer.init_args.lr=loguniform:1e-7:1e-1"], 3, "val_acc", "maximize", "median", 0
    )
    out.mkdir()
    spec.save(out / "sweep.json")
    study = open_study(out, spec)
    for _ in range(2):
        trial = study.ask(distributions(spec))
        for epoch in range(5):
            trial.report(0.9, epoch)
        study.tell(trial, 0.9)
    hopeless = study.ask({"optimizer.init_args.lr": optuna.distributions.FloatDistribution(1e-7, 1e-1, log=True)})
    store = SweepStore(out)
    point = store.add({"optimizer.init_args.lr": "1e-07"}, trial=hopeless.number)
    point = run_point(store, spec, point)
    assert point.state == PRUNED, (out / "points" / "000" / "fit.log").read_text()[-3000:]
    marker = json.loads((out / "points" / "000" / "pruned.json").read_text())
    assert marker["epoch"] == 1 and marker["val_acc"] < 0.9
    assert safe_load(out / "points" / "000" / "checkpoints" / "last.ckpt")["epoch"] <= 2  # not all 5 epochs
    assert study.trials[2].state == optuna.trial.TrialState.PRUNED
    assert sorted(study.trials[2].intermediate_values) == [0, 1]
    assert write_results(store, spec)[0]["state"] == "pruned"


@pytest.fixture
def logging_as_it_was() -> Iterator[None]:
    """`main` quiets this process's loggers (app.run.console.quiet_console); put them back afterwards."""
    from app.run.console import PER_RANK_LOGGERS, RANK_ZERO_LOGGERS

    loggers = [logging.getLogger(name) for name in (*PER_RANK_LOGGERS, *RANK_ZERO_LOGGERS)]
    saved = [(logger, logger.level, list(logger.filters)) for logger in loggers]
    try:
        yield
    finally:
        for logger, level, filters in saved:
            logger.setLevel(level)
            logger.filters[:] = filters


def test_checking_the_swept_values_says_no_seed_per_value(
    logging_as_it_was: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """`run` parses the config once per swept value (the first two parse; the third is refused):
    Lightning's "Seed set to 42" is not said for each (DDP_APP_VERBOSE=1 brings it back)."""
    monkeypatch.delenv("DDP_APP_VERBOSE", raising=False)
    with pytest.raises(SystemExit):
        main(["run", "--config", CONFIG, "--out", str(tmp_path / "s"), "--grid", "trainer.max_epochs=1,2,x"])
    output = capfd.readouterr()
    assert "Seed set" not in output.out + output.err, output.err


@pytest.mark.parametrize("command", ["run", "status", "resume", "worker"])
def test_every_subcommand_takes_the_directory_as_its_first_argument_or_with_out(command: str) -> None:
    spec = ["--config", CONFIG, "--grid", "optimizer.init_args.lr=0.1,1"] if command == "run" else []
    for given in (
        ["runs/sweeps/lr", *spec],
        [*spec, "--out", "runs/sweeps/lr"],
        ["runs/sweeps/lr", "--out", "runs/sweeps/lr", *spec],
    ):
        args, rest = parse([command, *given])
        assert args.out == Path("runs/sweeps/lr") and rest == spec[:2], given  # --config goes to ddp-app fit


@pytest.mark.parametrize("command", ["run", "status", "resume", "worker"])
def test_two_different_directories_are_one_line(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stopped:
        main([command, "runs/sweeps/a", "--out", "runs/sweeps/b"])
    assert stopped.value.code == 2
    error = capsys.readouterr().err
    assert (
        error.count("\n") == 1
        and "two sweep directories: runs/sweeps/a (first argument) and --out runs/sweeps/b" in error
    )


def test_a_sweep_without_a_directory_goes_under_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`run` without DIR: runs/sweeps/<config>-<swept keys>, a new one beside an earlier sweep of that name;
    the other subcommands need to be told which sweep."""
    monkeypatch.chdir(tmp_path)  # runs/ is looked up in the working directory: not the user's runs/
    spec = build_spec(["--config", CONFIG], ["optimizer.init_args.lr=0.1,1", "trainer.max_epochs=1,2"], [], None,
                      None, None, "median", 0)  # fmt: skip
    assert parse(["run", "--config", CONFIG])[0].out is None
    assert default_directory(spec) == Path("runs/sweeps/digits-lr-max_epochs")
    first = default_directory(spec, tmp_path)
    first.mkdir()
    (first / "sweep.json").write_text("{}")
    assert default_directory(spec, tmp_path) == tmp_path / "digits-lr-max_epochs-2"
    with pytest.raises(SweepError, match=r"status: which sweep\? Fix: python -m app.sweep status DIR"):
        parse(["status"])
