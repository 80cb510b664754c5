"""One training run, one identity: the same log version, MLflow run and W&B run across every attempt.

Every restart, requeue or `--ckpt_path last` after `ddp-app fit` is an *attempt* of the same run (docs/tracking.md). The
identity lives in `lightning_logs/<version>/run.json` and each checkpoint's `tracking` part, so a resume from this
directory reopens it; app/tracking/attempt.py opens an attempt. Rank 0 only."""

from __future__ import annotations

import functools
import importlib.util
import math
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.core.saving import save_hparams_to_yaml
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.utilities import rank_zero_only

from app.checkpoints import state as checkpoint_state
from app.checkpoints.last import LastCheckpoint
from app.checkpoints.plugin import is_on_disk, save_ticket
from app.cluster.preemption import Stopped
from app.errors import UserFacingError
from app.tracking.attempt import (
    MLFLOW_OPEN_DEADLINE_S,  # noqa: F401  imported from here by tests/tracking, as before app/tracking/attempt.py
    attempt_facts,
    attempt_start,
    check_remote_mlflow_answers,  # noqa: F401  imported from here by app/cli/parser.py
    open_mlflow,
    open_sinks,
    run_identity,
    write_identity,
)
from app.tracking.history import SETTLED, Call, Journal, RunHistory, replay, sent_seqs
from app.tracking.layout import JOURNAL_FILE, LOGS_NAME, SAMPLES_PER_S
from app.tracking.settings import MLflowSettings, WandbSettings
from app.tracking.sinks import CsvView, RunFacts
from app.tracking.throughput import TrainingClock, batch_size_of, samples_per_s
from app.tracking.worker import Outboxes, TrackerThread

EXTRAS = {"mlflow": "mlflow", "wandb": "wandb", "tensorboard": "tensorboard"}
# samples_per_s is reduced by the coordinator's epoch-end exchange and logged on every rank with the same value
# (`Tracking.log_samples_per_s`): Lightning's hint to log epoch values with sync_dist=True does not apply to it.
warnings.filterwarnings("ignore", message=rf".*self\.log\('{SAMPLES_PER_S}', \.\.\., sync_dist=True\)")
# How long the end of an attempt waits for its trackers to take what is queued; what a tracker did not confirm by then
# is in the journal, and the next attempt sends it. Bounded so that a preempted job exits well inside the launcher's
# STOP_GRACE_S (app/cluster/launch.py) and the sbatch scripts' `--signal=SIGUSR1@90`.
CLOSE_WAIT_S = 30.0
# A tracker call that has not returned after this long is reported (once, training goes on): MLflow's client retries a
# server that went away for about 4 minutes before it fails.
STALL_WARNING_S = 30.0


def require_tracker(extra: str) -> None:
    """Asking for a tracker whose library is not installed is one line that names the extra."""
    if importlib.util.find_spec(extra) is None:
        raise UserFacingError(
            f"tracking.{extra} is set but the {extra} package is not installed. "
            f"Fix: pip install -e '.[{EXTRAS[extra]}]' (or pip install {extra}), or remove tracking.{extra}."
        )


class TrackedRun:
    """Rank 0's side of a run's attempt: the journal, metrics.csv and the trackers.

    The training thread writes the journal and metrics.csv; tracker calls run on the tracker thread
    (app/tracking/worker.py), so a hanging tracker never holds training. `sent-<tracker>.txt` records what a tracker
    confirmed."""

    def __init__(
        self, log_dir: Path, identity: dict[str, Any], sinks: list[Any], worker: TrackerThread | None = None
    ) -> None:
        self.log_dir, self.identity, self.sinks = log_dir, identity, sinks
        self.worker = worker or TrackerThread()
        self.outboxes = Outboxes(log_dir)  # the tracker thread's
        self.history: RunHistory = replay(log_dir / JOURNAL_FILE)
        self.journal = Journal(log_dir / JOURNAL_FILE)
        self.csv = CsvView(log_dir)
        self._finished = False
        # Training thread only: per tracker, the calls and (name, step) values handed to it.
        self._sent_values: dict[str, set[tuple[str, int]]] = {}
        self._sent_seqs: dict[str, set[int]] = {}

    def begin(self, seq: int, step: int, facts: dict[str, Any], tracker_facts: RunFacts) -> None:
        """Start this attempt: after a resume, the dead attempts' later values become provisional."""
        if facts["attempt"] > 1:
            self.journal.append({"resumed": seq, "step": step})
            self.history.resumed(seq, step)
        self.journal.append({"attempt": facts})
        self.csv.rewrite(self.history.view())
        for sink in self.sinks:
            self.worker.submit(functools.partial(self.outboxes.open, sink.name, tracker_facts))
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
        """Hand each tracker its last values, tags and the run's status, and wait for them at most CLOSE_WAIT_S; then
        leave (a tracker still busy is abandoned, its thread a daemon)."""
        for sink in self.sinks:
            self.worker.submit(functools.partial(self.outboxes.close, sink, status, tags))
        if not self.worker.drain(CLOSE_WAIT_S):
            print(
                f"ddp-app: tracking: {self.outboxes.calling or 'a tracker'} did not answer within {CLOSE_WAIT_S:.0f} "
                "s; leaving without it. The values it did not confirm are in the journal; the next attempt of this "
                "run (--ckpt_path last) sends them.",
                file=sys.stderr,
                flush=True,
            )
        self.journal.close()

    def checkpoint_record(self) -> dict[str, Any]:
        """Where in the journal a checkpoint saved now stands, so an attempt resumed from it (`--ckpt_path <file>`)
        continues the run and redoes what came after it."""
        seq, step = self.history.last_seq, self.history.attempt_max_step
        identity = self.identity
        return {"run_id": identity["run_id"], "log_version": identity["log_version"], "seq": seq, "step": step}

    def _complete_below(self) -> float:
        """The steps below this one hold their last value. For trackers that cannot add to a past step (W&B): an epoch's
        values arrive in several calls, so a step is sent only when complete."""
        settled = [call.step for call in self.history.calls.values() if call.state == SETTLED]
        open_steps = [call.step for call in self.history.calls.values() if call.state != SETTLED]
        return min(max(settled, default=-1), min(open_steps, default=math.inf))

    def _send(self, settled: list[Call], tags: dict[str, str] | None = None) -> None:
        """Hand each tracker the settled calls it has not had yet, one value per name and step (Lightning repeats
        `epoch` in every call of a step: the first one sent stands), in step order; returns at once (the tracker thread
        sends them)."""
        for sink in self.sinks:
            if sink.name not in self._sent_seqs:  # read once per attempt, kept in memory after
                self._sent_seqs[sink.name] = sent_seqs(self.outboxes.sent_file(sink.name))
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
                self.worker.submit(functools.partial(self.outboxes.deliver, sink, unsent, dict(tags or {})))
        self._warn_if_stalled()

    def _warn_if_stalled(self) -> None:
        """A tracker call that has not returned for STALL_WARNING_S (MLflow retrying a server that went away) is said
        once, while training goes on."""
        waited, name = self.worker.busy_for(), self.outboxes.calling
        if name is not None and waited >= STALL_WARNING_S:
            self.outboxes.warn(
                name,
                f"{name} has not answered for {waited:.0f} s (is the server up?); training goes on, the values "
                "are kept and sent when it answers.",
            )


class RunLogger(CSVLogger):
    """Lightning's logger for a tracked run: a CSVLogger's directory layout and `log_dir` (`trainer.log_dir`, where
    LightningCLI saves config.yaml), with every value going through the run's journal (app/tracking/history.py) to
    metrics.csv and the trackers."""

    def __init__(self, save_dir: str, version: str | None, run: TrackedRun | None) -> None:
        super().__init__(save_dir=save_dir, name=LOGS_NAME, version=version)
        self.run = run

    @property
    def experiment(self) -> TrackedRun | None:  # type: ignore[override]
        """The run (None off rank 0). CSVLogger's own writer is never made: Lightning touches `experiment` in setup, and
        the writer warns that a resumed run's files "will be deleted"."""
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

    A tracker without its section is off; any key of it turns it on (`--tracking.mlflow.tracking_uri
    sqlite:///runs.db`).

    Args:
        mlflow: an MLflow run per training run (pip install -e '.[mlflow]').
        wandb: a W&B run per training run (pip install -e '.[wandb]').
        tensorboard: TensorBoard event files in the log directory. None: on when tensorboard is installed."""

    def __init__(
        self, mlflow: MLflowSettings | None = None, wandb: WandbSettings | None = None, tensorboard: bool | None = None
    ) -> None:
        self.mlflow = mlflow
        self.wandb = wandb
        self.tensorboard = tensorboard
        self.run: TrackedRun | None = None
        self._viewing: list[str] = []
        # (seq, step, save_ticket) of each last.ckpt save not yet known to be on disk, oldest first.
        self._saves_unsettled: list[tuple[int, int, int | None]] = []
        self._status = "failed"
        # samples/s per epoch, on every rank: this attempt's share plus what earlier attempts measured (kept in
        # checkpoints), so an epoch split by a resume has its value.
        self._measuring = False
        self._epoch = -1
        self._clock = TrainingClock()

    # ----- opening the run (rank 0, before fit) -----

    def open(
        self,
        trainer: L.Trainer,
        resume_state: dict[str, Any] | None,
        continue_latest: bool,
        config_yaml: str,
        resumed_from: str | None,
    ) -> RunLogger:
        """The logger for this attempt; on rank 0 also the run (new or continued).

        MLflow, which can fail to open, is reached first, before anything is written, so a launch it stops leaves no log
        version. With a `tracking:` section rank 0 prints one line per tracker (`viewing_lines`)."""
        root = Path(trainer.default_root_dir)
        logs = root / LOGS_NAME
        self._measuring = True
        if not trainer.is_global_zero:
            return RunLogger(str(root), resume_state.get("log_version") if resume_state else None, None)
        identity, seq, step = run_identity(logs, resume_state, continue_latest)
        log_dir = logs / identity["log_version"]
        run_name = f"{root.name}/{identity['log_version']}"
        worker = TrackerThread()
        mlflow = self.mlflow
        mlflow_sink = None if mlflow is None else open_mlflow(mlflow, root, log_dir, identity, run_name, worker)
        log_dir.mkdir(parents=True, exist_ok=True)
        attempts = identity.setdefault("attempts", [])
        facts = attempt_facts(trainer, len(attempts) + 1, resumed_from, step)
        attempts.append(facts)
        sinks = open_sinks(log_dir, identity, run_name, mlflow_sink, self.tensorboard, self.wandb)
        start = attempt_start(attempts, step, config_yaml, identity["run_id"])
        self.run = TrackedRun(log_dir, identity, sinks, worker)
        write_identity(log_dir, identity)
        self.run.begin(seq, step, facts, start)
        self._viewing = [sink.viewing_line() for sink in sinks]
        if facts["attempt"] > 1:
            names = f"; {', '.join(sink.name for sink in sinks)}" if sinks else ""
            print(f"ddp-app: tracking: attempt {facts['attempt']} of run {identity['run_id']} (logs: {log_dir}{names})")
        if self.mlflow is not None or self.wandb is not None or self.tensorboard:
            # A run that asked for trackers; TensorBoard's files alone (on by default) are not worth a line at every
            # start (the end of the run says where they are).
            for line in self._viewing:
                print(f"ddp-app: tracking: {line}")
        sys.stdout.flush()
        return RunLogger(str(root), identity["log_version"], self.run)

    def viewing_lines(self) -> list[str]:
        """One line per tracker of this attempt: its run and how to see it, without a prefix. Rank 0, from the open on,
        and still after the run closed; empty elsewhere."""
        return list(self._viewing)

    # ----- during training -----

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        samples, seconds = self._clock.totals()
        state: dict[str, Any] = {"epoch_throughput": {"epoch": self._epoch, "samples": samples, "seconds": seconds}}
        run = self.run
        if run is not None:
            self._settle_save(trainer)  # two saves in one step (last.ckpt, then another file)
            state["run"] = record = run.checkpoint_record()
            # Only last.ckpt settles values: `--ckpt_path last` resumes from it, and a user's ModelCheckpoint can hold a
            # later step, whose values a resume from last.ckpt logs again.
            if is_last_checkpoint_save(trainer):
                self._saves_unsettled.append((record["seq"], record["step"], save_ticket(trainer)))
        checkpoint_state.put(checkpoint, "tracking", state)

    def on_load_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        """The epoch's throughput measured by earlier attempts (the tracked run itself is reopened from the checkpoint's
        summary before fit: app/run/build.py `prepare_run`)."""
        throughput = (checkpoint_state.get(checkpoint, "tracking") or {}).get("epoch_throughput") or {}
        if "samples" in throughput:
            self._epoch = int(throughput["epoch"])
            self._clock.reset(float(throughput["samples"]), float(throughput["seconds"]))

    def _settle_save(self, trainer: L.Trainer) -> None:
        """At a hook after a save of last.ckpt: once the file is on disk (a background write may be in flight), what it
        holds is final; until then the next hook asks again."""
        while self._saves_unsettled and self.run is not None and is_on_disk(trainer, self._saves_unsettled[0][2]):
            seq, step, _ = self._saves_unsettled.pop(0)
            self.run.saved(seq, step, checkpoint_tags(trainer))

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._saves_unsettled:
            self._settle_save(trainer)
        self._clock.batch_start()

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._measuring:
            self._clock.batch_end(batch_size_of(batch) * trainer.world_size)

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._settle_save(trainer)
        # Not called for an epoch resumed in its middle or at its end (Lightning's fit loop), where `on_load_checkpoint`
        # started the clock from what earlier attempts measured of it.
        self._epoch = trainer.current_epoch
        self._clock.reset()

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._clock.pause()  # validation within an epoch is not training time
        self._settle_save(trainer)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._settle_save(trainer)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._settle_save(trainer)

    def epoch_samples_per_s(self) -> float | None:
        """Training samples/s (app/tracking/throughput.py) of the epoch that ends now, on this rank, over every attempt;
        None if not measured. The coordinator averages it over the ranks."""
        return samples_per_s(*self._clock.totals()) if self._measuring else None

    def log_samples_per_s(self, pl_module: L.LightningModule, samples_per_s: float) -> None:
        """Log the mean over the ranks, which the coordinator's exchange reduced: the same value on every rank, so no
        `sync_dist` (no collective left for whoever reads the metrics next)."""
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
