"""Our samplers for every DataModule, not only ours: exact evaluation and exact mid-epoch resume.

Lightning's padded `DistributedSampler` counts repeated samples twice in evaluation and restarts a resumed epoch.
ddp-app wraps the run's DataModule's (and LightningModule's) `*_dataloader` methods and rebuilds each plain loader from
its public attributes with:

- training: `ResumableDistributedSampler` in a `ResumableDataLoader` over `PerSampleSeeded`; a stateful
  `IterableDataset` over `PositionedStream` (in workers, `WorkerPositionedStream`);
- validation, test, predict: `UnpaddedDistributedSampler` (each sample on exactly one rank).

Left as returned: a `DistributedSampler`, a user-set sampler or batch sampler, DataLoader subclasses, other iterable
datasets and non-DataLoaders (a training loader without `state_dict` gets a line at fit start). Every DataLoader that
forks its workers does so through `app.data.worker_fork` on CPython before 3.12 (a worker hung in the fork is forked
again).

Why wrap methods: Lightning has no public hook to replace a loader (only the private
`_DataConnector._prepare_dataloader`) and a Callback costs dispatch every step. `functools.wraps` keeps `is_overridden`
right; `tests/data/test_user_loaders.py` fails if Lightning stops fetching loaders through the instance."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

import lightning as L
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler, SequentialSampler

from app.data.base import ResumableDataLoader
from app.data.positioned_streams import (
    PositionedStream,
    WorkerPositionedStream,
    WorkerStreamLoader,
    has_state_methods,
    is_stateful_stream,
)
from app.data.positioning import per_sample_seeding, positioner_of, sampler_position, training_loader_built
from app.data.samplers import ResumableDistributedSampler, UnpaddedDistributedSampler
from app.data.seeding import (
    PerSampleSeeded,
    evaluation_loader_generator,
    reads_without_randomness,
    training_loader_generator,
)
from app.data.worker_fork import fork_workers_safely
from app.parallel.fault_tolerance import training_shard

# The methods Lightning calls for loaders, and whether they train.
LOADER_METHODS = {
    "train_dataloader": True,
    "val_dataloader": False,
    "test_dataloader": False,
    "predict_dataloader": False,
}
# The attribute of a wrapped method that holds the Trainer of the current run: a later run on the same objects updates
# it instead of wrapping the method twice.
WRAPPED = "_ddp_app_shards_loaders_for"


def is_plain_loader(loader: Any) -> bool:
    """A `DataLoader` whose samplers are the ones DataLoader picks itself from `shuffle=`."""
    if type(loader) is not DataLoader or isinstance(loader.dataset, IterableDataset):
        return False
    if loader.batch_sampler is None or type(loader.batch_sampler) is not BatchSampler:
        return False
    sampler = loader.sampler
    if type(sampler) is RandomSampler:
        # replacement or a sample count of its own is a sampling scheme of the user's: keep it.
        return not sampler.replacement and sampler.num_samples == len(loader.dataset)
    return type(sampler) is SequentialSampler


# What a rebuilt loader keeps of the user's: how its workers run and where its batches go.
WORKER_OPTIONS = (
    "num_workers", "pin_memory", "timeout", "worker_init_fn", "multiprocessing_context", "prefetch_factor",
    "pin_memory_device",
)  # fmt: skip


def _options(loader: DataLoader, *names: str) -> dict[str, Any]:
    return {name: getattr(loader, name) for name in names}


def reshard(loader: Any, trainer: L.Trainer, training: bool) -> Any:
    """The loader with our sampler for this rank if it is a plain one (also inside lists and dicts)."""
    if isinstance(loader, (list, tuple)):
        return type(loader)(reshard(item, trainer, training) for item in loader)
    if isinstance(loader, dict):
        return {key: reshard(item, trainer, training) for key, item in loader.items()}
    if not is_plain_loader(loader):
        return _positioned_stream(loader, trainer) if training else loader
    world_size, rank = trainer.world_size, trainer.global_rank
    generator = loader.generator
    dataset = loader.dataset
    if training:
        world_size, rank = training_shard(world_size, rank)  # a replica group reads its own shard
        seed = int(os.environ.get("PL_GLOBAL_SEED", 0))
        generator = generator or training_loader_generator(seed)
        seeded = per_sample_seeding(trainer) and not reads_without_randomness(dataset)
        if seeded:
            dataset = PerSampleSeeded(dataset, seed)
        layout = training_loader_built(trainer, loader.batch_size, len(loader.dataset))
        batch_size = layout.rank_batch_size(rank) if layout is not None else loader.batch_size
        sampler = ResumableDistributedSampler(
            loader.dataset,
            world_size,
            rank,
            shuffle=type(loader.sampler) is RandomSampler,
            seed=seed,  # the seed Lightning's own sampler would use: seed_everything's
            batch_size=loader.batch_size,
            position=lambda: sampler_position(trainer),
            keyed=seeded,
            layout=layout,
        )
        loader_class: type[DataLoader] = ResumableDataLoader
    else:
        batch_size = loader.batch_size
        sampler = UnpaddedDistributedSampler(loader.dataset, world_size, rank)
        loader_class = DataLoader
        # Evaluation draws nothing from the training run's stream: not its samples' randomness, and not the seed its
        # iterator's start draws (`evaluation_loader_generator`).
        seed = int(os.environ.get("PL_GLOBAL_SEED", 0))
        generator = generator or evaluation_loader_generator(seed)
        if per_sample_seeding(trainer) and not reads_without_randomness(dataset):
            dataset = PerSampleSeeded(dataset, seed)
    kept = _options(loader, "collate_fn", "drop_last", *WORKER_OPTIONS, "persistent_workers")
    # DataLoader(in_order=...) exists from torch 2.6 on.
    in_order = {"in_order": loader.in_order} if hasattr(loader, "in_order") else {}
    return loader_class(dataset, batch_size=batch_size, sampler=sampler, generator=generator, **kept, **in_order)


def _positioned_stream(loader: Any, trainer: L.Trainer) -> Any:
    """A training loader we do not rebuild: a stateful stream gets positioned, anything else a notice."""
    positioner = positioner_of(trainer)
    if positioner is None:
        return loader
    dataset = getattr(loader, "dataset", None)
    name = type(dataset).__name__
    if type(loader) is DataLoader and is_stateful_stream(dataset):
        # Starting an iterator draws a seed: from the loader's own generator, not the global one that the checkpoint
        # restores (see training_loader_generator).
        seed = int(os.environ.get("PL_GLOBAL_SEED", 0))
        generator = loader.generator or training_loader_generator(seed)
        positioning: dict[str, Any] = {
            "start": positioner.next_stream_start(),
            "seed": seed if positioner.per_sample_seeding else None,
            "rank": trainer.global_rank,
            "world_size": trainer.world_size,
            "keep": trainer.accumulate_grad_batches + 8,
        }
        if loader.num_workers == 0:
            stream = PositionedStream(dataset, loader.batch_size or 1, **positioning)
            positioner.add_stream(stream)
            kept = _options(loader, "batch_size", "collate_fn", "pin_memory", "drop_last", "timeout")
            return ResumableDataLoader(stream, generator=generator, pin_memory_device=loader.pin_memory_device, **kept)
        if not loader.persistent_workers and getattr(loader, "in_order", True):  # in_order: torch >= 2.6
            # Each worker's copy of the stream is positioned (app.data.positioned_streams).
            workers = WorkerPositionedStream(
                dataset, loader.batch_size or 1, loader.num_workers, loader.collate_fn, loader.drop_last, **positioning
            )
            positioner.add_stream(workers)
            return WorkerStreamLoader(workers, generator=generator, **_options(loader, *WORKER_OPTIONS))
    if is_stateful_stream(dataset):
        positioner.add_notice(stream_in_workers_notice(name, loader, _has_length(dataset)))
    elif isinstance(dataset, IterableDataset):
        positioner.add_notice(
            f"the training stream {name} has no state_dict/load_state_dict: a run resumed mid-epoch restarts it at "
            "the epoch's start (its first samples are seen twice). Fix: implement both (ddp-app saves them per "
            "rank, num_workers: 0), or resume only from epoch-end checkpoints."
        )
    elif not has_state_methods(loader) and not isinstance(
        getattr(loader, "sampler", None), ResumableDistributedSampler
    ):
        positioner.add_notice(
            f"the training loader ({type(loader).__name__} with {type(getattr(loader, 'sampler', None)).__name__}) "
            "is not one ddp-app can position: a run resumed mid-epoch restarts its data at the epoch's first "
            "batch. Fix: a plain DataLoader(shuffle=...) without a sampler, or a loader with "
            "state_dict/load_state_dict."
        )
    return loader


def _has_length(dataset: Any) -> bool:
    try:
        len(dataset)
    except TypeError:
        return False
    return True


def stream_in_workers_notice(name: str, loader: DataLoader, sized: bool) -> str:
    """What a mid-epoch resume does to a stateful stream in loader workers ddp-app does not position
    (`persistent_workers`, `in_order=False`, a DataLoader subclass), and what to do instead: the workers' copies restart
    the stream (tests/fault/test_resume_streams.py)."""
    why = (
        "persistent_workers: true"
        if loader.persistent_workers
        else "in_order=False"
        if not getattr(loader, "in_order", True)
        else f"in a {type(loader).__name__}"
    )
    if sized:
        effect = (
            "the epoch's first N batches (N: those trained before the stop) are trained again and its last N "
            "are left out of that epoch (it ends at len())"
        ) + (
            ", and the persistent workers start the next epoch where their copies stopped"
            if loader.persistent_workers
            else ""
        )
    else:
        effect = (
            "the epoch's first N batches (N: those trained before the stop) are trained again, then the rest "
            "of the epoch: N steps more than the uninterrupted run"
        )
    return (
        f"the training stream {name} runs in {loader.num_workers} loader workers ({why}), whose copies of its "
        f"state ddp-app cannot position: a run resumed mid-epoch restarts it at the epoch's start, so {effect}. "
        "For exact mid-epoch resume: a plain DataLoader with persistent_workers: false and in_order=True (ddp-app "
        "then saves each worker's state_dict and loads it into the same worker), num_workers: 0, or a map-style "
        "Dataset (__getitem__ and __len__: positioned with any num_workers), which python -m app.data.shard can "
        "also write as LitData shards for app.data.StreamingDataModule."
    )


def _resharding(method: Callable[[], Any], run: dict[str, Any], training: bool) -> Callable[[], Any]:
    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        positioner = positioner_of(run["trainer"])
        if training and positioner is not None:  # the loaders built now replace the previous ones
            positioner.training_loaders_rebuilt()
        # Every loader, ours or the user's, resharded or left as returned: its workers forked with a check where
        # CPython needs it (app/data/worker_fork.py).
        return fork_workers_safely(reshard(method(*args, **kwargs), run["trainer"], training))

    setattr(wrapper, WRAPPED, run)
    return wrapper


def shard_all_loaders(trainer: L.Trainer, *sources: L.LightningDataModule | L.LightningModule | None) -> None:
    """Wrap the `*_dataloader` methods of the DataModule and LightningModule of a run (before it starts)."""
    for source in sources:
        if source is None:
            continue
        for name, training in LOADER_METHODS.items():
            method = getattr(source, name)
            run = getattr(method, WRAPPED, None)
            if run is not None:
                run["trainer"] = trainer
            else:
                setattr(source, name, _resharding(method, {"trainer": trainer}, training))
