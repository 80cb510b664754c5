"""Your own images in the ImageFolder layout (ImageNet's on disk): `data_dir/train/<class>/<file>`.

The files are listed and checked in `setup` (every rank, the same way, nothing written) and decoded
and augmented in the DataLoader workers; the datasets are built in `app.data.image_files`.
"""

from __future__ import annotations

from typing import Any

from torch.utils.data import Dataset

from app.data.base import ShardedDataModule
from app.data.image_files import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    check_split_settings,
    eval_transform,
    layout_splits,
    read_layout,
    train_transform,
)


class ImageFolderDataModule(ShardedDataModule):
    """Images in `data_dir/train/<class>/` and `data_dir/val/<class>/` (JPEG, PNG, GIF, WebP).

    Without a val/ folder, `val_fraction` of train/ is held out (a permutation seeded by
    `split_seed`); a test/ folder is the test split, else the val split is. Training images get a
    random resized crop to `image_size` (area fraction in `crop_scale`) and, if `horizontal_flip`, a
    random flip; evaluation images are resized to `resize_size` on their short side and center-cropped
    to `image_size`. Both are normalized with `mean` and `std`. The random draws are seeded per
    sample from (seed, epoch, index), so resumes are exact with any `num_workers`.

    Every file's first bytes are checked in `setup`: an unreadable one is an error that names it, or,
    with `skip_bad_files`, is left out and counted in one line.
    """

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
        self.classes: list[str] = []
        self.skipped_files = 0

    def make_splits(self) -> tuple[Dataset, Dataset, Dataset]:
        layout = read_layout(self.data_dir, self.skip_bad_files)
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
