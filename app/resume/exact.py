"""Exact resume: the application owns the position in the data, and every random draw is reproducible.

Every checkpoint keeps three records:

1. **The data position** (`DataPosition`, in the `exact_resume` part): epoch, batches consumed by completed optimizer
steps, whether the epoch end ran, and the run's shape. Counted by `ExactResume`, never derived from Lightning's loop
counters, whose meaning depends on how a run stopped. 2. **Lightning's loop state, made to agree with it**:
`canonical_fit_loop_state` rewrites `loops.fit_loop` into one of three forms Lightning 2.6 resumes right (guarded in
tests/test_private_apis.py and tests/fault/test_resume_matrix.py); the sampler skips the consumed batches, a stateful
stream loads its state. 3. **Every rank's random state** (torch, CUDA, NumPy, Python), restored right before the resumed
run's first action.

Data loading's randomness is seeded per sample (`app.data.seeding.PerSampleSeeded`). What a record becomes in the
resuming fit, and its checks: app/resume/resumed.py (`Resumed`)."""

from __future__ import annotations

import copy
import functools
import math
import sys
from collections.abc import Callable
from typing import Any

import lightning as L

from app.checkpoints import state as checkpoint_state
from app.checkpoints.io import gather_per_rank
from app.data.positioning import StreamStart, TrainingPositioner
from app.data.samplers import ElasticLayout
from app.errors import ResumeError
from app.private_apis import require
from app.resume.metric_state import per_rank_module_state
from app.resume.position import DataPosition
from app.resume.resumed import Resumed, capture_rng_state
from app.user_code import USER_CODE_DIRECTORIES


def _counters(ready: int, started: int, processed: int, completed: int) -> dict[str, int]:
    return {"ready": ready, "started": started, "processed": processed, "completed": completed}


def canonical_fit_loop_state(
    fit_loop: dict[str, Any], position: DataPosition, validates: bool, by_steps: bool = False
) -> dict[str, Any]:
    """Lightning's `fit_loop` state dict with its progress counters set from `position`.

    Private layout (docs/private_apis.md; tests/test_private_apis.py guards it): `epoch_progress`,
    `epoch_loop.batch_progress`, `epoch_loop.val_loop.batch_progress` and `epoch_loop.state_dict._batches_that_stepped`.
    The three forms are those Lightning writes itself:

    - epoch start (E >= 1): as saved in `on_train_epoch_end` of epoch E - 1;
    - mid-epoch after k batches: as saved in `on_train_batch_end` of batch k;
    - all batches trained, validation and epoch end pending: the epoch loop restarted on its last batch and the
      validation loop mid-evaluation at its first (Lightning's own last-batch form skips both).

    `validates`: whether validation runs after this epoch (it advances the logger's step). Optimizer and scheduler
    progress are left as saved.

    `by_steps` (`trainer.max_steps` set): Lightning keeps the fit loop "restarting" even after a finished epoch
    (`_FitLoop.restarting`), so the epoch-start form would read as "restarted on epoch end" and train epoch E - 1's
    end again. There the epoch-start form is the one Lightning writes at `on_train_epoch_start` of epoch E, before any
    batch: ready one ahead, no batch of the epoch counted."""
    state = copy.deepcopy(fit_loop)
    layout = ("lightning", "exact resume", "the checkpoint's loops.fit_loop state")
    batches = require(state, "epoch_loop.batch_progress", *layout)
    validation = require(state, "epoch_loop.val_loop.batch_progress", *layout)
    epochs = require(state, "epoch_progress", *layout)
    loop_state = state.setdefault("epoch_loop.state_dict", {})
    # A stream without length (unknown until its end is seen) is mid-epoch until then.
    per_epoch = position.batches_per_epoch if position.batches_per_epoch is not None else math.inf
    validation["total"] = _counters(0, 0, 0, 0)
    validation["current"] = _counters(0, 0, 0, 0)
    validation["is_last_batch"] = False
    epoch, done = position.next_epoch, position.batches_to_skip
    if done == 0:
        if epoch < 1:
            raise ResumeError("this checkpoint was written before the first training step: there is nothing to resume.")
        per_epoch = per_epoch if math.isfinite(per_epoch) else 0
        trained = epoch * per_epoch
        if by_steps:
            epochs["total"] = _counters(epoch + 1, epoch, epoch, epoch)
            epochs["current"] = _counters(epoch + 1, epoch, epoch, epoch)
            batches["total"] = _counters(trained, trained, trained, trained)
            batches["current"] = _counters(0, 0, 0, 0)
            batches["is_last_batch"] = False
            loop_state["_batches_that_stepped"] = position.global_step
            return state
        epochs["total"], epochs["current"] = (
            _counters(epoch, epoch, epoch, epoch - 1),
            _counters(epoch, epoch, epoch, epoch - 1),
        )
        batches["total"] = _counters(trained, trained, trained, trained)
        batches["current"] = _counters(per_epoch, per_epoch, per_epoch, per_epoch)
        batches["is_last_batch"] = True
        loop_state["_batches_that_stepped"] = position.global_step
        return state
    trained = epoch * per_epoch + done
    epochs["total"], epochs["current"] = (
        _counters(epoch + 1, epoch + 1, epoch, epoch),
        _counters(epoch + 1, epoch + 1, epoch, epoch),
    )
    if done < per_epoch:
        batches["total"] = _counters(trained, trained, trained, trained - 1)
        batches["current"] = _counters(done, done, done, done - 1)
        batches["is_last_batch"] = False
        loop_state["_batches_that_stepped"] = position.global_step - 1
        return state
    batches["total"] = _counters(trained, trained, trained, trained)
    batches["current"] = _counters(per_epoch, per_epoch, per_epoch, per_epoch)
    batches["is_last_batch"] = True
    validation["total"] = _counters(1, 1, 0, 0)  # "restarted mid-evaluation", before its first batch
    loop_state["_batches_that_stepped"] = position.global_step - 1 if validates else position.global_step
    return state


def _training_batch_size(trainer: L.Trainer) -> int | None:
    loader = trainer.train_dataloader
    return getattr(loader, "batch_size", None) if loader is not None else None


def _run_seed(trainer: L.Trainer) -> int:
    sampler = getattr(trainer.train_dataloader, "sampler", None)
    return int(getattr(sampler, "seed", 0) or 0)


def validates_after_epoch(trainer: L.Trainer, epoch: int) -> bool:
    """Whether the fit loop validates at the end of `epoch` (Lightning's `_should_check_val_epoch`)."""
    every = trainer.check_val_every_n_epoch
    return bool(trainer.enable_validation) and (every is None or (epoch + 1) % every == 0)


class TrainingPosition(TrainingPositioner):
    """The data position: counted by `ExactResume` at Lightning's hooks, asked for by the training loaders, which tell
    it of themselves (app/data/positioning.py); `resumed` is the checkpoint's position that a resumed fit continues
    from."""

    def __init__(self) -> None:
        # Told by the data layer as it builds the training loaders: the stateful streams it positions
        # (app.data.positioned_streams), and one line for each loader it cannot.
        self.streams: list[Any] = []
        self.notices: list[str] = []
        # The per-rank batch size the user's training loader asked for, and its dataset's length (set where ddp-app
        # builds the training loader).
        self.configured_batch_size: int | None = None
        self.dataset_length: int | None = None
        self._reset_position()

    def _reset_position(self) -> None:
        self.epoch = 0
        self.batches_seen = 0  # this epoch's batches through on_train_batch_end
        self.batches_done = 0  # of those, the ones whose optimizer step completed
        self.epoch_end_done = False
        self._skip = 0  # batches of `epoch` the next iterator skips (a mid-epoch resume)
        self._last_batch_seen = False  # the epoch's last batch went through on_train_batch_end
        self.resumed: Resumed | None = None  # set when a fit resumes from a checkpoint

    def sampler_position(self) -> tuple[int, int]:
        # Not consumed here: an iterator may be created and never read (a resume that only has the epoch's validation
        # left), or created twice. The skip ends with the resumed epoch.
        return (self.epoch + 1, 0) if self.epoch_end_done else (self.epoch, self._skip)

    def training_loader_built(self, configured_batch_size: int | None, dataset_length: int) -> ElasticLayout | None:
        self.configured_batch_size = configured_batch_size
        self.dataset_length = dataset_length
        return self.resumed.layout if self.resumed else None

    def next_stream_start(self) -> Callable[[], StreamStart]:
        return functools.partial(self.stream_start, len(self.streams))

    def add_stream(self, stream: Any) -> None:
        self.streams.append(stream)

    def add_notice(self, line: str) -> None:
        self.notices.append(line)

    def training_loaders_rebuilt(self) -> None:
        self.streams.clear()
        self.notices.clear()
        self.configured_batch_size = None

    def stream_start(self, index: int) -> StreamStart:
        """What the training stream `index` asks when it starts now (app.data.positioned_streams)."""
        epoch, skip = self.sampler_position()
        return (epoch, skip, None, False) if self.resumed is None else self.resumed.stream_start(index, epoch, skip)

    def _epoch_length(self, trainer: L.Trainer) -> int | None:
        """Batches in this epoch: Lightning's count, or for a stream without length, what it yielded once it ran out."""
        if math.isfinite(trainer.num_training_batches):
            return int(trainer.num_training_batches)
        return self.batches_seen if self._last_batch_seen else None

    def position(self, trainer: L.Trainer) -> DataPosition:
        configured = self.configured_batch_size
        if configured is None:  # a loader ddp-app did not build
            configured = _training_batch_size(trainer)
        resumed = self.resumed.position if self.resumed else None
        order_world_size, order_batch_size = resumed.order if resumed else (trainer.world_size, configured)
        return DataPosition(
            epoch=self.epoch,
            batches_done=self.batches_done,
            epoch_end_done=self.epoch_end_done,
            batches_per_epoch=self._epoch_length(trainer),
            global_step=trainer.global_step,
            seed=_run_seed(trainer),
            world_size=trainer.world_size,
            per_rank_batch_size=configured,
            accumulate_grad_batches=trainer.accumulate_grad_batches,
            order_world_size=order_world_size,
            order_batch_size=order_batch_size,
            order_micro_batch=resumed.order_micro_batch if resumed else None,
            dataset_length=self.dataset_length,
        )


class ExactResume(L.Callback, TrainingPosition):
    """Owns the data position and the random state that exact resume needs; see the module docstring.

    Counting costs one integer compare per step. The position is checked against Lightning's own epoch at every epoch
    start and after a resume; a disagreement is a bug, reported with a traceback. Configured under the top-level
    `exact_resume:` key of a `ddp-app` config.

    Args:
        per_sample_seeding: seed torch, NumPy and Python's `random` from (seed, epoch, sample index)
            around each `__getitem__` of a map-style training set (`app.data.seeding`). Off, random
            augmentation in the dataset depends on the worker that loads a sample, and a resume
            continues with the right samples but different random draws.
        elastic: a run may continue on another number of ranks (devices x num_nodes) with the
            same global batch and sample order (`app.resume.elastic.ElasticLayout`); false refuses.
        global_batch_size: on a resume, continue with this global batch instead of the checkpoint's,
            knowingly: the sample order is kept and the epoch continues at the sample it stopped at
            (rounded down to a whole new batch), but steps per epoch, and so step-based schedules,
            change from there. Unset (the default) keeps the checkpoint's."""

    def __init__(
        self, per_sample_seeding: bool = True, elastic: bool = True, global_batch_size: int | None = None
    ) -> None:
        if global_batch_size is not None and global_batch_size < 1:
            raise ResumeError(
                f"exact_resume.global_batch_size={global_batch_size}: it must be at least 1. Fix: leave it unset "
                "to keep the checkpoint's global batch."
            )
        self.per_sample_seeding = per_sample_seeding
        self.elastic = elastic
        self.global_batch_size = global_batch_size
        super().__init__()
        self._reset()

    def _reset(self) -> None:
        self._reset_position()
        self._step_seen = -1
        self._flush_due = False
        self._noticed = False
        self._rng_after_training: dict[str, Any] | None = None  # see on_train_batch_end

    # ----- counting -----

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._reset()

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._step_seen = trainer.global_step
        if not math.isfinite(trainer.num_training_batches):  # read at every step: checked once, here
            require(
                trainer.fit_loop.epoch_loop.batch_progress, "is_last_batch", "lightning",
                "the epoch length of a training stream without len()", "fit_loop.epoch_loop.batch_progress",
            )  # fmt: skip
        if trainer.is_global_zero and not self._noticed:
            self._noticed = True
            for line in dict.fromkeys(self.notices):
                print(f"ddp-app: {line}", file=sys.stderr, flush=True)
        if self.resumed is not None:
            self.resumed.start(trainer, pl_module, self.position(trainer), bool(self.streams))

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Only for an epoch that starts from its first batch (Lightning does not call it when resuming mid-epoch). A run
        # resumed at an epoch's start restores its random state here, before any other callback's or the module's
        # epoch-start hook draws from it, as the uninterrupted run's hooks did right after its epoch-end save (this
        # callback is the first: app/run/build.py).
        if self.resumed is not None:
            self.resumed.restore_rng()
        if self.epoch_end_done:
            self.epoch, self.epoch_end_done = self.epoch + 1, False
        self.batches_seen = self.batches_done = self._skip = 0
        self._last_batch_seen = False
        self._rng_after_training = None
        if trainer.current_epoch != self.epoch:
            raise AssertionError(
                f"ddp-app bug: epoch {trainer.current_epoch} started, the data position says {self.epoch}"
            )

    def _flush_logs(self, trainer: L.Trainer) -> None:
        self._flush_due = False
        for logger in trainer.loggers:
            logger.save()

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._flush_due:
            self._flush_logs(trainer)
        if self.resumed is not None:
            self.resumed.restore_rng()

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._flush_due:
            self._flush_logs(trainer)
        # A resume at "validation pending" runs validation before any training batch.
        if self.resumed is not None and not trainer.sanity_checking:
            self.resumed.restore_rng()

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.batches_seen += 1
        if not math.isfinite(trainer.num_training_batches):
            # A stream without length: only Lightning's fetcher knows that this batch was its last (private, guarded in
            # tests/test_private_apis.py).
            self._last_batch_seen = trainer.fit_loop.epoch_loop.batch_progress.is_last_batch
        if trainer.global_step != self._step_seen:  # an optimizer step completed with this batch
            self._step_seen = trainer.global_step
            self.batches_done = self.batches_seen
            length = self._epoch_length(trainer)
            if length is not None and self.batches_done >= length:
                # The generators as the epoch's training ends: a save made later, at the start of validation (the
                # coordinator saves last.ckpt at the next hook), must hold these, because building validation's loader
                # iterator has drawn a seed from them since, and a resumed run builds it again after restoring them.
                self._rng_after_training = capture_rng_state()

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Lightning also ends an unfinished epoch this way when max_steps, max_time or should_stop stops the run: that
        # epoch is not done, and a continued run picks it up where it stopped. Any other early end is the data's (a
        # stream shorter than its len()): the epoch is done.
        length = self._epoch_length(trainer)
        complete = length is not None and self.batches_done >= length
        budget_stop = trainer.should_stop or 0 <= trainer.max_steps <= trainer.global_step
        if complete or not budget_stop:
            self.epoch_end_done = True
            self._skip = 0
            for stream in self.streams:
                stream.record_epoch_end()

    # ----- checkpoints -----

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        position = self.position(trainer).to_checkpoint()
        # What the checkpoint holds is in the logs too: CSVLogger buffers rows (100 steps by default), and a kill -9
        # after this save would lose rows that a resume does not log again. The row of the step being saved is logged
        # right after on_train_batch_end: flushed at the next hook.
        self._flush_logs(trainer)
        self._flush_due = True
        # Lightning builds the checkpoint on every rank (rank 0 writes it), so a collective is safe here.
        pending_end = not self.epoch_end_done and self._rng_after_training is not None
        rng = self._rng_after_training if pending_end else capture_rng_state()
        state = {**rng, "module": per_rank_module_state(pl_module)}
        if self.streams:  # each rank's stream is its own shard: its state is saved per rank
            state["streams"] = [stream.state_at(self.batches_done, self.epoch_end_done) for stream in self.streams]
        states = gather_per_rank(state)  # on rank 0, the one that writes the checkpoint
        # Where this run imported the user's classes from (`user_code_directories`): `python -m app.export` rebuilds
        # them later.
        checkpoint_state.put(
            checkpoint,
            "exact_resume",
            {"position": position, "per_rank": states, "user_code_directories": list(USER_CODE_DIRECTORIES)},
        )

    def on_load_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        if trainer.state.fn != "fit":
            return
        saved = checkpoint_state.get(checkpoint, "exact_resume") or {}
        resumed = Resumed.from_checkpoint(
            saved, trainer.world_size, trainer.global_rank, self.global_batch_size, self.elastic
        )
        position = resumed.position
        validates = validates_after_epoch(trainer, position.epoch)
        checkpoint_state.replace_loop_state(
            checkpoint,
            "fit_loop",
            lambda fit_loop: canonical_fit_loop_state(fit_loop, position, validates, by_steps=trainer.max_steps != -1),
        )
        self.epoch, self.epoch_end_done = position.epoch, position.epoch_end_done
        self.batches_seen = self.batches_done = position.batches_done
        self._skip = position.batches_to_skip
        self._last_batch_seen = position.batches_per_epoch is not None and position.batches_done >= (
            position.batches_per_epoch
        )
        self.resumed = resumed

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self.resumed is not None:
            self.resumed.teardown()
