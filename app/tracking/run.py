"""One training run, one identity: the same log version, MLflow run and W&B run across every attempt.

A run is what `ddp-app fit` starts without `--ckpt_path`. Every continuation of it is an *attempt*
of the same run: `--restarts`, torchrun's `--max-restarts`, a Slurm requeue, Ctrl-C or a preemption
followed by `--ckpt_path last` (on any number of ranks). The first attempt creates the identity and
writes it to `<default_root_dir>/lightning_logs/<version>/run.json`; every checkpoint carries it
(its `tracking` part, app/checkpoints/state.py), so an attempt that resumes from a checkpoint of
this directory reopens the same log version and tracker runs. `--ckpt_path last` before any
checkpoint exists (a crash in the first minutes) continues the directory's latest run
(app/tracking/layout.py `latest_run`). A checkpoint from another directory (fine-tuning from
someone's run) starts a new run.

Rank 0 does all of this; the other ranks log nothing.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import re
import subprocess
import sys
import threading
import time
import urllib.parse
import uuid
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import torch
import yaml
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.core.saving import save_hparams_to_yaml
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.utilities import rank_zero_only

from app.checkpoints import state as checkpoint_state
from app.checkpoints.io import atomic_write
from app.checkpoints.last import LastCheckpoint
from app.cluster.preemption import Stopped
from app.errors import UserFacingError
from app.tracking.history import SETTLED, Call, Journal, RunHistory, mark_sent, replay, sent_seqs
from app.tracking.layout import JOURNAL_FILE, LOGS_NAME, RUN_FILE, SAMPLES_PER_S, latest_run
from app.tracking.sinks import CsvView, MlflowSink, RunFacts, TensorBoardSink, WandbSink, quiet_loggers
from app.tracking.throughput import TrainingClock, batch_size_of, samples_per_s
from app.tracking.worker import TrackerThread

# Keys of the config that are not settings of the run: every attempt passes its own.
NOT_PARAMS = ("ckpt_path", "config")
EXTRAS = {"mlflow": "mlflow", "wandb": "wandb", "tensorboard": "tensorboard"}
# samples_per_s is reduced by the coordinator's epoch-end exchange and logged on every rank with the
# same value (`Tracking.log_samples_per_s`): Lightning's hint to log epoch values with sync_dist=True
# does not apply to it.
warnings.filterwarnings("ignore", message=rf".*self\.log\('{SAMPLES_PER_S}', \.\.\., sync_dist=True\)")
# How long the end of an attempt waits for its trackers to take what is queued (the last values,
# tags, the run's status). A tracker still busy after that is left behind: what it did not confirm
# is in the journal and the next attempt sends it. Bounded so that a preempted job still exits
# well inside the launcher's STOP_GRACE_S (60 s, app/cluster/launch.py), after which it kills the
# rank, and inside the 90 s the sbatch scripts' `--signal=SIGUSR1@90` leave before the time limit.
CLOSE_WAIT_S = 30.0
# A tracker call that has not returned after this long is reported (once, training goes on):
# MLflow's client retries a server that went away for about 4 minutes before it fails.
STALL_WARNING_S = 30.0
# The open of an MLflow run is a probe: a wrong URI or a server that is down ends the launch within
# seconds, instead of after MLflow's retries (7 with exponential backoff: about 4 minutes per
# request). MLflow reads these variables at every request (mlflow/utils/rest_utils.py
# `http_request`), so they hold for the open only; every later call, on the tracker thread, uses
# MLflow's defaults (or the user's values). One immediate retry forgives a dropped connection.
MLFLOW_OPEN_ENV = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1", "MLFLOW_HTTP_REQUEST_TIMEOUT": "4"}
# The whole open of a run on a remote store (find or create the experiment, create or resume the run).
MLFLOW_OPEN_DEADLINE_S = 10.0
# Stores on this machine: opening one can take seconds the first time (SQLite's schema migrations),
# and it cannot be unreachable; no deadline.
LOCAL_SCHEMES = ("", "file", "sqlite")


@dataclass
class MLflowSettings:
    """`tracking.mlflow`: an MLflow run per training run.

    Args:
        tracking_uri: where MLflow keeps runs (`http://host:5000`, `sqlite:///path/runs.db`, a
            `databricks` profile, ...). None: the `MLFLOW_TRACKING_URI` variable, else
            `sqlite:///<default_root_dir>/mlflow.db`. With a local store (SQLite, a file URI) the artifacts
            go to `<default_root_dir>/mlartifacts`, not to MLflow's default `./mlruns`.
        experiment: the MLflow experiment the run belongs to (created if missing).
    """

    tracking_uri: str | None = None
    experiment: str = "ddp-app"


@dataclass
class WandbSettings:
    """`tracking.wandb`: a Weights & Biases run per training run.

    Args:
        project: the W&B project.
        entity: the W&B team or user (None: your default entity).
        mode: offline (files under the log directory, uploaded later with `wandb sync`; compute
            nodes often have no network) or online. None: the `WANDB_MODE` variable, else offline.
    """

    project: str = "ddp-app"
    entity: str | None = None
    mode: str | None = None


def require_tracker(extra: str) -> None:
    """Asking for a tracker whose library is not installed is one line that names the extra."""
    if importlib.util.find_spec(extra) is None:
        raise UserFacingError(
            f"tracking.{extra} is set but the {extra} package is not installed. "
            f"Fix: pip install -e '.[{EXTRAS[extra]}]' (or pip install {extra}), or remove tracking.{extra}."
        )


def one_line(error: BaseException) -> str:
    """An error of a tracker library as a short reason: the system's word for a failed connection
    ("Connection refused", "Name or service not known"), else the first line of its message."""
    text = str(error)
    system = re.search(r"\[Errno -?\d+\] ([^'\")\]]+)", text)
    if system:
        return system.group(1).strip()
    if "timed out" in text.lower():
        return "no answer: timed out"
    first = text.splitlines()[0] if text else repr(error)
    return first if len(first) <= 200 else first[:197] + "..."


def mlflow_unreachable(uri: str, error: Exception, deadline: float | None) -> UserFacingError:
    """The one line for an MLflow store that did not answer, or refused: the same from the launcher's
    check and from rank 0's open."""
    fix = "Fix: start the server, or correct tracking.mlflow.tracking_uri, or remove tracking.mlflow."
    if isinstance(error, TimeoutError) and deadline is not None:
        return UserFacingError(
            f"tracking.mlflow: the MLflow store at {uri} did not answer within {deadline:.0f} s. {fix}"
        )
    return UserFacingError(f"tracking.mlflow: cannot open the MLflow run at {uri} ({one_line(error)}). {fix}")


def check_remote_mlflow_answers(tracking_uri: str | None) -> None:
    """The launcher's check, before any rank starts (app/cli/parser.py): a remote MLflow store (a server,
    Databricks) that does not answer stops the launch in one line, within MLFLOW_OPEN_DEADLINE_S,
    instead of after the ranks started. It only reads (lists one experiment). A local store (the
    default SQLite, a sqlite: or file: URI) is not looked at here: opening it creates it, which only
    rank 0's open may do. Ranks started by torchrun or srun skip this; rank 0's open checks the same."""
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
    """The commit of the code the run was started from (the current directory's repository) and
    whether it had uncommitted changes to tracked files; empty outside a repository."""
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=directory, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        status = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=directory,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
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


class _Outbox:
    """What one tracker still has to be sent (the tracker thread's own state): this attempt's
    start, settled calls in step order, the latest tags, and the calls it holds but has not made
    durable yet (W&B, until `finish`)."""

    def __init__(self, start: RunFacts) -> None:
        self.start: RunFacts | None = start
        self.calls: list[Call] = []
        self.tags: dict[str, str] = {}
        self.unconfirmed: list[Call] = []


class TrackedRun:
    """Rank 0's side of a run's attempt: the journal, metrics.csv and the trackers.

    The journal and metrics.csv are written on the training thread; every tracker call runs on the
    run's tracker thread (app/tracking/worker.py), which the training thread only hands work to, so
    a tracker that hangs or went away never holds training (nor the other ranks, waiting for rank 0
    in a collective, nor a stop signal). What to send is decided on the training thread, from the
    history it alone touches; the tracker thread gets copies of those calls, keeps what a tracker
    did not take in that tracker's outbox, in step order, and tries again at the next save. A
    call is written to `sent-<tracker>.txt` only once the tracker confirmed it, so what an attempt
    leaves unsent (a tracker still down when it ends) is sent by the next attempt.
    """

    def __init__(
        self, log_dir: Path, identity: dict[str, Any], sinks: list[Any], worker: TrackerThread | None = None
    ) -> None:
        self.log_dir, self.identity, self.sinks = log_dir, identity, sinks
        self.worker = worker or TrackerThread()
        self.history: RunHistory = replay(log_dir / JOURNAL_FILE)
        self.journal = Journal(log_dir / JOURNAL_FILE)
        self.csv = CsvView(log_dir)
        self._finished = False
        # Training thread only: per tracker, the calls and (name, step) values handed to it.
        self._sent_values: dict[str, set[tuple[str, int]]] = {}
        self._sent_seqs: dict[str, set[int]] = {}
        # Tracker thread only.
        self._outboxes: dict[str, _Outbox] = {}
        self._calling: str | None = None  # the tracker the thread is waiting on (read by the training thread)
        # Trackers the user was told are failing or not answering; both threads report, under the lock.
        self._warned: set[str] = set()
        self._warned_lock = threading.Lock()

    def begin(self, seq: int, step: int, facts: dict[str, Any], tracker_facts: RunFacts) -> None:
        """Start this attempt: after a resume, the dead attempts' later values become provisional."""
        if facts["attempt"] > 1:
            self.journal.append({"resumed": seq, "step": step})
            self.history.resumed(seq, step)
        self.journal.append({"attempt": facts})
        self.csv.rewrite(self.history.view())
        for sink in self.sinks:
            self.worker.submit(functools.partial(self._open_outbox, sink.name, tracker_facts))
        self._send(self.history.settled())  # what earlier attempts settled but did not send

    def log(self, step: int, values: dict[str, float]) -> None:
        call, replaced = self.history.log(step, values, time.time())
        self.journal.append({"seq": call.seq, "step": step, "time": call.time, "values": values})
        if replaced:
            self.csv.rewrite(self.history.view())
        else:
            self.csv.append(call, self.history.view())

    def saved(self, seq: int, step: int, tags: dict[str, str]) -> None:
        self.journal.append({"saved": seq, "step": step})
        self.history.saved(seq, step)
        self._send(self.history.settled(), tags)

    def finish(self) -> None:
        self.journal.append({"finished": True})
        self.history.finished()
        self._finished = True
        self._send(self.history.settled())

    def close(self, status: str, tags: dict[str, str]) -> None:
        """Hand each tracker its last values, tags and the run's status, and wait for them at most
        CLOSE_WAIT_S; then leave (a tracker still busy is abandoned, its thread a daemon)."""
        for sink in self.sinks:
            self.worker.submit(functools.partial(self._close_sink, sink, status, tags))
        if not self.worker.drain(CLOSE_WAIT_S):
            print(
                f"ddp-app: tracking: {self._calling or 'a tracker'} did not answer within {CLOSE_WAIT_S:.0f} s; "
                "leaving without it. The values it did not confirm are in the journal; the next attempt of this "
                "run (--ckpt_path last) sends them.",
                file=sys.stderr,
                flush=True,
            )
        self.journal.close()

    def _sent_file(self, sink: Any) -> Path:
        return self.log_dir / f"sent-{sink.name}.txt"

    def _complete_below(self) -> float:
        """The steps below this one hold their last value: every call at them is settled, and a
        later step has been settled, so nothing more will be logged at them.

        For trackers that cannot add to a step once they have moved past it (W&B): Lightning logs
        an epoch's values at the epoch's last step in several calls, some after the epoch-end
        checkpoint, so such a step is sent only when it is complete; else an attempt that ends
        (W&B commits the row at `finish`) after the first part leaves the rest of the step out.
        """
        settled = [call.step for call in self.history.calls.values() if call.state == SETTLED]
        open_steps = [call.step for call in self.history.calls.values() if call.state != SETTLED]
        return min(max(settled, default=-1), min(open_steps, default=math.inf))

    def _send(self, settled: list[Call], tags: dict[str, str] | None = None) -> None:
        """Hand each tracker the settled calls it has not had yet, one value per name and step
        (Lightning repeats `epoch` in every call of a step: the first one sent stands), in step
        order; returns at once (the tracker thread sends them)."""
        for sink in self.sinks:
            if sink.name not in self._sent_seqs:  # read once per attempt, kept in memory after
                self._sent_seqs[sink.name] = sent_seqs(self._sent_file(sink))
            sent = self._sent_seqs[sink.name]
            if sink.name not in self._sent_values:
                self._sent_values[sink.name] = {
                    (name, call.step)
                    for call in self.history.calls.values()
                    if call.seq in sent
                    for name in call.values
                }
            sent_values = self._sent_values[sink.name]
            below = math.inf if sink.takes_earlier_steps or self._finished else self._complete_below()
            unsent = []
            for call in settled:
                if call.seq in sent or call.step >= below:
                    continue
                values = {name: value for name, value in call.values.items() if (name, call.step) not in sent_values}
                sent_values.update((name, call.step) for name in values)
                unsent.append(Call(call.seq, call.step, call.time, values, call.state))
            sent.update(call.seq for call in unsent)
            if unsent or tags:
                self.worker.submit(functools.partial(self._deliver, sink, unsent, dict(tags or {})))
        self._warn_if_stalled()

    # ----- on the tracker thread -----

    def _open_outbox(self, name: str, facts: RunFacts) -> None:
        self._outboxes[name] = _Outbox(facts)

    def _deliver(self, sink: Any, calls: list[Call], tags: dict[str, str]) -> None:
        outbox = self._outboxes[sink.name]
        outbox.calls.extend(calls)
        outbox.tags.update(tags)
        self._flush(sink, outbox)

    def _flush(self, sink: Any, outbox: _Outbox) -> bool:
        """Send a tracker its outbox (this attempt's start first); whether it took all of it. One
        that fails keeps its outbox for the next try (the next save, or the close)."""
        self._calling = sink.name
        called = False  # a tracker that had nothing to take has not shown that it answers again
        try:
            if outbox.start is not None:
                called = True
                sink.start(outbox.start)
                outbox.start = None
            if outbox.calls:
                called = True
                calls = outbox.calls
                sink.send([call for call in calls if call.values])
                outbox.calls = []
                if sink.durable_on_send:
                    mark_sent(self._sent_file(sink), calls)
                else:
                    outbox.unconfirmed.extend(calls)
            if outbox.tags:
                called = True
                sink.note(outbox.tags)
                outbox.tags = {}
        except Exception as error:
            self._warn(
                sink.name,
                f"sending to {sink.name} failed ({one_line(error)}); training goes on, the values are kept and "
                "sent again at the next checkpoint.",
            )
            return False
        finally:
            self._calling = None
        with self._warned_lock:
            answered_again = called and sink.name in self._warned
            if called:
                self._warned.discard(sink.name)
        if answered_again:
            print(f"ddp-app: tracking: {sink.name} answers again; it has been sent what it missed.", file=sys.stderr)
        return True

    def _close_sink(self, sink: Any, status: str, tags: dict[str, str]) -> None:
        outbox = self._outboxes[sink.name]
        outbox.tags.update(tags)
        if not self._flush(sink, outbox):
            return  # warned; the next attempt sends the rest and sets the run's status
        self._calling = sink.name
        try:
            sink.close(status)
        except Exception as error:  # the run's outcome stands; the tracker is told later or never
            self._warn(sink.name, f"{sink.name} could not be closed ({one_line(error)})")
        else:
            mark_sent(self._sent_file(sink), outbox.unconfirmed)
            outbox.unconfirmed = []
        finally:
            self._calling = None

    # ----- telling the user, once per outage -----

    def _warn(self, name: str, message: str) -> None:
        with self._warned_lock:
            if name in self._warned:
                return
            self._warned.add(name)
        print(f"ddp-app: tracking: {message}", file=sys.stderr, flush=True)

    def _warn_if_stalled(self) -> None:
        """A tracker call that has not returned for STALL_WARNING_S (MLflow retrying a server that
        went away) is said once, while training goes on."""
        waited, name = self.worker.busy_for(), self._calling
        if name is not None and waited >= STALL_WARNING_S:
            self._warn(
                name,
                f"{name} has not answered for {waited:.0f} s (is the server up?); training goes on, the values "
                "are kept and sent when it answers.",
            )


class RunLogger(CSVLogger):
    """Lightning's logger for a tracked run: a CSVLogger's directory layout and `log_dir`
    (`trainer.log_dir`, where LightningCLI saves config.yaml), with every value going through the
    run's journal (app/tracking/history.py) to metrics.csv and the trackers."""

    def __init__(self, save_dir: str, version: str | None, run: TrackedRun | None) -> None:
        super().__init__(save_dir=save_dir, name=LOGS_NAME, version=version)
        self.run = run

    @property
    def experiment(self) -> TrackedRun | None:  # type: ignore[override]
        """The run (None off rank 0). CSVLogger's own writer is never made: Lightning touches
        `experiment` in setup, and the writer warns that a resumed run's files "will be deleted"."""
        return self.run

    @rank_zero_only
    def log_metrics(self, metrics: dict[str, Any], step: int | None = None) -> None:
        if self.run is None:
            return
        values = {
            name: float(value.item() if isinstance(value, torch.Tensor) else value) for name, value in metrics.items()
        }
        self.run.log(int(step) if step is not None else self.run.history.attempt_max_step + 1, values)

    @rank_zero_only
    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        if self.run is None:
            return
        hparams = dict(params) if not isinstance(params, dict) else params
        save_hparams_to_yaml(Path(self.log_dir) / "hparams.yaml", hparams)

    @rank_zero_only
    def save(self) -> None:  # every value is written when it is logged
        pass

    @rank_zero_only
    def finalize(self, status: str) -> None:
        pass  # Tracking closes the run: it knows a stop from a failure


class Tracking(L.Callback):
    """The `tracking:` config section: which trackers a run logs to, besides metrics.csv (always).

        tracking:
          mlflow: {tracking_uri: http://mlflow.internal:5000, experiment: cifar}
          wandb: {project: cifar, mode: offline}
          tensorboard: true

    A tracker without its section is off; any key of it turns it on
    (`--tracking.mlflow.tracking_uri sqlite:///runs.db`).

    Args:
        mlflow: an MLflow run per training run (pip install -e '.[mlflow]').
        wandb: a W&B run per training run (pip install -e '.[wandb]').
        tensorboard: TensorBoard event files in the log directory. None: on when tensorboard is installed.
    """

    def __init__(
        self, mlflow: MLflowSettings | None = None, wandb: WandbSettings | None = None, tensorboard: bool | None = None
    ) -> None:
        self.mlflow = mlflow
        self.wandb = wandb
        self.tensorboard = tensorboard
        self.run: TrackedRun | None = None
        self._viewing: list[str] = []
        self._save_in_flight: tuple[int, int] | None = None
        self._status = "failed"
        # samples/s per epoch, on every rank of a fit that logs: this attempt's share of the epoch
        # (app/tracking/throughput.py defines it), plus what earlier attempts measured of it
        # (`state_dict`), so an epoch split by a resume has its value.
        self._measuring = False
        self._epoch = -1
        self._clock = TrainingClock()
        self._earlier: dict[str, float] = {"samples": 0.0, "seconds": 0.0}

    # ----- opening the run (rank 0, before fit) -----

    def open(
        self,
        trainer: L.Trainer,
        resume_state: dict[str, Any] | None,
        continue_latest: bool,
        config_yaml: str,
        resumed_from: str | None,
    ) -> RunLogger:
        """The logger for this attempt; on rank 0 also the run: a new one, or the one it continues.

        The tracker that can fail to open (MLflow: a wrong URI, a server that is down) is reached
        first, within seconds, before anything is written: a launch it stops leaves no log version.
        On rank 0 a run with a `tracking:` section prints one line per tracker: the run and how to
        see it (`viewing_lines`).
        """
        root = Path(trainer.default_root_dir)
        logs = root / LOGS_NAME
        self._measuring = True
        if not trainer.is_global_zero:
            return RunLogger(str(root), resume_state.get("log_version") if resume_state else None, None)
        identity, seq, step = self._identity(logs, resume_state, continue_latest)
        log_dir = logs / identity["log_version"]
        run_name = f"{root.name}/{identity['log_version']}"
        worker = TrackerThread()
        mlflow_sink = self._open_mlflow(root, log_dir, identity, run_name, worker) if self.mlflow is not None else None
        log_dir.mkdir(parents=True, exist_ok=True)
        attempts = identity.setdefault("attempts", [])
        facts = attempt_facts(trainer, len(attempts) + 1, resumed_from, step)
        attempts.append(facts)
        sinks = self._sinks(log_dir, identity, run_name, mlflow_sink)
        params = run_params(config_yaml)
        tags = {**versions(), **git_state(Path.cwd()), "ddp_app.run_id": identity["run_id"]}
        tags[f"attempt.{facts['attempt']}"] = json.dumps(facts)
        self.run = TrackedRun(log_dir, identity, sinks, worker)
        self._write_identity(log_dir, identity)
        self.run.begin(seq, step, facts, RunFacts(facts["attempt"], max(step, 0), params, tags, config_yaml))
        self._viewing = [sink.viewing_line() for sink in sinks]
        if facts["attempt"] > 1:
            names = f"; {', '.join(sink.name for sink in sinks)}" if sinks else ""
            print(f"ddp-app: tracking: attempt {facts['attempt']} of run {identity['run_id']} (logs: {log_dir}{names})")
        if self.mlflow is not None or self.wandb is not None or self.tensorboard:
            # A run that asked for trackers; TensorBoard's files alone (on by default) are not worth
            # a line at every start (the end of the run says where they are).
            for line in self._viewing:
                print(f"ddp-app: tracking: {line}")
        sys.stdout.flush()
        return RunLogger(str(root), identity["log_version"], self.run)

    def viewing_lines(self) -> list[str]:
        """One line per tracker of this attempt: its run and how to see it (`mlflow: run <id>
        (experiment <name>): <the server's page, or the mlflow ui command>`, `wandb: offline run <id>
        in <folder>: wandb sync <folder>`, `tensorboard: tensorboard --logdir <dir>`), without a
        prefix. Rank 0, from the open on, and still after the run closed; empty elsewhere."""
        return list(self._viewing)

    @staticmethod
    def _identity(
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
                int(name.split("_")[1])
                for name in taken
                if name.startswith("version_") and name.split("_")[1].isdigit()
            ]
            version = f"version_{max(numbers, default=-1) + 1}"
        identity = {
            "run_id": uuid.uuid4().hex[:16],
            "log_version": version,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        }
        return identity, 0, -1

    @staticmethod
    def _write_identity(log_dir: Path, identity: dict[str, Any]) -> None:
        text = json.dumps(identity, indent=1).encode()
        atomic_write(log_dir / RUN_FILE, lambda file: file.write(text))

    def _open_mlflow(
        self, root: Path, log_dir: Path, identity: dict[str, Any], run_name: str, worker: TrackerThread
    ) -> MlflowSink:
        """Create or resume the run's MLflow run, on the tracker thread, within
        MLFLOW_OPEN_DEADLINE_S for a remote store; one line that names the URI if it cannot."""
        assert self.mlflow is not None
        uri = self.mlflow.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
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
        # A local store (the default SQLite, or a sqlite:// or file: URI of the user's) keeps its artifacts
        # beside the run: MLflow's own default for it is ./mlruns in whatever directory ddp-app runs in.
        stored_here = local or urllib.parse.urlparse(uri).scheme in LOCAL_SCHEMES
        experiment = self.mlflow.experiment
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

    def _sinks(
        self, log_dir: Path, identity: dict[str, Any], run_name: str, mlflow_sink: MlflowSink | None
    ) -> list[Any]:
        """The attempt's trackers: TensorBoard and W&B (files in the log directory, opened here) and
        MLflow (already open)."""
        sinks: list[Any] = []
        tensorboard = self.tensorboard
        if tensorboard is None:
            tensorboard = importlib.util.find_spec("tensorboard") is not None
        if tensorboard:
            sinks.append(TensorBoardSink(log_dir))
        if mlflow_sink is not None:
            sinks.append(mlflow_sink)
        if self.wandb is not None:
            mode = self.wandb.mode or os.environ.get("WANDB_MODE") or "offline"
            if mode not in ("offline", "online"):
                raise UserFacingError(
                    f"tracking.wandb.mode must be offline or online, got {mode!r}. Fix: one of those."
                )
            sink = WandbSink(log_dir, self.wandb.project, self.wandb.entity, mode)
            sink.open_run(identity["run_id"], run_name, {})
            identity["wandb"] = {"project": self.wandb.project, "mode": mode, "run_id": identity["run_id"]}
            sinks.append(sink)
        return sinks

    # ----- during training -----

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        samples, seconds = self._epoch_so_far()
        state: dict[str, Any] = {"epoch_throughput": {"epoch": self._epoch, "samples": samples, "seconds": seconds}}
        run = self.run
        if run is not None:
            self._settle_save(trainer)  # two saves in one step (last.ckpt, then another file): the first is on disk
            seq, step = run.history.last_seq, run.history.attempt_max_step
            # Every checkpoint says where in the journal it stands, so an attempt resumed from any of them
            # (`--ckpt_path <file>`) continues the run and redoes what came after it.
            state["run"] = {
                "run_id": run.identity["run_id"],
                "log_version": run.identity["log_version"],
                "seq": seq,
                "step": step,
            }
            # Only last.ckpt settles values: `--ckpt_path last` resumes from it, and a user's
            # ModelCheckpoint (every_n_train_steps, best-k) can hold a later step than last.ckpt does. A
            # save of that file settled the values logged up to it, which a resume from the older
            # last.ckpt then logged a second time.
            if is_last_checkpoint_save(trainer):
                self._save_in_flight = (seq, step)
        checkpoint_state.put(checkpoint, "tracking", state)

    def on_load_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        """The epoch's throughput measured by earlier attempts (the tracked run itself is reopened from the
        checkpoint's summary before fit: app/run/build.py `prepare_run`)."""
        throughput = (checkpoint_state.get(checkpoint, "tracking") or {}).get("epoch_throughput") or {}
        if "samples" in throughput:
            self._epoch = int(throughput["epoch"])
            self._earlier = {"samples": float(throughput["samples"]), "seconds": float(throughput["seconds"])}

    def _settle_save(self, trainer: L.Trainer) -> None:
        """The hook after a save: the file is on disk, what it holds is final."""
        if self._save_in_flight is None or self.run is None:
            return
        seq, step = self._save_in_flight
        self._save_in_flight = None
        self.run.saved(seq, step, checkpoint_tags(trainer))

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._save_in_flight is not None:
            self._settle_save(trainer)
        self._clock.batch_start()

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._measuring:
            self._clock.batch_end(batch_size_of(batch) * trainer.world_size)

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._settle_save(trainer)
        # Not called for an epoch resumed in its middle or at its end (Lightning's fit loop), where
        # `load_state_dict` has put what earlier attempts measured of it.
        self._epoch = trainer.current_epoch
        self._clock.reset()
        self._earlier = {"samples": 0.0, "seconds": 0.0}

    def _epoch_so_far(self) -> tuple[float, float]:
        """(samples, seconds) of the current epoch's training, over every attempt."""
        samples, seconds = self._clock.totals()
        return self._earlier["samples"] + samples, self._earlier["seconds"] + seconds

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._clock.pause()  # validation within an epoch is not training time
        self._settle_save(trainer)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._settle_save(trainer)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._settle_save(trainer)

    def epoch_samples_per_s(self) -> float | None:
        """Training samples/s (app/tracking/throughput.py) of the epoch that ends now, on this rank,
        over every attempt; None if not measured. `app.run.coordinator.RunCoordinator` averages it over
        the ranks in its epoch-end exchange and logs it as `samples_per_s`.
        """
        return samples_per_s(*self._epoch_so_far()) if self._measuring else None

    def log_samples_per_s(self, pl_module: L.LightningModule, samples_per_s: float) -> None:
        """Log the mean over the ranks, which the coordinator's exchange reduced: the same value on
        every rank, so no `sync_dist` (no collective left for whoever reads the metrics next)."""
        pl_module.log(SAMPLES_PER_S, samples_per_s, on_step=False, on_epoch=True)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._settle_save(trainer)
        if self.run is not None:
            self.run.finish()
            self._status = "success"

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        if isinstance(exception, Stopped):
            # Raised after its save completed (app/checkpoints/last.py): what it holds is final.
            self._settle_save(trainer)
            self._status = "stopped"
        self._close(trainer)

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._close(trainer)

    def _close(self, trainer: L.Trainer) -> None:
        self._measuring = False
        if self.run is None:
            return
        run, self.run = self.run, None
        tags = checkpoint_tags(trainer)
        if self._status == "success":
            tags.update(final_metrics(trainer))
        run.close(self._status, tags)


def is_last_checkpoint_save(trainer: L.Trainer) -> bool:
    """Whether the checkpoint being saved is last.ckpt, the one `--ckpt_path last` resumes from
    (app/checkpoints/last.py), rather than another callback's file."""
    writers = [getattr(callback, "last_checkpoint", None) for callback in trainer.checkpoint_callbacks]
    return any(isinstance(writer, LastCheckpoint) and writer.saving for writer in writers)


def checkpoint_tags(trainer: L.Trainer) -> dict[str, str]:
    """Where the run's last and best checkpoints are, as tags the trackers show beside the run."""
    tags: dict[str, str] = {}
    for callback in trainer.checkpoint_callbacks:
        last = getattr(callback, "last_model_path", "")
        if last:
            tags["checkpoint.last"] = str(last)
        if isinstance(callback, ModelCheckpoint) and callback.best_model_path:
            tags["checkpoint.best"] = callback.best_model_path
    return tags


def final_metrics(trainer: L.Trainer) -> dict[str, str]:
    return {
        f"final.{name}": f"{float(value):.6g}"
        for name, value in trainer.callback_metrics.items()
        if isinstance(value, (int, float, torch.Tensor)) and (not isinstance(value, torch.Tensor) or value.numel() == 1)
    }
