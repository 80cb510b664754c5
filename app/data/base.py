"""The DataModule base class: dataset splits, per-rank samplers and DataLoader settings."""

from __future__ import annotations

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

from app.data.datasets import DataNotFoundError, LoaderSettings
from app.data.samplers import UnpaddedDistributedSampler, train_sampler
from app.data.seeding import PerSampleSeeded
from app.resume import elastic_layout, per_sample_seeding, sampler_position

__all__ = ["DataNotFoundError", "ResumableDataLoader", "ShardedDataModule"]


class ResumableDataLoader(DataLoader):
    """A DataLoader that tells Lightning it can resume mid-epoch.

    Its position needs no state of its own: `ResumableDistributedSampler` asks the data position
    that `app.resume.ExactResume` keeps in every checkpoint. Implementing `state_dict` /
    `load_state_dict` is how Lightning recognises a resumable loader (otherwise it warns that a
    mid-epoch resume is unreliable).
    """

    def state_dict(self) -> dict[str, int]:
        return {}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        pass


class ShardedDataModule(L.LightningDataModule):
    """Builds the train/val/test datasets in `setup` and shards them over the ranks.

    Subclasses implement `make_splits()`, by calling their function in `app.data.datasets` (which
    the reference trainer calls too); it must be deterministic (same split on every rank and
    every run) and must not write anything, because with `strategy="ddp"` it runs once per rank.
    The datasets are plain attributes (`train_dataset`, `val_dataset`, `test_dataset`) so that the
    reference trainer can use them without a Trainer.

    `batch_size` is per process: the global batch is batch_size x devices x num_nodes.
    """

    def __init__(
        self,
        batch_size: int = 32,
        num_workers: int = 0,
        pin_memory: bool | None = None,
        persistent_workers: bool = False,
        shuffle: bool = True,
        seed: int = 0,
    ) -> None:
        super().__init__()
        LoaderSettings(batch_size, num_workers, pin_memory, persistent_workers, shuffle, seed)  # checks the values
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.pin_memory = pin_memory
        self.persistent_workers = persistent_workers
        self.shuffle = shuffle
        self.seed = seed
        self.train_dataset: Dataset | None = None
        self.val_dataset: Dataset | None = None
        self.test_dataset: Dataset | None = None

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

    def _use_pin_memory(self) -> bool:
        if self.pin_memory is not None:
            return self.pin_memory
        # Pinned host memory only helps host-to-GPU copies; on CPU it is pure overhead.
        if self.trainer is not None:
            return self.trainer.strategy.root_device.type == "cuda"
        return torch.cuda.is_available()

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
        return loader_class(
            dataset,
            batch_size=batch_size or self.batch_size,
            sampler=sampler,
            generator=generator,
            num_workers=self.num_workers,
            pin_memory=self._use_pin_memory(),
            persistent_workers=self.persistent_workers and self.num_workers > 0,
        )

    def train_dataloader(self) -> DataLoader:
        world_size, rank = self._world()
        trainer = self.trainer
        position = None
        dataset = self.train_dataset
        seeded = False
        layout = None
        if trainer is not None:
            position = lambda: sampler_position(trainer)  # noqa: E731
            seeded = per_sample_seeding(trainer)
            if seeded:
                dataset = PerSampleSeeded(dataset, self.seed)
            # Another number of ranks, or a new global batch, than the run started with:
            layout = elastic_layout(trainer, self.batch_size, len(self.train_dataset))
        batch_size = layout.rank_batch_size(rank) if layout is not None else self.batch_size
        sampler = train_sampler(
            self.train_dataset, world_size, rank, self.shuffle, self.seed, batch_size, position, seeded, layout
        )
        # A generator of its own: each epoch's iterator draws a seed from it, not from the global
        # generator, whose state the checkpoint holds. Otherwise that draw falls after an epoch-end
        # checkpoint in an uninterrupted run but before the RNG restore in a resumed one, and
        # dropout masks differ. (Worker processes' streams do not matter: samples are seeded one by one.)
        generator = torch.Generator().manual_seed(self.seed)
        return self._loader(dataset, sampler, ResumableDataLoader, generator, batch_size)

    def val_dataloader(self) -> DataLoader:
        world_size, rank = self._world()
        return self._loader(self.val_dataset, UnpaddedDistributedSampler(self.val_dataset, world_size, rank))

    def test_dataloader(self) -> DataLoader:
        world_size, rank = self._world()
        return self._loader(self.test_dataset, UnpaddedDistributedSampler(self.test_dataset, world_size, rank))

    def predict_dataloader(self) -> DataLoader:
        world_size, rank = self._world()
        return self._loader(self.test_dataset, UnpaddedDistributedSampler(self.test_dataset, world_size, rank))
