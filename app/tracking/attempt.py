"""How an attempt of a tracked run opens (rank 0, before fit; app/tracking/run.py `Tracking.open`): the run it belongs
to (its identity, `run.json`), what it records (the attempt's facts, the config as params, versions and git state as
tags), and its trackers, the MLflow store reached first and within a deadline, so that a launch it stops leaves no log
version."""

from __future__ import annotations

import contextlib
import datetime
import importlib.metadata
import importlib.util
import json
import os
import platform
import subprocess
import urllib.parse
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import lightning as L
import torch
import yaml

from app.checkpoints.io import atomic_write
from app.errors import UserFacingError
from app.tracking.layout import RUN_FILE, latest_run
from app.tracking.sinks import MlflowSink, RunFacts, TensorBoardSink, WandbSink, quiet_loggers
from app.tracking.worker import TrackerThread, one_line

if TYPE_CHECKING:
    from app.tracking.settings import MLflowSettings, WandbSettings

# Keys of the config that are not settings of the run: every attempt passes its own.
NOT_PARAMS = ("ckpt_path", "config")
# The open of an MLflow run is a probe: a wrong URI or a server that is down ends the launch within seconds, instead of
# after MLflow's retries (7 with exponential backoff: about 4 minutes per request). MLflow reads these variables at
# every request (mlflow/utils/rest_utils.py `http_request`), so they hold for the open only; every later call, on the
# tracker thread, uses MLflow's defaults (or the user's values). One immediate retry forgives a dropped connection.
MLFLOW_OPEN_ENV = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1", "MLFLOW_HTTP_REQUEST_TIMEOUT": "4"}
# The whole open of a run on a remote store (find or create the experiment, create or resume the run).
MLFLOW_OPEN_DEADLINE_S = 10.0
# Stores on this machine: opening one can take seconds the first time (SQLite's schema migrations), and it cannot be
# unreachable; no deadline.
LOCAL_SCHEMES = ("", "file", "sqlite")


def mlflow_unreachable(uri: str, error: Exception, deadline: float | None) -> UserFacingError:
    """The one line for an MLflow store that did not answer, or refused: the same from the launcher's check and from
    rank 0's open."""
    fix = "Fix: start the server, or correct tracking.mlflow.tracking_uri, or remove tracking.mlflow."
    if isinstance(error, TimeoutError) and deadline is not None:
        return UserFacingError(
            f"tracking.mlflow: the MLflow store at {uri} did not answer within {deadline:.0f} s. {fix}"
        )
    return UserFacingError(f"tracking.mlflow: cannot open the MLflow run at {uri} ({one_line(error)}). {fix}")


def check_remote_mlflow_answers(tracking_uri: str | None) -> None:
    """The launcher's check before any rank starts: a remote MLflow store that does not answer within
    MLFLOW_OPEN_DEADLINE_S stops the launch in one line. It only reads; local stores are left to rank 0's open (opening
    creates them), as are torchrun and srun ranks."""
    uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    if uri is None or urllib.parse.urlparse(uri).scheme in LOCAL_SCHEMES:
        return
    from mlflow import MlflowClient

    def ask() -> None:
        with quiet_loggers("mlflow"):
            MlflowClient(tracking_uri=uri).search_experiments(max_results=1)

    try:
        with environment(MLFLOW_OPEN_ENV):
            TrackerThread().call(ask, MLFLOW_OPEN_DEADLINE_S)
    except Exception as error:
        raise mlflow_unreachable(uri, error, MLFLOW_OPEN_DEADLINE_S) from error


@contextlib.contextmanager
def environment(values: dict[str, str]) -> Iterator[None]:
    """Set environment variables for the duration of the block; restore them after."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def flatten(config: Any, prefix: str = "") -> dict[str, str]:
    """`{"trainer": {"max_epochs": 3}}` -> `{"trainer.max_epochs": "3"}`: a tracker's params."""
    if isinstance(config, dict) and config:
        flat: dict[str, str] = {}
        for key, value in config.items():
            flat.update(flatten(value, f"{prefix}{key}."))
        return flat
    return {prefix[:-1]: json.dumps(config) if isinstance(config, (list, dict)) else str(config)}


def run_params(config_yaml: str) -> dict[str, str]:
    config = yaml.safe_load(config_yaml) or {}
    return {key: value for key, value in flatten(config).items() if key.split(".")[0] not in NOT_PARAMS}


def git_state(directory: Path) -> dict[str, str]:
    """The commit of the code the run was started from (the current directory's repository) and whether it had
    uncommitted changes to tracked files; empty outside a repository."""

    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=directory, capture_output=True, text=True, timeout=10, check=True)
        return done.stdout.strip()

    try:
        commit = git("rev-parse", "HEAD")
        status = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return {}
    return {"git.commit": commit, "git.dirty": str(bool(status)).lower()}


def versions() -> dict[str, str]:
    try:
        app_version = importlib.metadata.version("ddp-app")
    except importlib.metadata.PackageNotFoundError:
        app_version = "unknown"
    return {
        "version.python": platform.python_version(),
        "version.torch": torch.__version__,
        "version.lightning": L.__version__,
        "version.ddp_app": app_version,
    }


def attempt_facts(trainer: L.Trainer, number: int, resumed_from: str | None, step: int) -> dict[str, Any]:
    """Where and how this attempt runs: what a user comparing attempts of one run asks first."""
    env = os.environ
    facts = {
        "attempt": number,
        "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "world_size": trainer.world_size,
        "num_nodes": trainer.num_nodes,
        "resumed_from": resumed_from,
        "step": step,
        "host": platform.node(),
    }
    for variable, key in (
        ("SLURM_JOB_ID", "slurm_job_id"),
        ("SLURM_ARRAY_JOB_ID", "slurm_array_job_id"),
        ("SLURM_ARRAY_TASK_ID", "slurm_array_task_id"),
        ("SLURM_RESTART_COUNT", "slurm_restart_count"),
        ("TORCHELASTIC_RESTART_COUNT", "torchrun_restart_count"),
    ):
        if env.get(variable):
            facts[key] = env[variable]
    return facts


def run_identity(
    logs: Path, resume_state: dict[str, Any] | None, continue_latest: bool
) -> tuple[dict[str, Any], int, int]:
    """(identity, seq, step) of the run this attempt belongs to; seq and step of its checkpoint."""
    candidates = []
    if resume_state:
        candidates.append((resume_state, resume_state.get("seq", 0), resume_state.get("step", -1)))
    elif continue_latest and (latest := latest_run(logs)) is not None:
        candidates.append((latest, 0, -1))
    for state, seq, step in candidates:
        run_file = logs / str(state.get("log_version")) / RUN_FILE
        if run_file.is_file():
            identity = json.loads(run_file.read_text())
            if identity.get("run_id") == state.get("run_id"):
                return identity, seq, step
    job_id = os.environ.get("SLURM_JOB_ID")
    taken = {path.name for path in logs.iterdir()} if logs.is_dir() else set()
    version = f"slurm-{job_id}" if job_id and f"slurm-{job_id}" not in taken else None
    if version is None:
        numbers = [
            int(name.split("_")[1]) for name in taken if name.startswith("version_") and name.split("_")[1].isdigit()
        ]
        version = f"version_{max(numbers, default=-1) + 1}"
    identity = {
        "run_id": uuid.uuid4().hex[:16],
        "log_version": version,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    return identity, 0, -1


def write_identity(log_dir: Path, identity: dict[str, Any]) -> None:
    text = json.dumps(identity, indent=1).encode()
    atomic_write(log_dir / RUN_FILE, lambda file: file.write(text))


def open_mlflow(
    settings: MLflowSettings, root: Path, log_dir: Path, identity: dict[str, Any], run_name: str, worker: TrackerThread
) -> MlflowSink:
    """Create or resume the run's MLflow run, on the tracker thread, within MLFLOW_OPEN_DEADLINE_S for a remote store;
    one line that names the URI if it cannot."""
    uri = settings.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    local = uri is None
    uri = uri or f"sqlite:///{(root / 'mlflow.db').resolve()}"
    known = identity.get("mlflow") or {}
    if known.get("tracking_uri") not in (None, uri):
        raise UserFacingError(
            f"tracking.mlflow.tracking_uri is {uri}, but this run's MLflow run {known.get('run_id')} is at "
            f"{known['tracking_uri']} ({log_dir / RUN_FILE}). Fix: the first attempt's tracking_uri, or "
            "start a new run (without --ckpt_path)."
        )
    import mlflow  # noqa: F401  here, not within the deadline: an import takes seconds on a busy machine

    if local:
        root.mkdir(parents=True, exist_ok=True)  # the default store's directory
    # A local store (the default SQLite, or a sqlite:// or file: URI of the user's) keeps its artifacts beside the run:
    # MLflow's own default for it is ./mlruns in whatever directory ddp-app runs in.
    stored_here = local or urllib.parse.urlparse(uri).scheme in LOCAL_SCHEMES
    experiment = settings.experiment
    artifacts = (root / "mlartifacts").resolve().as_uri() if stored_here else None

    def open_run() -> MlflowSink:
        sink = MlflowSink(uri, experiment, artifacts)
        sink.open_run(known.get("run_id"), run_name)
        return sink

    deadline = None if urllib.parse.urlparse(uri).scheme in LOCAL_SCHEMES else MLFLOW_OPEN_DEADLINE_S
    try:
        with environment(MLFLOW_OPEN_ENV):
            sink = worker.call(open_run, deadline)
    except UserFacingError:
        raise
    except Exception as error:
        raise mlflow_unreachable(uri, error, deadline) from error
    identity["mlflow"] = {"tracking_uri": uri, "experiment": experiment, "run_id": sink.run_id}
    return sink


def open_sinks(
    log_dir: Path,
    identity: dict[str, Any],
    run_name: str,
    mlflow_sink: MlflowSink | None,
    tensorboard: bool | None,
    wandb: WandbSettings | None,
) -> list[Any]:
    """The attempt's trackers: TensorBoard and W&B (files in the log directory, opened here) and MLflow
    (already open)."""
    sinks: list[Any] = []
    if tensorboard is None:
        tensorboard = importlib.util.find_spec("tensorboard") is not None
    if tensorboard:
        sinks.append(TensorBoardSink(log_dir))
    if mlflow_sink is not None:
        sinks.append(mlflow_sink)
    if wandb is not None:
        mode = wandb.mode or os.environ.get("WANDB_MODE") or "offline"
        if mode not in ("offline", "online"):
            raise UserFacingError(f"tracking.wandb.mode must be offline or online, got {mode!r}. Fix: one of those.")
        sink = WandbSink(log_dir, wandb.project, wandb.entity, mode)
        sink.open_run(identity["run_id"], run_name, {})
        identity["wandb"] = {"project": wandb.project, "mode": mode, "run_id": identity["run_id"]}
        sinks.append(sink)
    return sinks


def attempt_start(attempts: list[dict[str, Any]], step: int, config_yaml: str, run_id: str) -> RunFacts:
    """What every tracker records at this attempt's start (the last of `attempts`, run.json's list): the config as
    params, versions, git state and every attempt's facts as tags. An attempt killed before its tracker thread sent
    anything (a kill in its first seconds) is recorded by the next."""
    tags = {**versions(), **git_state(Path.cwd()), "ddp_app.run_id": run_id}
    tags.update({f"attempt.{facts['attempt']}": json.dumps(facts) for facts in attempts})
    return RunFacts(attempts[-1]["attempt"], max(step, 0), run_params(config_yaml), tags, config_yaml)
