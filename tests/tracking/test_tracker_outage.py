"""A tracker that cannot be reached stops a launch in one line within seconds; one that goes away
during training costs a line, not time: training runs at its speed, a stop signal is acted on within
the launcher's grace period, metrics.csv is complete, and the next attempt sends MLflow what it
missed. Real `ddp-app fit` runs, a real `mlflow server` stopped with kill -9 and started again."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from app.bench.recovery import clock_arguments
from app.bench.recovery import wait_for_step as wait_for_clock_step
from app.cluster.exit_codes import PREEMPTED_EXIT_CODE
from app.cluster.launch import STOP_GRACE_S
from app.tracking.run import CLOSE_WAIT_S, MLFLOW_OPEN_DEADLINE_S
from tests.helpers.ports import unused_port
from tests.helpers.run import BIN, ddp_app, kill_job, seconds_to_exit, start
from tests.tracking.mlflow_helpers import csv_values, histories, only_run, start_mlflow_server, stop_mlflow_server

pytestmark = [pytest.mark.fault, pytest.mark.distributed]
pytest.importorskip("mlflow")

FIT = ["--config", "configs/digits.yaml", "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false"]
STEPS_PER_EPOCH = 20  # digits at 2 ranks x 32
# Epochs of digits take 0.2 s: enough of them that the run is still training when the server has
# taken epoch 1 and is killed, and a few epochs later (on a loaded machine the server, sharing its
# cores, had taken epoch 1 by epoch 21).
EPOCHS = 60


def test_an_unreachable_mlflow_uri_ends_the_run_in_one_line_before_any_rank_starts(tmp_path: Path) -> None:
    uri = f"http://127.0.0.1:{unused_port()}/"  # nothing listens there
    command = [str(BIN / "ddp-app"), "fit", *FIT, "--trainer.max_epochs=1", f"--trainer.default_root_dir={tmp_path}",
               f"--tracking.mlflow.tracking_uri={uri}"]  # fmt: skip
    started = time.monotonic()
    process = start(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        assert process.stdout is not None
        lines = [(time.monotonic() - started, line.rstrip("\n")) for line in process.stdout]
        process.wait(timeout=60)
    finally:
        kill_job(process.pid)
        process.wait()
    output = "\n".join(line for _, line in lines)
    assert process.returncode == 2, output[-3000:]
    # One line, no traceback.
    errors = [(at, line) for at, line in lines if "error" in line.lower()]
    assert [line for _, line in errors] == [
        f"ddp-app: error: tracking.mlflow: cannot open the MLflow run at {uri} (Connection refused). Fix: start "
        "the server, or correct tracking.mlflow.tracking_uri, or remove tracking.mlflow."
    ], output[-3000:]
    assert "Traceback" not in output
    assert not (tmp_path / "lightning_logs").exists()
    # The launcher asks the server before it starts a rank (app/tracking/run.py
    # `check_remote_mlflow_answers`): no rank was launched. About 5 s in all on an idle 2-core machine,
    # most of it importing Lightning; the bound is against the 258 s of MLflow's own retries, on a
    # machine other tests load. Rank 0's own open (torchrun, srun) is tests/tracking/test_tracker_thread.py.
    assert not any(line.startswith("ddp-app: launched") for _, line in lines), output[-3000:]
    assert errors[0][0] < 4 * MLFLOW_OPEN_DEADLINE_S, f"{errors[0][0]:.1f} s to the error"


def clock_times(clock: Path) -> dict[int, float]:
    """{global step: the unix time rank 0 finished it} from a StepClock file."""
    times = {}
    for line in clock.read_text().splitlines():
        if not line.startswith("start"):
            moment, step = line.split()
            times[int(step)] = float(moment)
    return times


def wait_for_mlflow_step(uri: str, metric: str, step: int, alive: Callable[[], bool], timeout: float = 120) -> None:
    """Until the MLflow server at `uri` holds `metric` at `step` in its only run."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and alive():
        with contextlib.suppress(AssertionError):
            client, run = only_run(uri, "outage")
            if any(value.step >= step for value in client.get_metric_history(run.info.run_id, metric)):
                return
        time.sleep(0.1)
    raise AssertionError(f"MLflow has no {metric} at step {step} (the run ended, or {timeout} s passed)")


# 1.5 to 2.5 min on a busy 2-core machine: two server starts, two runs, and the first run's wait for
# the gone server at its end (CLOSE_WAIT_S).
@pytest.mark.slow
def test_a_server_that_goes_away_costs_no_training_time_and_the_next_attempt_sends_what_it_missed(
    tmp_path: Path,
) -> None:
    store, root, clock = tmp_path / "store", tmp_path / "run", tmp_path / "clock.txt"
    store.mkdir()
    port = unused_port()
    uri = f"http://127.0.0.1:{port}"
    tracking = [f"--tracking.mlflow.tracking_uri={uri}", "--tracking.mlflow.experiment=outage"]
    command = [str(BIN / "ddp-app"), "fit", *FIT, f"--trainer.max_epochs={EPOCHS}",
               f"--trainer.default_root_dir={root}", *tracking, *clock_arguments(clock)]  # fmt: skip
    server = start_mlflow_server(store, port)
    try:
        with open(tmp_path / "first.log", "w") as log:
            process = start(command, stdout=log, stderr=subprocess.STDOUT)
        try:
            alive = lambda: process.poll() is None  # noqa: E731
            wait_for_mlflow_step(uri, "val_acc", 2 * STEPS_PER_EPOCH - 1, alive)  # MLflow has epoch 1
            stop_mlflow_server(server)
            gone_at = max(clock_times(clock)) // STEPS_PER_EPOCH + 1  # the first epoch to end without it
            # The training thread hands the trackers its values and goes on; the tracker thread
            # retries the gone server for minutes (MLflow's default backoff).
            wait_for_clock_step(clock, (gone_at + 3) * STEPS_PER_EPOCH + 5, alive)
            process.send_signal(signal.SIGTERM)  # a preemption while MLflow's client retries
            stop_took = seconds_to_exit(process, STOP_GRACE_S + 60)
        finally:
            kill_job(process.pid)
            process.wait()
        output = (tmp_path / "first.log").read_text()
        assert process.returncode == PREEMPTED_EXIT_CODE, output[-4000:]
        # Saved and gone within the launcher's grace: the close waits CLOSE_WAIT_S for the tracker, no more.
        assert stop_took < CLOSE_WAIT_S + 15 < STOP_GRACE_S, f"{stop_took:.1f} s from SIGTERM to exit"
        (viewing,) = [line for line in output.splitlines() if line.startswith("ddp-app: tracking: mlflow: run ")]
        run_id = viewing.split()[4]
        assert viewing.endswith(f": {uri}/#/experiments/1/runs/{run_id}"), viewing
        warnings = [line for line in output.splitlines() if line.startswith("ddp-app: tracking: mlflow ")]
        assert warnings and len(warnings) <= 2 and "did not answer within" in warnings[-1], output[-3000:]
        times = clock_times(clock)
        # An epoch's time, from one epoch's last step to the next one's: its start, training steps,
        # validation and save (where the values are handed to the trackers).
        up = times[2 * STEPS_PER_EPOCH] - times[STEPS_PER_EPOCH]  # epoch 1, the server up
        down = (times[(gone_at + 3) * STEPS_PER_EPOCH] - times[(gone_at + 1) * STEPS_PER_EPOCH]) / 2
        assert down < 2 * up + 2, f"an epoch took {down:.2f} s with the server gone, {up:.2f} s with it up"
        (log_dir,) = (root / "lightning_logs").iterdir()
        steps = sorted({step for _, step in csv_values(log_dir)})
        assert steps[-1] >= (gone_at + 3) * STEPS_PER_EPOCH, "metrics.csv has every value the training logged"

        server = start_mlflow_server(store, port)  # the same store: the run is there, with what it got
        result = ddp_app("fit", *FIT, f"--trainer.max_epochs={EPOCHS}", f"--trainer.default_root_dir={root}",
                         *tracking, "--ckpt_path=last")  # fmt: skip
        assert result.returncode == 0, result.stderr[-3000:]
        assert f"ddp-app: tracking: mlflow: run {run_id} " in result.stdout
        client, run = only_run(uri, "outage")
        assert run.info.run_id == run_id and run.info.status == "FINISHED"
        history = histories(client, run)
        from_mlflow = {
            (name, step): value for name, values in history.items() if name != "epoch" for step, value in values
        }
        assert from_mlflow == csv_values(log_dir), "MLflow's history is metrics.csv's"
        assert max(step for _, step in from_mlflow) == EPOCHS * STEPS_PER_EPOCH - 1
    finally:
        stop_mlflow_server(server)
