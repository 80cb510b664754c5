"""The one place where ddp-app's ranks talk to each other during `fit`: `RunCoordinator`.

Every rank must issue the same collectives in the same order, so everything the ranks agree on during training is
exchanged here, one message per fixed point:

- **training start** (`on_train_start`): a stop signal recorded during setup;
- **a check step** (`on_train_batch_end`, about every `last_checkpoint.check_interval_s`): a stop signal, whether a
  timed save of last.ckpt is due, the next check's step;
- **the epoch's end** (`on_train_epoch_end`): a stop signal, the epoch's samples/s and mean step time by part.

Each message is one `all_gather` of a small float64 `Record` per rank on a gloo group; every rank reads the same table
the same way (`agree`). Nothing that runs on one rank only issues a collective.

Lightning reduces epoch-level `sync_dist=True` values lazily, by whoever reads first (rank 0's progress bar), so before
the epoch-end exchange every rank reads them here in the same order (`settle_logged_values`).

Why the epoch end is here: Lightning keeps `Checkpoint` callbacks after all others (`_reorder_callbacks`), so as a
`Checkpoint` this runs last in every hook: last.ckpt holds the best-k state and the exchange follows every user log. The
order of everything ddp-app installs: `app/run/build.py` `build_trainer`."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Protocol

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Checkpoint

from app.checkpoints.last import LastCheckpoint, checkpoint_directory
from app.checkpoints.plugin import finish_writes, start_background_writes, wait_for_staging
from app.cluster.preemption import (
    LIGHTNING_PER_STEP_SIGTERM_BROADCAST,
    STOP_SIGNAL_FLAG,
    STOP_SIGNALS,
    Stopped,
    steps_between_checks,
    stop_message,
)
from app.private_apis import require
from app.run.callbacks import LogLineProgressBar


class MeasuresThroughput(Protocol):
    """What the coordinator asks of the tracked run (`app.tracking.run.Tracking`) at an epoch's end."""

    def epoch_samples_per_s(self) -> float | None: ...

    def log_samples_per_s(self, pl_module: L.LightningModule, samples_per_s: float) -> None: ...


class MeasuresSteps(Protocol):
    """What the coordinator asks of `app.run.step_timing.StepTiming` at an epoch's end."""

    def epoch_means(self) -> tuple[float, ...] | None: ...

    def log_epoch(self, pl_module: L.LightningModule, rows: list[list[float]]) -> None: ...


NOT_TIMED = (-1.0,) * 5  # `Record.step_times` of a rank without timed steps


@dataclass(frozen=True)
class Record:
    """What one rank sends at a fixed point. `samples_per_s` < 0: not measured.

    `step_times`: the epoch's mean step, data, compute, communication and other (s), negative: not measured."""

    signal: int = 0
    save_due: bool = False
    next_check_in: int = 1
    samples_per_s: float = -1.0
    step_times: tuple[float, ...] = NOT_TIMED

    def as_row(self) -> list[float]:
        head = [float(self.signal), float(self.save_due), float(self.next_check_in), self.samples_per_s]
        return [*head, *self.step_times]


@dataclass(frozen=True)
class Agreement:
    """What every rank does next, read the same way from every rank's `Record`."""

    signal: int  # the largest stop signal any rank got (0: none)
    save_due: bool  # any rank's time interval has passed
    next_check_in: int  # steps to the next check: the smallest proposal
    samples_per_s: float | None  # the mean over the ranks of each rank's samples/s; None unless all measured
    step_times: list[list[float]] | None = None  # every rank's `Record.step_times`; None unless all measured


def agree(rows: list[list[float]]) -> Agreement:
    """The decision from every rank's record (one row per rank, as `Record.as_row`)."""
    rates = [row[3] for row in rows]
    return Agreement(
        signal=int(max(row[0] for row in rows)),
        save_due=any(row[1] > 0 for row in rows),
        next_check_in=int(min(row[2] for row in rows)),
        samples_per_s=sum(rates) / len(rates) if all(rate >= 0 for rate in rates) else None,
        step_times=[row[4:9] for row in rows] if all(row[4] >= 0 for row in rows) else None,
    )


def settle_logged_values(trainer: L.Trainer) -> None:
    """Reduce, on this rank, every `sync_dist=True` value no one has reduced yet (called at the same point on every
    rank; values a rank-0 reader reduced are cached)."""
    trainer.callback_metrics  # noqa: B018 (the read is the point)


def exchange(record: Record, group: Any, world_size: int) -> Agreement:
    """One message: every rank's record to every rank, and the decision all of them read from it."""
    if group is None:  # one process: nobody to agree with
        return agree([record.as_row()])
    mine = torch.tensor(record.as_row(), dtype=torch.float64)  # on the CPU: gloo, no device sync
    table = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(table, mine, group=group)
    return agree(torch.stack(table).tolist())


class RunCoordinator(Checkpoint):
    """Owns every exchange between ddp-app's ranks during `fit` (see the module docstring): stop signals, last.ckpt's
    time-interval saves and the epoch's samples/s. Installed by `ddp-app` in every fit; with checkpointing off
    (`trainer.enable_checkpointing: false`) it saves nothing and leaves stop signals to their default action.

    Args:
        last_checkpoint: the writer of last.ckpt and its settings; None: no last.ckpt.
        tracking, step_timing: where the epoch's per-rank samples/s and step times come from; None: not measured."""

    def __init__(
        self,
        last_checkpoint: LastCheckpoint | None = None,
        tracking: MeasuresThroughput | None = None,
        step_timing: MeasuresSteps | None = None,
    ) -> None:
        self.last_checkpoint = last_checkpoint
        self.tracking = tracking
        self.step_timing = step_timing
        self.check_interval_s = last_checkpoint.check_interval_s if last_checkpoint is not None else 1.0
        self._signals = STOP_SIGNAL_FLAG
        self._taken_signals: tuple[int, ...] = ()  # those the flag handles since on_train_start, not before
        self._group: Any = None
        self._world_size = 1
        self._steps_until_check = 1
        self._steps_since_check = 0
        self._last_check = time.monotonic()
        self._step_at_previous_batch = -1
        self._pending: tuple[int, bool] = (0, False)  # (stop signal, interval save due) agreed, not yet done
        self._stop_due = 0  # a stop signal: training stops at the next hook, after the save
        self._save_due = False  # a save decided at a step's end, done at the next hook
        self._stop_at: tuple[int, int] | None = None  # (step, epoch) of a stop agreed at an epoch's end

    # What ddp-app reads of a Checkpoint callback (`find_last_checkpoint`, checkpoint tags).
    @property
    def dirpath(self) -> str | None:
        return self.last_checkpoint.dirpath if self.last_checkpoint is not None else None

    @property
    def last_model_path(self) -> str:
        return self.last_checkpoint.last_model_path if self.last_checkpoint is not None else ""

    # ----- the exchange -----

    def _check(self, samples_per_s: float = -1.0, step_times: tuple[float, ...] = NOT_TIMED) -> Agreement:
        """Exchange this rank's signal, due save and proposed next check; fixes the step of the next check."""
        now = time.monotonic()
        saves = self.last_checkpoint
        record = Record(
            signal=(self._signals.received or 0) if saves is not None else 0,
            save_due=saves is not None and saves.interval_due(now),
            next_check_in=steps_between_checks(now - self._last_check, self._steps_since_check, self.check_interval_s),
            samples_per_s=samples_per_s,
            step_times=step_times,
        )
        self._steps_since_check, self._last_check = 0, now
        agreement = exchange(record, self._group, self._world_size)
        self._steps_until_check = agreement.next_check_in
        return agreement

    # ----- the fixed points -----

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self.last_checkpoint is not None and self.last_checkpoint.dirpath is None:
            self.last_checkpoint.dirpath = str(checkpoint_directory(trainer))

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.last_checkpoint is not None:
            # `app.cli.entry.run` recorded SIGUSR1 and SIGTERM since the rank started; Ctrl-C is recorded from here on.
            self._taken_signals = self._signals.install(STOP_SIGNALS)
            self.last_checkpoint.start(trainer)
            start_background_writes(trainer)  # until on_train_end or a stop (`finish_writes`)
        self._world_size = trainer.world_size
        bar = trainer.progress_bar_callback
        if isinstance(bar, LogLineProgressBar):
            bar.epoch_lines_by = self  # printed here at the epoch's end (on_train_epoch_end), not by the bar
        if dist.is_available() and dist.is_initialized() and trainer.world_size > 1:
            self._group = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else dist.group.WORLD
        epoch_loop = trainer.fit_loop.epoch_loop
        # Private (docs/private_apis.md): Lightning broadcasts rank 0's SIGTERM flag before every step, a collective per
        # step outside this protocol; ddp-app's own handlers own SIGTERM (`keep_lightning_off_stop_signals`), so that
        # flag is never set. A Lightning without it stops here in one line rather than train with a collective per step.
        require(epoch_loop, LIGHTNING_PER_STEP_SIGTERM_BROADCAST, "lightning", "ddp-app's stop signals")
        setattr(epoch_loop, LIGHTNING_PER_STEP_SIGTERM_BROADCAST, lambda: None)
        self._steps_until_check, self._steps_since_check, self._last_check = 1, 0, time.monotonic()
        self._step_at_previous_batch = trainer.global_step
        self._pending = (0, False)
        self._stop_due = 0
        self._save_due = False
        self._stop_at = None
        # A signal during setup (data, rendezvous, sanity check) stops every rank here, together, with nothing new to
        # save: last.ckpt, if any, is the state training would start from.
        agreement = self._check()
        if agreement.signal:
            self._stop(trainer, agreement.signal, saved=False)

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        saves = self.last_checkpoint
        if saves is None:  # nothing to save and no signal to act on: no check
            return
        self._steps_since_check += 1
        self._steps_until_check -= 1
        if self._steps_until_check <= 0:
            agreement = self._check()
            self._pending = (max(self._pending[0], agreement.signal), self._pending[1] or agreement.save_due)
        stepped = trainer.global_step != self._step_at_previous_batch
        self._step_at_previous_batch = trainer.global_step
        if not stepped:  # between accumulated micro-batches: the gradients so far are in no checkpoint
            return
        signum, due = self._pending
        if signum or due or saves.step_due(trainer.global_step):
            self._pending = (0, False)
            # Saved at the next hook, after Lightning has logged this step's metrics (it does so after
            # on_train_batch_end) and nothing else has run: the checkpoint never holds a step whose log row a kill
            # during the save could lose. A stop signal stops right after that save.
            self._save_due = True
        if signum:
            self._stop_due = signum

    def _save_and_stop_if_due(self, trainer: L.Trainer) -> None:
        if self._save_due and self.last_checkpoint is not None:
            self._save_due = False
            self.last_checkpoint.save(trainer)
        if self._stop_due:
            self._stop(trainer, self._stop_due)

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._save_and_stop_if_due(trainer)

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        # Lightning runs the forward and backward inside `optimizer.step` (its closure) and calls this hook after them,
        # just before the update: where a save's overlapped copy must be complete (`last_checkpoint.overlap_copy`; the
        # optimizer's own step pre-hook fires before the closure).
        wait_for_staging(trainer)

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking:
            self._save_and_stop_if_due(trainer)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        settle_logged_values(trainer)
        self._save_due = False  # the epoch-end save below supersedes a step save still due
        rate = self.tracking.epoch_samples_per_s() if self.tracking is not None else None
        means = self.step_timing.epoch_means() if self.step_timing is not None else None
        agreement = self._check(samples_per_s=rate if rate is not None else -1.0, step_times=means or NOT_TIMED)
        if agreement.samples_per_s is not None and self.tracking is not None:
            self.tracking.log_samples_per_s(pl_module, agreement.samples_per_s)
        if agreement.step_times is not None and self.step_timing is not None:
            self.step_timing.log_epoch(pl_module, agreement.step_times)
        signum = max(agreement.signal, self._pending[0], self._stop_due)
        self._pending = (0, False)
        if self.last_checkpoint is not None:
            # Always, even right after an interval save at the last batch: validation and the epoch's end have changed
            # the state since (best-k, epoch counters), and a resume starts the next epoch.
            self.last_checkpoint.save(trainer)
        bar = trainer.progress_bar_callback
        if isinstance(bar, LogLineProgressBar):  # enabled on global rank 0 only
            bar.print_epoch_line(trainer, pl_module, agreement.samples_per_s)  # the value logged above
        if signum:
            # Stopped at the next hook (the next epoch's start, or the end of training), not here: Lightning logs the
            # epoch's `on_epoch=True` values (train_acc, ...) after this hook, and a resume from this checkpoint starts
            # the next epoch, which never logs them again.
            self._stop_due = signum
            self._stop_at = (trainer.global_step, trainer.current_epoch)

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._stop_due:  # agreed at the previous epoch's end, after its save
            self._stop(trainer, self._stop_due)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._stop_due:  # the signal came at the run's last step: saved, and nothing left to stop
            self._save_and_stop_if_due(trainer)
        # A stop signal from here on is recorded and left alone: training is over and last.ckpt saved.
        self._signals.restore(self._taken_signals)
        saves = self.last_checkpoint
        if saves is not None and trainer.global_step != saves.saved_step:  # stopped mid-epoch by max_steps or max_time
            saves.save(trainer)
        finish_writes(trainer)  # what the tracker and the summary name next is on disk (or its failure said)

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        # Keep the flag-only handlers while a stopped job exits: after a requeue SLURM sends SIGTERM to every task,
        # which must not end a rank midway (under `app.cli.entry.run` they stay until the exit).
        if not isinstance(exception, Stopped):
            self._signals.restore(self._taken_signals)

    def _stop(self, trainer: L.Trainer, signum: int, saved: bool = True) -> None:
        finish_writes(trainer)  # the stop line names last.ckpt: its background write (if any) is done
        path = self.last_model_path if saved else None
        step, epoch = self._stop_at or (trainer.global_step, trainer.current_epoch)
        message, exit_code = stop_message(signum, step, epoch, path, trainer.is_global_zero)
        raise Stopped(message, exit_code, trainer.is_global_zero)
