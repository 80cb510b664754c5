"""What the data layer asks of the part of a run that keeps its place in the training data.

The loaders ddp-app builds ask a `TrainingPositioner` among the Trainer's callbacks for the epoch and batches to skip,
per-sample seeding, an elastic layout, and where to register stateful streams. ddp-app's `ExactResume`
(app/resume/exact.py) implements it; without one each epoch starts at its first batch. Resume depends on data through
this protocol, not the other way round."""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from app.data.samplers import ElasticLayout

if TYPE_CHECKING:
    import lightning as L

# (epoch, batches to skip, state to load or None, whether the epoch's batches are all trained)
StreamStart = tuple[int, int, Any, bool]


class TrainingPositioner(abc.ABC):
    """The training position, as the loaders ask for it (implemented by `app.resume.exact.ExactResume`)."""

    per_sample_seeding: bool  # each training sample's randomness is seeded by (seed, epoch, index)

    @abc.abstractmethod
    def sampler_position(self) -> tuple[int, int]:
        """(epoch, batches to skip) for the training iterator that is being created now."""

    @abc.abstractmethod
    def training_loader_built(self, configured_batch_size: int | None, dataset_length: int) -> ElasticLayout | None:
        """A training loader was built on ddp-app's sampler: the per-rank batch size the user asked for and the training
        set's length (an elastic resume counts samples by them). Returns the layout its batches are split by (None: the
        run's own)."""

    @abc.abstractmethod
    def next_stream_start(self) -> Callable[[], StreamStart]:
        """For the stateful stream about to be registered: what it asks when its iterator starts."""

    @abc.abstractmethod
    def add_stream(self, stream: Any) -> None:
        """A positioned stream (app.data.positioned_streams) whose state goes into every checkpoint, per rank."""

    @abc.abstractmethod
    def add_notice(self, line: str) -> None:
        """One line for the fit's start: a training loader ddp-app cannot position, and what to do."""

    @abc.abstractmethod
    def training_loaders_rebuilt(self) -> None:
        """The training loaders are built again (Lightning's reload): forget the previous ones' streams."""


def positioner_of(trainer: L.Trainer | None) -> TrainingPositioner | None:
    for callback in getattr(trainer, "callbacks", None) or ():
        if isinstance(callback, TrainingPositioner):
            return callback
    return None


def per_sample_seeding(trainer: L.Trainer | None) -> bool:
    """Whether this Trainer's training sets are seeded per sample (`exact_resume.per_sample_seeding`)."""
    positioner = positioner_of(trainer)
    return positioner is not None and positioner.per_sample_seeding


def training_loader_built(
    trainer: L.Trainer, configured_batch_size: int | None, dataset_length: int
) -> ElasticLayout | None:
    """`TrainingPositioner.training_loader_built` of this Trainer's positioner, if it has one."""
    positioner = positioner_of(trainer)
    return positioner.training_loader_built(configured_batch_size, dataset_length) if positioner else None


def sampler_position(trainer: L.Trainer) -> tuple[int, int]:
    """(epoch, batches to skip) for a training iterator of this Trainer; without a positioner each epoch starts from its
    first batch at Lightning's epoch."""
    positioner = positioner_of(trainer)
    return positioner.sampler_position() if positioner else (trainer.current_epoch, 0)
