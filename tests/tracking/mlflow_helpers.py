"""A real `mlflow server` for the tracking tests, and MLflow's and metrics.csv's view of a run."""

from __future__ import annotations

import contextlib
import csv
import os
import signal
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

from tests.helpers.run import BIN


def start_mlflow_server(directory: Path, port: int) -> subprocess.Popen[bytes]:
    """`mlflow server` with a SQLite backend in `directory`, on 127.0.0.1:`port`, as a team would run
    one; returns once it answers. The same directory again is the same store (a restart)."""
    command = [str(BIN / "mlflow"), "server", "--backend-store-uri", f"sqlite:///{directory / 'mlflow.db'}",
               "--artifacts-destination", str(directory / "artifacts"), "--host", "127.0.0.1", "--port", str(port),
               "--workers", "1"]  # fmt: skip
    with open(directory / "server.log", "a") as log:
        server = subprocess.Popen(command, cwd=directory, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert server.poll() is None, (directory / "server.log").read_text()[-3000:]
            with contextlib.suppress(OSError):
                if urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).status == 200:
                    return server
            assert time.monotonic() < deadline, "mlflow server did not start in 120 s"
            time.sleep(0.5)
    except BaseException:
        stop_mlflow_server(server)
        raise


def stop_mlflow_server(server: subprocess.Popen[bytes]) -> None:
    """kill -9 the server and its workers (its own process group, by the server's PID)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(server.pid, signal.SIGKILL)
    server.wait()


def only_run(uri: str, experiment: str) -> tuple[Any, Any]:
    import mlflow

    client = mlflow.MlflowClient(uri)
    found = client.get_experiment_by_name(experiment)
    assert found is not None, f"no MLflow experiment {experiment}"
    runs = client.search_runs([found.experiment_id])
    assert len(runs) == 1, f"{len(runs)} MLflow runs for one training run"
    return client, runs[0]


def histories(client: Any, run: Any) -> dict[str, list[tuple[int, float]]]:
    """{metric: [(step, value), ...]} as MLflow's client returns them, in step order."""
    return {
        name: sorted((metric.step, metric.value) for metric in client.get_metric_history(run.info.run_id, name))
        for name in run.data.metrics
    }


def csv_values(log_dir: Path) -> dict[tuple[str, int], float]:
    """metrics.csv as {(name, step): value}; fails on a name logged twice at one step."""
    seen: dict[tuple[str, int], float] = {}
    with (log_dir / "metrics.csv").open() as file:
        for row in csv.DictReader(file):
            for name, value in row.items():
                if name != "step" and value and name != "epoch":
                    key = (name, int(row["step"]))
                    assert key not in seen, f"metrics.csv holds {key} twice"
                    seen[key] = float(value)
    return seen
