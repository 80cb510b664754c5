"""A fit resumed from a checkpoint: what its `exact_resume` record becomes on this run, the one-line refusals, and this
rank's saved state until restored (random state included). Built by `ExactResume.on_load_checkpoint`."""

from __future__ import annotations

import math
import random
import sys
from dataclasses import dataclass
from typing import Any

import lightning as L
import numpy as np
import torch

from app.data.positioning import StreamStart
from app.data.samplers import ElasticLayout
from app.errors import ResumeError
from app.resume.elastic import (
    check_elastic_loader,
    elastic_layout_for,
    elastic_summary,
    rebatched_position,
    unweigh_losses,
    weigh_losses,
)
from app.resume.metric_state import load_per_rank_module_state
from app.resume.position import DataPosition


def capture_rng_state() -> dict[str, Any]:
    """This process's random generators, in types that `torch.load(weights_only=True)` accepts."""
    kind, keys, position, has_gauss, cached_gaussian = np.random.get_state()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": [kind, keys.tolist(), int(position), int(has_gauss), float(cached_gaussian)],
        "python": random.getstate(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    kind, keys, position, has_gauss, cached_gaussian = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), position, has_gauss, cached_gaussian))
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


@dataclass
class Resumed:
    """Where a resumed fit starts, and what of its checkpoint it has still to restore."""

    position: DataPosition  # the checkpoint's, in this run's batches (a new global batch rebatches it)
    rebatched_from: DataPosition | None  # the checkpoint's own, where a new global batch was accepted
    layout: ElasticLayout | None  # the global batch's split, where the ranks or the global batch changed
    # This rank's saved random and module state until restored, and its streams' states until each stream starts.
    # Per-rank states belong to the ranks that saved them: on another number of ranks, random draws in the step
    # (dropout) and per-rank metric accumulators start afresh (docs/resume.md).
    rank_state: dict[str, Any] | None
    stream_states: list[Any]
    weighted: Any = None  # the module whose losses `weigh_losses` weights, until `teardown`

    @classmethod
    def from_checkpoint(
        cls, saved: dict[str, Any], world_size: int, rank: int, global_batch_size: int | None, elastic: bool
    ) -> Resumed:
        """`saved`: the checkpoint's `exact_resume` part; `global_batch_size`: exact_resume.global_batch_size."""
        record = saved.get("position")
        if record is None:
            raise ResumeError(
                "this checkpoint has no data position (it was written by plain Lightning or an older ddp-app), so "
                "where to continue in the data is unknown. Fix: resume from a checkpoint written by this ddp-app, "
                "or load only its weights (python -m app.export) and start a new run."
            )
        position = DataPosition.from_checkpoint(record)
        rebatched_from = None
        if global_batch_size is not None and global_batch_size != position.global_batch_size:
            rebatched_from = position
            position = rebatched_position(position, global_batch_size, world_size)
        order_world_size, order_batch_size = position.order
        natural = None if order_batch_size is None else order_world_size * order_batch_size
        changed = world_size != order_world_size or position.micro_batch != natural
        layout = elastic_layout_for(position, world_size, elastic) if changed else None
        states = saved.get("per_rank")
        rank_state = states[rank] if states and len(states) == world_size else None
        stream_states = list(rank_state.pop("streams", [])) if rank_state is not None else []
        return cls(position, rebatched_from, layout, rank_state, stream_states)

    def restore_rng(self) -> None:
        """This rank's random state, restored once: right before the first thing the resumed run does."""
        if self.rank_state is not None:
            restore_rng_state(self.rank_state)
            self.rank_state = None

    def stream_start(self, index: int, epoch: int, skip: int) -> StreamStart:
        """(epoch, batches to skip, state to load or None, whether the epoch's batches are all trained) for this rank's
        training stream `index` starting now at (epoch, skip) (app.data.positioned_streams)."""
        state = None
        if index < len(self.stream_states):  # each saved state is loaded once
            state, self.stream_states[index] = self.stream_states[index], None
        per_epoch = self.position.batches_per_epoch
        return epoch, skip, state, skip > 0 and per_epoch is not None and skip >= per_epoch

    def start(self, trainer: L.Trainer, pl_module: L.LightningModule, now: DataPosition, streams: bool) -> None:
        """At the fit's start: the module's per-rank state restored, the run checked against the position (`now`: the
        run's own, `streams`: whether its training loaders are positioned streams), an elastic resume's loss weighting
        installed and said in one line."""
        saved = self.position
        if self.rank_state is not None and "module" in self.rank_state:
            load_per_rank_module_state(pl_module, self.rank_state.pop("module"))
        if saved.batches_to_skip >= (saved.batches_per_epoch or math.inf):
            # Validation comes first, and creating its loader's iterator draws from the global generator.
            self.restore_rng()
        self.check_fits(now)
        if self.layout is not None:
            sampler = getattr(trainer.train_dataloader, "sampler", None)
            automatic, layout_of_sampler = pl_module.automatic_optimization, getattr(sampler, "layout", None)
            check_elastic_loader(saved, self.layout, trainer.world_size, layout_of_sampler, streams, automatic)
            length = len(trainer.train_dataloader.sampler.dataset)
            if weigh_losses(pl_module, self.layout, length, trainer.global_rank):
                self.weighted = pl_module
        if (trainer.world_size != saved.world_size or self.rebatched_from is not None) and trainer.is_global_zero:
            summary = elastic_summary(saved, self.layout, trainer.world_size, self.rebatched_from)
            print(f"ddp-app: {summary}", file=sys.stderr, flush=True)
        if trainer.current_epoch != saved.next_epoch:
            raise AssertionError(
                f"ddp-app bug: Lightning restored epoch {trainer.current_epoch}, the data position says "
                f"{saved.next_epoch} ({saved.describe()})"
            )

    def check_fits(self, now: DataPosition) -> None:
        """The data and the run's shape must be those the position was counted in."""
        saved = self.position
        saved_batch, now_batch = saved.order[1], now.per_rank_batch_size
        changed = [
            f"{name} {getattr(saved, name)} -> {getattr(now, name)}"
            for name in ("accumulate_grad_batches", "batches_per_epoch", "seed")
            if getattr(saved, name) != getattr(now, name)
            and not (name == "batches_per_epoch" and None in (saved.batches_per_epoch, now.batches_per_epoch))
        ]
        # With a new global batch accepted, the per-rank batch follows from it and the config's is not used.
        if saved_batch != now_batch and self.rebatched_from is None:
            changed.insert(0, f"per-rank batch_size {saved_batch} -> {now_batch}")
        if changed:
            raise ResumeError(
                f"this run cannot continue the checkpoint's position ({saved.describe()}) exactly: "
                f"{', '.join(changed)} since it was written. Fix: resume with the batch size, "
                "accumulate_grad_batches, data and seed it was trained with (another number of ranks is fine)."
            )

    def teardown(self) -> None:
        if self.weighted is not None:
            unweigh_losses(self.weighted)
            self.weighted = None
