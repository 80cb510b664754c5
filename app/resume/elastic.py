"""Elastic resume: a run continued on another number of ranks, or knowingly with another global batch (docs/resume.md).

- `ElasticLayout` (app/data/samplers.py): the sample order kept and each rank's share of a global micro-batch;
- `rebatched_position`, `elastic_layout_for`, `elastic_summary`, `check_elastic_loader`: what a checkpoint's
  `DataPosition` becomes, the one-line refusals, and the line saying what was kept;
- `weigh_losses`: each rank's loss weighted by its share of an unevenly split micro-batch.

No Lightning and no torch here: the sampler, `app.resume.exact.ExactResume` and the reference trainer use it."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

from app.data.samplers import ElasticLayout
from app.errors import ResumeError
from app.resume.position import DataPosition


def rebatched_position(saved: DataPosition, global_batch_size: int, world_size: int) -> DataPosition:
    """The position in units of the global batch a resume accepts (exact_resume.global_batch_size): the same samples
    consumed, rounded down to a whole new micro-batch."""
    new, steps = global_batch_size, saved.accumulate_grad_batches
    fix = "Fix: unset exact_resume.global_batch_size to keep the checkpoint's global batch"
    if saved.micro_batch is None or saved.dataset_length is None:
        raise ResumeError(
            "exact_resume.global_batch_size needs a training loader ddp-app builds (a plain DataLoader over a "
            f"map-style dataset), so that the samples already trained can be counted. {fix}."
        )
    if new % steps or new // steps < world_size:
        raise ResumeError(
            f"exact_resume.global_batch_size={new} cannot be split into {steps} accumulated micro-steps over "
            f"{world_size} ranks. Fix: a multiple of {steps} that is at least {steps * world_size}, or unset it."
        )
    micro_batch = new // steps
    padded = -(-saved.dataset_length // saved.order[0]) * saved.order[0]
    per_epoch = -(-padded // micro_batch)
    consumed = min(saved.batches_done * saved.micro_batch, padded)
    done = per_epoch if saved.epoch_end_done or consumed >= padded else consumed // micro_batch
    return dataclasses.replace(saved, batches_done=done, batches_per_epoch=per_epoch, order_micro_batch=micro_batch)


def elastic_layout_for(saved: DataPosition, world_size: int, elastic: bool) -> ElasticLayout:
    """How a run continues on `world_size` ranks, or with a new global batch; refuses what it cannot."""
    order_world_size, _ = saved.order
    if not elastic and world_size != order_world_size:
        raise ResumeError(
            f"this checkpoint was written by a {saved.world_size}-rank run and this run has {world_size} "
            "ranks, and exact_resume.elastic is false. Fix: resume with the devices and num_nodes it was "
            "trained with, or set exact_resume.elastic: true."
        )
    if saved.micro_batch is None:
        raise ResumeError(
            f"this checkpoint was written by a {saved.world_size}-rank run whose training loader has no batch "
            f"size, so its global batch cannot be split over {world_size} ranks. Fix: resume with "
            f"{saved.world_size} ranks (devices x num_nodes)."
        )
    layout = ElasticLayout(order_world_size, saved.micro_batch, world_size)
    if layout.micro_batch < world_size:
        raise ResumeError(
            f"the global batch of this run ({layout.micro_batch} samples per micro-step) cannot be split over "
            f"{world_size} ranks. Fix: resume on at most {layout.micro_batch} ranks (devices x num_nodes), "
            f"or accept a new global batch knowingly: --exact_resume.global_batch_size N (at least "
            f"{world_size * saved.accumulate_grad_batches}; steps per epoch change from there)."
        )
    return layout


def elastic_summary(
    saved: DataPosition, layout: ElasticLayout | None, world_size: int, rebatched_from: DataPosition | None
) -> str:
    """The line a resume on another number of ranks, or with a new global batch, prints once."""
    layout = layout or ElasticLayout(saved.order[0], saved.micro_batch or 0, world_size)
    split = "+".join(str(size) for size in layout.per_rank_sizes())
    steps = saved.accumulate_grad_batches
    accumulation = f", {steps} micro-steps each" if steps > 1 else ""
    ranks = f"a {saved.world_size}-rank run on {world_size} ranks"
    before = rebatched_from
    if before is None:
        kept = f"global batch {saved.global_batch_size} kept ({split} per micro-step{accumulation})"
        return f"resuming {ranks}: {kept}, sample order kept"
    trained = before.batches_done * (before.micro_batch or 0)
    where = (
        f"the start of epoch {saved.next_epoch}"
        if saved.batches_to_skip == 0 or saved.batches_to_skip >= (saved.batches_per_epoch or 0)
        else f"sample {saved.batches_to_skip * (saved.micro_batch or 0)} of epoch {saved.epoch} "
        f"({trained - saved.batches_to_skip * (saved.micro_batch or 0)} trained samples read again)"
    )
    return (
        f"resuming {ranks} with global batch {saved.global_batch_size} instead of {before.global_batch_size} "
        f"(exact_resume.global_batch_size; {split} per micro-step{accumulation}): sample order kept, "
        f"continuing at {where}; {saved.batches_per_epoch} batches per epoch instead of {before.batches_per_epoch}"
    )


def check_elastic_loader(
    saved: DataPosition, layout: ElasticLayout, world_size: int, sampler_layout: Any, streams: bool, automatic: bool
) -> None:
    """A resume on another number of ranks: every piece that splits the global batch must be ours (the training sampler
    follows `layout`, no stream), and the loss weighting needs automatic optimization."""
    if streams or sampler_layout != layout:
        raise ResumeError(
            f"this checkpoint was written by a {saved.world_size}-rank run and this run has {world_size} "
            "ranks, but its training loader is not one ddp-app builds (a stream, a sampler or loader class of "
            "its own), so its global batch and sample order cannot be kept. Fix: resume with "
            f"{saved.world_size} ranks, or use a plain DataLoader(shuffle=...) over a map-style dataset."
        )
    if not automatic:
        raise ResumeError(
            f"a resume on {world_size} instead of {saved.world_size} ranks splits the global batch "
            "unevenly and weights each rank's loss, which needs automatic optimization. Fix: resume with "
            f"{saved.world_size} ranks."
        )


def weigh_losses(module: Any, layout: ElasticLayout, dataset_length: int, rank: int) -> bool:
    """Scale this rank's loss where the global micro-batch is split unevenly (`ElasticLayout.weight`); returns whether
    it did (`unweigh_losses` undoes it).

    DDP averages per-rank means, so each rank's mean loss is weighted by ranks x its samples / global samples. Lightning
    has no hook to replace the loss, so the instance's `training_step` is wrapped (docs/private_apis.md)."""
    weights = [layout.weight(dataset_length, block, rank) for block in range(layout.blocks(dataset_length))]
    if all(weight == 1.0 for weight in weights):
        return False
    original = module.training_step

    @functools.wraps(original)
    def weighted_training_step(batch: Any, batch_idx: int, *args: Any, **kwargs: Any) -> Any:
        output = original(batch, batch_idx, *args, **kwargs)
        weight = weights[batch_idx]
        if weight == 1.0 or output is None:
            return output
        if isinstance(output, Mapping):
            return {**output, "loss": output["loss"] * weight} if "loss" in output else output
        return output * weight  # a loss tensor

    module.training_step = weighted_training_step
    return True


def unweigh_losses(module: Any) -> None:
    vars(module).pop("training_step", None)
