"""Where a training run stands in its data, as ddp-app writes it into every checkpoint.

A plain record (no Lightning, no torch): `app.resume.exact.ExactResume` counts it and restores it, `app.resume.elastic`
continues it on another number of ranks or with another global batch."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from app.checkpoints import state as checkpoint_state


@dataclass(frozen=True)
class DataPosition:
    """Where a training run stands in its data, as written into every checkpoint.

    `batches_done`: this epoch's (micro-)batches whose optimizer step completed. `epoch_end_done`: the last batch,
    validation and epoch-end callbacks have run (continue with epoch + 1)."""

    epoch: int
    batches_done: int
    epoch_end_done: bool
    batches_per_epoch: int | None  # None: a stream without length, before its end was seen
    global_step: int
    seed: int
    world_size: int
    per_rank_batch_size: int | None  # the configured one (the loader's, unless resumed elastically)
    accumulate_grad_batches: int
    # The run's sample order: the world size and per-rank batch it started with (kept by elastic resumes).
    order_world_size: int | None = None
    order_batch_size: int | None = None
    # The global micro-batch, where a resume accepted a new one (exact_resume.global_batch_size).
    order_micro_batch: int | None = None
    dataset_length: int | None = None  # the training set's, where ddp-app built its loader

    @property
    def order(self) -> tuple[int, int | None]:
        """(world size, per-rank batch) whose order and global batch this run follows."""
        return (self.order_world_size or self.world_size, self.order_batch_size or self.per_rank_batch_size)

    @property
    def micro_batch(self) -> int | None:
        """Samples of one micro-step over all ranks."""
        if self.order_micro_batch is not None:
            return self.order_micro_batch
        world_size, batch_size = self.order
        return None if batch_size is None else world_size * batch_size

    @property
    def global_batch_size(self) -> int | None:
        micro_batch = self.micro_batch
        return None if micro_batch is None else micro_batch * self.accumulate_grad_batches

    @property
    def next_epoch(self) -> int:
        """The epoch whose batches come next."""
        return self.epoch + 1 if self.epoch_end_done else self.epoch

    @property
    def batches_to_skip(self) -> int:
        """Batches of `next_epoch` already trained."""
        return 0 if self.epoch_end_done else self.batches_done

    def describe(self) -> str:
        if self.epoch_end_done:
            return f"the start of epoch {self.epoch + 1}"
        if self.batches_done == 0:
            return f"the start of epoch {self.epoch}"
        if self.batches_per_epoch is not None and self.batches_done >= self.batches_per_epoch:
            return f"the end of epoch {self.epoch} (its validation and epoch end still to run)"
        of = self.batches_per_epoch if self.batches_per_epoch is not None else "?"
        return f"epoch {self.epoch} after {self.batches_done} of {of} batches"

    def to_checkpoint(self) -> dict[str, Any]:
        return {**asdict(self), "global_batch_size": self.global_batch_size}

    @classmethod
    def from_checkpoint(cls, record: dict[str, Any]) -> DataPosition:
        fields = {name: record[name] for name in cls.__dataclass_fields__ if name in record}
        return cls(**fields)


def saved_position(checkpoint: dict[str, Any]) -> dict[str, Any] | None:
    """The data position a checkpoint holds (as `DataPosition.to_checkpoint` wrote it), or None."""
    return (checkpoint_state.get(checkpoint, "exact_resume") or {}).get("position")
