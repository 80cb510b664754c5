"""MLflow, W&B and metrics.csv hold one run per training run across restarts, read back with the
trackers' own readers: a 2-rank run killed with kill -9 and restarted has, in MLflow, one run whose
every metric history equals the uninterrupted run's (no gap, no step twice, the redone steps' values
from the last attempt), and params equal to its config."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from app.bench.recovery import clock_arguments, kill_rank
from app.bench.recovery import wait_for_step as wait_for_clock_step
from app.tracking.layout import MEASURED_METRICS
from tests.helpers.ports import unused_port
from tests.helpers.run import BIN, REPO, clean_env, ddp_app, kill_job, start
from tests.helpers.run import run as run_command
from tests.helpers.wandb_files import wandb_history
from tests.tracking.mlflow_helpers import csv_values, histories, only_run, start_mlflow_server, stop_mlflow_server

pytestmark = [pytest.mark.fault, pytest.mark.distributed]
mlflow = pytest.importorskip("mlflow")

# digits at 2 ranks x 32: 20 steps per epoch, a logged row every 10 steps, checkpoints at epoch ends.
FIT = ["--config", "configs/digits.yaml", "--trainer.max_epochs=3", "--trainer.enable_progress_bar=false",
       "--trainer.enable_model_summary=false"]  # fmt: skip
# Killed at step 57: the last checkpoint is epoch 1's end (step 40). The values logged after it are
# the epoch's train_acc (logged after that save, never logged again by the resume) and the loss at
# step 49 and the rows up to the kill (redone by the resume).
KILL_AT_STEP = 57
TIMING = MEASURED_METRICS  # measured, not computed: differs between any two runs


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = unused_port()
    server = start_mlflow_server(tmp_path_factory.mktemp("mlflow-server"), port)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        stop_mlflow_server(server)


def flat_config(path: Path) -> dict[str, str]:
    """The run's config.yaml as `a.b.c: value` pairs (what the params must equal)."""

    def walk(node, prefix: str) -> Iterator[tuple[str, str]]:
        if isinstance(node, dict) and node:
            for key, value in node.items():
                yield from walk(value, f"{prefix}{key}.")
        else:
            yield prefix[:-1], json.dumps(node) if isinstance(node, (list, dict)) else str(node)

    return {
        key: value for key, value in walk(yaml.safe_load(path.read_text()), "") if key not in ("ckpt_path", "config")
    }


@pytest.fixture(scope="module")
def uninterrupted(mlflow_server: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[tuple[int, float]]]:
    root = tmp_path_factory.mktemp("uninterrupted")
    tracking = [f"--tracking.mlflow.tracking_uri={mlflow_server}", "--tracking.mlflow.experiment=uninterrupted"]
    result = ddp_app("fit", *FIT, f"--trainer.default_root_dir={root}", *tracking, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    client, run = only_run(mlflow_server, "uninterrupted")
    return histories(client, run)


def test_a_run_killed_and_restarted_is_one_mlflow_run_and_one_wandb_run_with_the_uninterrupted_history(
    mlflow_server: str, uninterrupted: dict[str, list[tuple[int, float]]], tmp_path: Path
) -> None:
    clock = tmp_path / "clock.txt"
    root = tmp_path / "run"
    command = [str(BIN / "ddp-app"), "fit", *FIT, f"--trainer.default_root_dir={root}", "--restarts=1",
               f"--tracking.mlflow.tracking_uri={mlflow_server}", "--tracking.mlflow.experiment=killed",
               "--tracking.wandb.project=killed", *clock_arguments(clock)]  # fmt: skip
    with open(tmp_path / "run.log", "w") as log:
        process = start(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for_clock_step(clock, KILL_AT_STEP, lambda: process.poll() is None)
        kill_rank(clock, 1)
        process.wait(timeout=300)
    finally:
        kill_job(process.pid)
        process.wait()
    output = (tmp_path / "run.log").read_text()
    assert process.returncode == 0, output[-4000:]
    assert "restart 1 of 1" in output and "attempt 2 of run" in output, output[-3000:]

    client, run = only_run(mlflow_server, "killed")
    history = histories(client, run)
    assert history.keys() == uninterrupted.keys()
    for name, expected in uninterrupted.items():
        steps = [step for step, _ in history[name]]
        assert len(steps) == len(set(steps)), f"{name}: a step twice in MLflow: {steps}"
        if name in TIMING:
            assert steps == [step for step, _ in expected], name
        else:
            assert history[name] == expected, f"{name} differs from the uninterrupted run"
    assert run.info.status == "FINISHED"
    (log_dir,) = [path for path in (root / "lightning_logs").iterdir() if path.is_dir()]  # one log version
    assert run.data.params == flat_config(log_dir / "config.yaml")
    attempts = [json.loads(run.data.tags[f"attempt.{number}"]) for number in (1, 2)]
    assert attempts[1]["resumed_from"] == str(root / "checkpoints" / "last.ckpt")
    assert run.data.tags["checkpoint.last"] == str(root / "checkpoints" / "last.ckpt")

    # metrics.csv: the same values as MLflow, each once.
    from_csv = csv_values(log_dir)
    from_mlflow = {(name, step): value for name, values in history.items() if name != "epoch" for step, value in values}
    assert from_csv == from_mlflow

    # W&B, offline: a directory per attempt, all of the run's id (the killed attempt's file may be
    # empty: W&B writes it in blocks); synced together, the uninterrupted history.
    assert len(list((log_dir / "wandb").glob("offline-run-*"))) == 2
    runs, logged = wandb_history(log_dir / "wandb")
    assert runs and set(runs) == {json.loads((log_dir / "run.json").read_text())["run_id"]}, runs
    for name, expected in uninterrupted.items():
        if name in TIMING:
            assert [step for step, _ in logged[name]] == [step for step, _ in expected], name
        else:
            assert logged[name] == expected, f"{name} in W&B differs from the uninterrupted run"


def test_a_preempted_run_continued_on_one_rank_is_one_run_in_the_default_sqlite_store(tmp_path: Path) -> None:
    """SIGTERM (a preemption) stops the 2-rank run at a step; `--ckpt_path last` on 1 rank (elastic)
    continues the same MLflow run in `<default_root_dir>/mlflow.db`, no server."""
    clock = tmp_path / "clock.txt"
    root = tmp_path / "run"
    command = [str(BIN / "ddp-app"), "fit", *FIT, f"--trainer.default_root_dir={root}",
               "--tracking.mlflow.experiment=preempted", *clock_arguments(clock)]  # fmt: skip
    with open(tmp_path / "first.log", "w") as log:
        process = start(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for_clock_step(clock, 25, lambda: process.poll() is None)
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=120)
    finally:
        kill_job(process.pid)
        process.wait()
    uri = f"sqlite:///{root / 'mlflow.db'}"
    client, run = only_run(uri, "preempted")
    assert run.info.status == "KILLED"
    stopped_at = max(step for step, _ in histories(client, run)["train_loss"])

    result = ddp_app("fit", *FIT, f"--trainer.default_root_dir={root}", "--trainer.devices=1", "--ckpt_path=last",
                     "--tracking.mlflow.experiment=preempted")  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    client, run = only_run(uri, "preempted")
    assert run.info.status == "FINISHED"
    history = histories(client, run)
    steps = [step for step, _ in history["train_loss"]]
    assert steps == sorted(set(steps)) and steps[-1] == 59 and stopped_at in steps, steps
    assert [step for step, _ in history["val_acc"]] == [19, 39, 59]
    world_sizes = [json.loads(run.data.tags[f"attempt.{number}"])["world_size"] for number in (1, 2)]
    assert world_sizes == [2, 1]
    plotted = run_command([sys.executable, "-m", "app.plot", str(root), "--source", "mlflow"], timeout=120)
    assert plotted.returncode == 0 and "from version_0 (mlflow)" in plotted.stdout, plotted.stderr[-2000:]
    assert (root / "curves.png").stat().st_size > 20_000


def test_a_tracker_that_is_not_installed_is_one_line_naming_the_extra(tmp_path: Path) -> None:
    # sys.modules[name] = None is how Python marks a module as not importable.
    code = "import sys; sys.modules['wandb'] = None; from app.cli.entry import main; main()"
    args = ["fit", *FIT, f"--trainer.default_root_dir={tmp_path}", "--tracking.wandb.project=x"]
    result = subprocess.run([sys.executable, "-c", code, *args], cwd=REPO, env=clean_env(), capture_output=True,
                            text=True, timeout=120)  # fmt: skip
    assert result.returncode == 2, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if "error" in line.lower()]
    assert errors == ["ddp-app: error: tracking.wandb is set but the wandb package is not installed. Fix: pip install "
                      "-e '.[wandb]' (or pip install wandb), or remove tracking.wandb."], result.stderr  # fmt: skip
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "lightning_logs").exists()
