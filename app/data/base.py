"""The DataModule base class: dataset splits, per-rank samplers and DataLoader settings."""

from __future__ import annotations

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

from app.data.datasets import DataNotFoundError, LoaderSettings, default_num_workers
from app.data.on_device import TensorBatchLoader, in_memory_tensors, materialize
from app.data.positioning import per_sample_seeding, sampler_position, training_loader_built
from app.data.samplers import ResumableDistributedSampler, UnpaddedDistributedSampler
from app.data.seeding import (
    PerSampleSeeded,
    evaluation_loader_generator,
    reads_without_randomness,
    training_loader_generator,
)
from app.parallel.fault_tolerance import training_shard

__all__ = ["DataNotFoundError", "ResumableDataLoader", "ShardedDataModule"]


class ResumableDataLoader(DataLoader):
    """A DataLoader that tells Lightning it can resume mid-epoch (`state_dict` / `load_state_dict`).

    The position lives in the run's `TrainingPositioner` (app/data/positioning.py), not here."""

    def state_dict(self) -> dict[str, int]:
        return {}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        pass


class ShardedDataModule(L.LightningDataModule):
    """Builds the train/val/test datasets in `setup` and shards them over the ranks.

    Subclasses implement `make_splits()` with their function in `app.data.datasets`: deterministic and writing nothing
    (it runs on every rank). The datasets are plain attributes (`train_dataset`, `val_dataset`, `test_dataset`) for the
    reference trainer.

    `batch_size` is per process: the global batch is batch_size x devices x num_nodes. `num_workers: null` (the default)
    sizes the loader workers to the machine (`default_num_workers`). `on_device: true` keeps the splits whole on the
    training device and batches there (app/data/on_device.py): for data that fits in GPU memory, without random
    augmentation; same samples, order and resume position."""

    def __init__(
        self,
        batch_size: int = 32,
        num_workers: int | None = None,
        pin_memory: bool | None = None,
        persistent_workers: bool = False,
        shuffle: bool = True,
        seed: int = 0,
        on_device: bool = False,
    ) -> None:
        super().__init__()
        # checks the values
        LoaderSettings(batch_size, num_workers, pin_memory, persistent_workers, shuffle, seed, on_device)
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.pin_memory = pin_memory
        self.persistent_workers = persistent_workers
        self.shuffle = shuffle
        self.seed = seed
        self.on_device = on_device
        self.train_dataset: Dataset | None = None
        self.val_dataset: Dataset | None = None
        self.test_dataset: Dataset | None = None
        self._on_device: dict[str, tuple[torch.Tensor, ...]] = {}  # split name -> its tensors on the device

    def make_splits(self) -> tuple[Dataset, Dataset, Dataset]:
        """Return (train, val, test) datasets."""
        raise NotImplementedError

    def setup(self, stage: str | None = None) -> None:
        if self.train_dataset is None:
            self.train_dataset, self.val_dataset, self.test_dataset = self.make_splits()

    def _world(self) -> tuple[int, int]:
        """(world size, global rank) from the Trainer when attached, else from torch.distributed."""
        if self.trainer is not None:
            return self.trainer.world_size, self.trainer.global_rank
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return torch.distributed.get_world_size(), torch.distributed.get_rank()
        return 1, 0

    def _on_gpu(self) -> bool:
        if self.trainer is not None:
            return self.trainer.strategy.root_device.type == "cuda"
        return torch.cuda.is_available()

    def _use_pin_memory(self) -> bool:
        # Pinned host memory only helps host-to-GPU copies; on CPU it is pure overhead. Unpinned, a copy marked
        # non_blocking (as Lightning's are) still makes the CPU wait for it.
        return self.pin_memory if self.pin_memory is not None else self._on_gpu()

    def _num_workers(self, dataset: Dataset) -> int:
        if self.num_workers is not None:
            return self.num_workers
        local_ranks = self.trainer.num_devices if self.trainer is not None else 1
        raw = dataset.dataset if isinstance(dataset, PerSampleSeeded) else dataset
        return default_num_workers(raw, self._on_gpu(), local_ranks)

    def _device_tensors(self, split: str, dataset: Dataset | None) -> tuple[torch.Tensor, ...]:
        """The split's tensors on the training device, read and copied once per run."""
        if dataset is None:
            raise RuntimeError("setup() must run before a dataloader is requested.")
        if split not in self._on_device:
            device = self.trainer.strategy.root_device if self.trainer is not None else torch.device("cpu")
            self._on_device[split] = tuple(tensor.to(device) for tensor in materialize(dataset, split))
        return self._on_device[split]

    def _loader(
        self,
        dataset: Dataset | None,
        sampler: torch.utils.data.Sampler,
        loader_class: type[DataLoader] = DataLoader,
        generator: torch.Generator | None = None,
        batch_size: int | None = None,
    ) -> DataLoader:
        if dataset is None:
            raise RuntimeError("setup() must run before a dataloader is requested.")
        num_workers = self._num_workers(dataset)
        return loader_class(
            dataset,
            batch_size=batch_size or self.batch_size,
            sampler=sampler,
            generator=generator,
            num_workers=num_workers,
            pin_memory=self._use_pin_memory(),
            persistent_workers=self.persistent_workers and num_workers > 0,
        )

    def train_dataloader(self) -> DataLoader | TensorBatchLoader:
        world_size, rank = training_shard(*self._world())  # a replica group reads its own shard
        trainer = self.trainer
        position = None
        dataset = self.train_dataset
        seeded = False
        layout = None
        if trainer is not None:
            position = lambda: sampler_position(trainer)  # noqa: E731
            seeded = per_sample_seeding(trainer) and not reads_without_randomness(dataset)
            if seeded:
                dataset = PerSampleSeeded(dataset, self.seed)
            # Another number of ranks, or a new global batch, than the run started with:
            layout = training_loader_built(trainer, self.batch_size, len(self.train_dataset))
        batch_size = layout.rank_batch_size(rank) if layout is not None else self.batch_size
        sampler = ResumableDistributedSampler(
            self.train_dataset, world_size, rank, self.shuffle, self.seed, batch_size, position, seeded, layout
        )
        if self.on_device:  # no per-sample randomness to seed: `materialize` refuses augmented splits
            return TensorBatchLoader(self._device_tensors("train", self.train_dataset), sampler, batch_size)
        split = in_memory_tensors(self.train_dataset)
        if split is not None and self._num_workers(self.train_dataset) == 0:
            # The reference trainer reads the same splits the same way (app/reference/train.py).
            pin_memory = self._use_pin_memory()
            return TensorBatchLoader(split.tensors, sampler, batch_size, pin_memory, split.rows)
        generator = training_loader_generator(self.seed)
        return self._loader(dataset, sampler, ResumableDataLoader, generator, batch_size)

    def _evaluation_loader(self, split: str, dataset: Dataset | None) -> DataLoader | TensorBatchLoader:
        world_size, rank = self._world()
        sampler = UnpaddedDistributedSampler(dataset, world_size, rank)
        if self.on_device:
            return TensorBatchLoader(self._device_tensors(split, dataset), sampler, self.batch_size)
        return self._loader(dataset, sampler, generator=evaluation_loader_generator(self.seed))

    def val_dataloader(self) -> DataLoader | TensorBatchLoader:
        return self._evaluation_loader("val", self.val_dataset)

    def test_dataloader(self) -> DataLoader | TensorBatchLoader:
        return self._evaluation_loader("test", self.test_dataset)

    def predict_dataloader(self) -> DataLoader:
        # Always a DataLoader: the prediction writer orders the predictions by its batch indices.
        world_size, rank = self._world()
        sampler = UnpaddedDistributedSampler(self.test_dataset, world_size, rank)
        return self._loader(self.test_dataset, sampler, generator=evaluation_loader_generator(self.seed))
