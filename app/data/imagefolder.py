"""Your own images in the ImageFolder layout (ImageNet's on disk): `data_dir/train/<class>/<file>`.

The files are listed in `setup` (every rank, the same way, nothing written) and decoded and augmented in the DataLoader
workers; the datasets are built in `app.data.image_datasets`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch.utils.data import Dataset, Subset

from app.data.base import ShardedDataModule
from app.data.image_datasets import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    ImageFiles,
    check_split_settings,
    eval_transform,
    find_classes,
    layout_splits,
    read_layout,
    train_transform,
    unreadable_files,
)


class ImageFolderDataModule(ShardedDataModule):
    """Images in `data_dir/train/<class>/` and `data_dir/val/<class>/` (JPEG, PNG, GIF, WebP).

    Without val/, `val_fraction` of train/ is held out (seeded by `split_seed`); test/ is the test split, else val.
    Training: a random resized crop to `image_size` (area in `crop_scale`) and, with `horizontal_flip`, a random flip;
    evaluation: resize the short side to `resize_size`, center-crop to `image_size`; both normalized with `mean` and
    `std`. Draws are seeded per sample, so resumes are exact with any `num_workers`.

    Bad files: a file that fails to decode stops the run with one line naming it, or with `skip_bad_files` the next
    image takes its place (counted per rank at the end). `check_files: true` reads every file's first bytes in `setup`
    on rank 0: a bad one is an error, or with `skip_bad_files` left out."""

    def __init__(
        self,
        data_dir: str = "data/imagenet",
        val_fraction: float = 0.1,
        split_seed: int = 0,
        image_size: int = 224,
        crop_scale: tuple[float, float] = (0.08, 1.0),
        horizontal_flip: bool = True,
        resize_size: int = 256,
        mean: tuple[float, ...] = IMAGENET_MEAN,
        std: tuple[float, ...] = IMAGENET_STD,
        skip_bad_files: bool = False,
        check_files: bool = False,
        **loader_options: Any,
    ) -> None:
        super().__init__(**loader_options)  # batch_size, num_workers, ...: see ShardedDataModule
        check_split_settings(val_fraction, tuple(crop_scale))
        self.data_dir = data_dir
        self.val_fraction = val_fraction
        self.split_seed = split_seed
        self.image_size = image_size
        self.crop_scale = tuple(crop_scale)
        self.horizontal_flip = horizontal_flip
        self.resize_size = resize_size
        self.mean = tuple(mean)
        self.std = tuple(std)
        self.skip_bad_files = skip_bad_files
        self.check_files = check_files
        self.classes: list[str] = []
        self.skipped_files = 0

    @staticmethod
    def classes_on_disk(data_dir: str) -> list[str]:
        """The classes a run on `data_dir` finds (its train/ folder's sub-folders), read without opening a file: the
        launcher checks them against the model's `num_classes` before any rank starts (app/run/config_checks.py). A
        `data_dir` without train/ is an error that says so."""
        return find_classes(data_dir)

    def _scan_on_rank_zero(self, paths: list[Path]) -> dict[str, str]:
        """`unreadable_files` on rank 0, its result on every rank: one pass over a shared filesystem per run, not one
        per rank. Every rank calls this at the same point of `setup` (the broadcast is a collective): the listing before
        it is the same everywhere."""
        trainer = self.trainer
        if trainer is None or trainer.world_size == 1:
            return unreadable_files(paths)
        problems = unreadable_files(paths) if trainer.global_rank == 0 else None
        return trainer.strategy.broadcast(problems, src=0)

    def make_splits(self) -> tuple[Dataset, Dataset, Dataset]:
        layout = read_layout(self.data_dir, self.skip_bad_files, self.check_files, self._scan_on_rank_zero)
        self.classes = layout.classes
        self.skipped_files = layout.skipped
        if layout.skipped and (self.trainer is None or self.trainer.global_rank == 0):
            print(
                f"ddp-app: skipped {layout.skipped} unreadable image files in {self.data_dir} "
                "(data.init_args.skip_bad_files=true)",
                flush=True,
            )
        augmented = train_transform(self.image_size, self.crop_scale, self.horizontal_flip, self.mean, self.std)
        plain = eval_transform(self.image_size, self.resize_size, self.mean, self.std)
        return layout_splits(layout, self.val_fraction, self.split_seed, augmented, plain, self.skip_bad_files)

    def teardown(self, stage: str) -> None:
        """At the end of a fit (validate, test, predict) with `skip_bad_files`: the files this rank replaced, in one
        line (each rank decodes only its own share of the samples)."""
        if not self.skip_bad_files:
            return
        splits = (self.train_dataset, self.val_dataset, self.test_dataset)
        replaced = sorted({str(path) for split in splits for path in replaced_files(split)})
        if not replaced:
            return
        multi_rank = self.trainer is not None and self.trainer.world_size > 1
        rank = f"rank {self.trainer.global_rank}: " if multi_rank else ""
        shown = ", ".join(replaced[:5]) + (f" and {len(replaced) - 5} more" if len(replaced) > 5 else "")
        print(
            f"ddp-app: {rank}{len(replaced)} unreadable image files were replaced by the next image of their "
            f"split (data.init_args.skip_bad_files=true): {shown}. Fix: remove or replace them.",
            flush=True,
        )


def replaced_files(dataset: Dataset | None) -> list[Path]:
    """The files the `ImageFiles` under a split (a `Subset` of one without a val/ folder) replaced."""
    while isinstance(dataset, Subset):
        dataset = dataset.dataset
    return dataset.replaced_files() if isinstance(dataset, ImageFiles) else []
