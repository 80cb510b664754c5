"""Where a run's metrics go: metrics.csv (every value as it stands) and the trackers (settled values only,
app/tracking/history.py, each once via `sent-<tracker>.txt`, from the tracker thread). Tracker libraries are imported
only when configured."""

from __future__ import annotations

import contextlib
import csv
import io
import logging
import os
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from app.checkpoints.io import atomic_write
from app.errors import UserFacingError
from app.tracking.history import Call

METRICS_FILE = "metrics.csv"

# MLflow's limits (mlflow.utils.validation): values longer than this are cut, batches split.
MLFLOW_PARAM_VALUE_LIMIT = 6000
MLFLOW_TAG_VALUE_LIMIT = 8000
MLFLOW_METRICS_PER_BATCH = 1000
MLFLOW_PARAMS_PER_BATCH = 100


class CsvView:
    """`metrics.csv` in CSVLogger's layout: a new call is appended (a new column rewrites the file).

    Replacing a provisional value rewrites the file atomically from the history."""

    def __init__(self, log_dir: Path) -> None:
        self.path = log_dir / METRICS_FILE
        self.columns: list[str] = []

    @staticmethod
    def _columns(calls: list[Call]) -> list[str]:
        return sorted({"step", *(name for call in calls for name in call.values)})

    @staticmethod
    def _row(call: Call) -> dict[str, Any]:
        return {"step": call.step, **call.values}

    def rewrite(self, calls: list[Call]) -> None:
        self.columns = self._columns(calls)
        text = io.StringIO()
        writer = csv.DictWriter(text, fieldnames=self.columns)
        writer.writeheader()
        writer.writerows(self._row(call) for call in calls)
        atomic_write(self.path, lambda file: file.write(text.getvalue().encode()))

    def append(self, call: Call, history: list[Call]) -> None:
        if not set(call.values) <= set(self.columns) or not self.path.is_file():
            self.rewrite(history)
            return
        with self.path.open("a", newline="", encoding="utf-8") as file:
            csv.DictWriter(file, fieldnames=self.columns).writerow(self._row(call))


@contextlib.contextmanager
def quiet_loggers(*names: str) -> Iterator[None]:
    """Tracker libraries log INFO lines (database migrations, run URLs) that are not about the run."""
    loggers = [logging.getLogger(name) for name in names]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


def _cut(value: str, limit: int) -> str:
    return value if len(value) <= limit else value[: limit - 3] + "..."


class TensorBoardSink:
    """Event files in the run's log directory (`tensorboard --logdir <default_root_dir>`)."""

    name = "tensorboard"
    durable_on_send = True  # flushed to the event file in `send`
    takes_earlier_steps = True

    def __init__(self, log_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(log_dir))

    def start(self, run: RunFacts) -> None:
        self.writer.add_text("config", "```yaml\n" + run.config_yaml + "\n```", global_step=run.step)

    def send(self, calls: list[Call]) -> None:
        for call in calls:
            for name, value in call.values.items():
                self.writer.add_scalar(name, value, global_step=call.step, walltime=call.time)
        self.writer.flush()

    def note(self, tags: dict[str, str]) -> None:
        pass

    def close(self, status: str) -> None:
        self.writer.close()

    def viewing_line(self) -> str:
        return f"tensorboard: tensorboard --logdir {Path(self.writer.log_dir).parent}"


class MlflowSink:
    """One MLflow run per training run, resumed by id in every attempt."""

    name = "mlflow"
    durable_on_send = True  # stored by the tracking server (or SQLite) when log_batch returns
    takes_earlier_steps = True

    def __init__(self, tracking_uri: str, experiment: str, artifact_location: str | None) -> None:
        from mlflow import MlflowClient

        self.tracking_uri, self.experiment = tracking_uri, experiment
        with quiet_loggers("mlflow", "alembic"):
            self.client = MlflowClient(tracking_uri=tracking_uri)
            found = self.client.get_experiment_by_name(experiment)
            self.experiment_id = (
                found.experiment_id
                if found is not None
                else self.client.create_experiment(experiment, artifact_location=artifact_location)
            )
        self.run_id: str | None = None

    def open_run(self, run_id: str | None, run_name: str) -> str:
        """Resume `run_id`, or create a run (run_id None); returns the MLflow run id."""
        with quiet_loggers("mlflow", "alembic"):
            if run_id is None:
                run_id = self.client.create_run(self.experiment_id, run_name=run_name).info.run_id
            else:
                self.client.update_run(run_id, status="RUNNING")
        self.run_id = run_id
        return run_id

    def start(self, run: RunFacts) -> None:
        from mlflow.entities import Param

        assert self.run_id is not None
        existing = self.client.get_run(self.run_id).data.params
        new = [
            Param(key, _cut(value, MLFLOW_PARAM_VALUE_LIMIT))
            for key, value in run.params.items()
            if key not in existing
        ]
        # MLflow refuses to change a logged param: a value changed by a later attempt is a tag.
        changed = {
            f"param_changed.{key}": f"attempt {run.attempt}: {existing[key]} -> {value}"
            for key, value in run.params.items()
            if key in existing and existing[key] != _cut(value, MLFLOW_PARAM_VALUE_LIMIT)
        }
        for first in range(0, len(new), MLFLOW_PARAMS_PER_BATCH):
            self.client.log_batch(self.run_id, params=new[first : first + MLFLOW_PARAMS_PER_BATCH])
        self.note({**run.tags, **changed})
        self.client.log_text(self.run_id, run.config_yaml, f"config/attempt-{run.attempt}.yaml")
        if run.attempt == 1:
            self.client.log_text(self.run_id, run.config_yaml, "config.yaml")

    def send(self, calls: list[Call]) -> None:
        from mlflow.entities import Metric

        assert self.run_id is not None
        metrics = [
            Metric(name, value, int(call.time * 1000), call.step)
            for call in calls
            for name, value in call.values.items()
        ]
        for first in range(0, len(metrics), MLFLOW_METRICS_PER_BATCH):
            self.client.log_batch(self.run_id, metrics=metrics[first : first + MLFLOW_METRICS_PER_BATCH])

    def note(self, tags: dict[str, str]) -> None:
        from mlflow.entities import RunTag

        assert self.run_id is not None
        if tags:
            self.client.log_batch(
                self.run_id, tags=[RunTag(key, _cut(str(value), MLFLOW_TAG_VALUE_LIMIT)) for key, value in tags.items()]
            )

    def close(self, status: str) -> None:
        if self.run_id is not None:
            self.client.set_terminated(
                self.run_id, status={"success": "FINISHED", "stopped": "KILLED"}.get(status, "FAILED")
            )

    def viewing_line(self) -> str:
        """The run id and where to see it: the server's page of the run, or the command that serves a local store."""
        run = f"mlflow: run {self.run_id} (experiment {self.experiment})"
        scheme = urllib.parse.urlparse(self.tracking_uri).scheme
        if scheme in ("http", "https"):
            return f"{run}: {self.tracking_uri.rstrip('/')}/#/experiments/{self.experiment_id}/runs/{self.run_id}"
        if scheme.startswith("databricks"):
            return f"{run} in {self.tracking_uri}"
        return f"{run}: mlflow ui --backend-store-uri {self.tracking_uri}"


class WandbSink:
    """One W&B run per training run (its id is the run id), resumed in every attempt.

    Offline (the default), each attempt writes its own `wandb/offline-run-*-<id>` under the log directory, uploaded into
    one run by `wandb sync`. Values count as sent only once `finish()` returned (a kill -9 leaves little on disk); the
    next attempt resends. W&B takes nothing at a written step, so steps are sent complete
    (`TrackedRun._complete_below`)."""

    name = "wandb"
    durable_on_send = False
    takes_earlier_steps = False

    def __init__(self, log_dir: Path, project: str, entity: str | None, mode: str) -> None:
        self.log_dir, self.project, self.entity, self.mode = log_dir, project, entity, mode
        self.run: Any = None
        self.run_id = ""

    def open_run(self, run_id: str, run_name: str, config: dict[str, Any]) -> None:
        import wandb

        # No console capture (it would wrap our stdout), no system-metrics thread, no prints.
        try:  # x_*: W&B's experimental settings (docs/private_apis.md)
            settings = wandb.Settings(silent=True, console="off", x_disable_stats=True, x_save_requirements=False)
        except (TypeError, ValueError) as error:
            raise UserFacingError(
                f"wandb {wandb.__version__} refuses the settings ddp-app passes (x_disable_stats, x_save_requirements: "
                f"{str(error).splitlines()[0]}). Fix: pip install -c constraints.txt wandb (the tested version)."
            ) from error
        os.environ.setdefault("WANDB_SILENT", "true")
        self.run = wandb.init(
            project=self.project,
            entity=self.entity,
            id=run_id,
            name=run_name,
            resume="allow",
            mode=self.mode,
            dir=str(self.log_dir),
            config=config,
            settings=settings,
        )
        self.run_id = run_id

    def viewing_line(self) -> str:
        """Offline: the run's folder and the command that uploads it; online: the run's page."""
        if self.mode == "offline":
            folder = self.run.settings.sync_dir
            return f"wandb: offline run {self.run_id} in {folder}: wandb sync {folder}"
        return f"wandb: run {self.run_id}: {self.run.settings.run_url or self.project}"

    def start(self, run: RunFacts) -> None:
        self.run.config.update(run.params, allow_val_change=True)
        self.note(run.tags)

    def send(self, calls: list[Call]) -> None:
        for call in calls:
            self.run.log(dict(call.values), step=call.step)

    def note(self, tags: dict[str, str]) -> None:
        for key, value in tags.items():
            self.run.summary[key] = value

    def close(self, status: str) -> None:
        if self.run is not None:
            self.run.finish(exit_code=0 if status == "success" else 1)
            self.run = None


class RunFacts:
    """What a tracker records at the start of an attempt (app/tracking/run.py fills it in)."""

    def __init__(self, attempt: int, step: int, params: dict[str, str], tags: dict[str, str], config_yaml: str) -> None:
        self.attempt, self.step, self.params, self.tags, self.config_yaml = attempt, step, params, tags, config_yaml
