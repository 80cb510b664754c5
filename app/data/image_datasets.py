"""Your own images in the ImageFolder layout (`train/<class>/<file>`), without Lightning.

`imagefolder_splits` lists and checks the files once per rank; images are decoded and augmented one per `__getitem__` in
the loader workers, seeded per sample (`PerSampleSeeded`), so augmentation does not depend on workers, ranks or resumes.

Bad files (docs/usage.md): found when decoded (`UnreadableImageError`, or with `skip_bad_files` the next file in its
place: `ImageFiles`); `check_files: true` reads every file's first bytes up front, in `SCAN_THREADS` threads, on rank 0
only."""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import Dataset, Subset
from torchvision.io import ImageReadMode, decode_image
from torchvision.transforms import v2

from app.data.datasets import DataNotFoundError, Splits
from app.errors import InvalidConfigError, UserFacingError

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
# What torchvision.io.decode_image reads, by name; other files in a class folder are not images to us.
EXTENSIONS = (".jpg", ".jpeg", ".png", ".gif", ".webp")
SKIP_HINT = "set data.init_args.skip_bad_files=true to skip unreadable images and count them"
# Files whose first bytes `check_files` reads at once: enough to keep a network filesystem busy.
SCAN_THREADS = 32
# What DataLoader's re-raise of a worker's exception puts before the worker's traceback
# (torch.utils.data._utils.worker.ExceptionWrapper: "Caught X in DataLoader worker process N.").
WORKER_PREFIX = "Caught "


class UnreadableImageError(UserFacingError):
    """An image file that cannot be decoded.

    The message names it (the user reads our line after the worker's traceback)."""

    def __init__(self, message: str) -> None:
        lines = message.rstrip().splitlines()
        ours = f"{__name__}.{type(self).__name__}: "
        if message.startswith(WORKER_PREFIX) and lines[-1].startswith(ours):
            message = lines[-1].removeprefix(ours)
        super().__init__(message)


def image_format_problem(path: Path) -> str | None:
    """Why `path` cannot be an image decode_image reads (None: it starts like one); reads 12 bytes only, so a damaged
    body fails at decode."""
    try:
        with path.open("rb") as file:
            head = file.read(12)
    except OSError as error:
        return f"cannot be read ({error.strerror})"
    if not head:
        return "is empty (0 bytes)"
    if (
        head.startswith(b"\xff\xd8\xff")
        or head.startswith(b"\x89PNG")
        or head.startswith(b"GIF8")
        or (head.startswith(b"RIFF") and head[8:12] == b"WEBP")
    ):
        return None
    return f"is not a JPEG, PNG, GIF or WebP image (it starts with {head[:4]!r})"


def class_folders(root: Path) -> list[str]:
    return sorted(entry.name for entry in os.scandir(root) if entry.is_dir() and not entry.name.startswith("."))


def list_images(root: Path, classes: list[str]) -> list[tuple[Path, int]]:
    """(file, class index) for every image under `root/<class>/`, sorted; an empty class folder is an error."""
    samples = []
    for index, name in enumerate(classes):
        files = sorted(
            Path(folder) / file
            for folder, _, names in os.walk(root / name, followlinks=True)
            for file in names
            if file.lower().endswith(EXTENSIONS)
        )
        if not files:
            raise DataNotFoundError(
                f"class folder {root / name} holds no image ({', '.join(EXTENSIONS)}). "
                "Fix: add its images, or remove the folder so that it is not a class."
            )
        samples.extend((file, index) for file in files)
    return samples


def unreadable_files(paths: list[Path]) -> dict[str, str]:
    """{file: why} for the files of `paths` that do not start like an image (`image_format_problem`), read in
    `SCAN_THREADS` threads, in chunks (a future per file would cost a GB for ImageNet)."""
    chunk_size = max(1, min(1024, len(paths) // SCAN_THREADS + 1))
    chunks = [paths[start : start + chunk_size] for start in range(0, len(paths), chunk_size)]

    def scan(chunk: list[Path]) -> list[tuple[str, str]]:
        return [(str(path), problem) for path in chunk if (problem := image_format_problem(path)) is not None]

    with ThreadPoolExecutor(SCAN_THREADS) as pool:
        return {path: problem for found in pool.map(scan, chunks) for path, problem in found}


# How `read_layout` has the files checked: `unreadable_files` here, rank 0's result on every rank under a Trainer
# (app/data/imagefolder.py).
Scan = Callable[[list[Path]], dict[str, str]]


def drop_unreadable(
    samples: list[tuple[Path, int]], problems: dict[str, str], skip_bad_files: bool
) -> tuple[list[tuple[Path, int]], int]:
    """The samples whose files are not in `problems`, and how many were left out (only if `skip_bad_files`; otherwise
    the first bad one is an error that names it)."""
    kept = []
    for path, target in samples:
        problem = problems.get(str(path))
        if problem is None:
            kept.append((path, target))
        elif not skip_bad_files:
            raise UnreadableImageError(f"{path} {problem}. Fix: remove or replace it, or {SKIP_HINT}.")
    return kept, len(samples) - len(kept)


class ImageFiles(Dataset):
    """Image files with their class indices, decoded to RGB and transformed one per `__getitem__`.

    A file that fails to decode is an error naming it, or, with `skip_bad_files`, the next file that decodes takes its
    place: every rank keeps its step count (DDP would wait) and the substitute depends on the index alone (exact
    resume). Replaced files are flagged in `replaced`, a shared-memory tensor (`replaced_files()`)."""

    def __init__(self, samples: list[tuple[Path, int]], transform: v2.Transform, skip_bad_files: bool = False) -> None:
        self.samples = samples
        self.transform = transform
        self.skip_bad_files = skip_bad_files
        # Inherited by forked workers and passed to spawned ones as shared memory (torch.multiprocessing).
        self.replaced = torch.zeros(len(samples) if skip_bad_files else 0, dtype=torch.uint8).share_memory_()

    def replaced_files(self) -> list[Path]:
        """The files replaced by a substitute so far, in this process or its loader workers."""
        return [self.samples[index][0] for index in self.replaced.nonzero().flatten().tolist()]

    def __len__(self) -> int:
        return len(self.samples)

    def _decode(self, path: Path) -> torch.Tensor:
        try:
            return decode_image(str(path), mode=ImageReadMode.RGB)
        except (RuntimeError, OSError) as error:
            reason = str(error).splitlines()[0] if str(error) else type(error).__name__
            # torchvision's decoders start with the C++ place: "decode_jpeg, .../decode_jpeg.cpp:171, Image is ..."
            reason = re.sub(r"^[\w()]+, \S+\.cpp:\d+, ", "", reason)
            raise UnreadableImageError(
                f"{path} cannot be decoded ({reason}). Fix: remove or replace it, or {SKIP_HINT}."
            ) from error

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        for offset in range(len(self.samples)):
            position = (index + offset) % len(self.samples)
            path, target = self.samples[position]
            try:
                image = self._decode(path)
            except UnreadableImageError as error:
                if not self.skip_bad_files:
                    raise
                if not self.replaced[position]:
                    self.replaced[position] = 1
                    problem = error.args[0].split(" Fix:")[0]
                    print(
                        f"ddp-app: {problem} The next image of the split is trained in its place "
                        "(data.init_args.skip_bad_files=true).",
                        file=sys.stderr,
                        flush=True,
                    )
                continue
            return self.transform(image), target
        raise UnreadableImageError(
            f"no image of {len(self.samples)} could be decoded (the first is {self.samples[0][0]}). "
            "Fix: point data.init_args.data_dir at the images (JPEG, PNG, GIF or WebP)."
        )


def train_transform(
    image_size: int,
    crop_scale: tuple[float, float],
    horizontal_flip: bool,
    mean: tuple[float, ...],
    std: tuple[float, ...],
) -> v2.Transform:
    """The standard ImageNet training augmentation: random resized crop, horizontal flip, normalize."""
    steps: list[v2.Transform] = [v2.RandomResizedCrop(image_size, scale=tuple(crop_scale), antialias=True)]
    if horizontal_flip:
        steps.append(v2.RandomHorizontalFlip())
    return v2.Compose([*steps, v2.ToDtype(torch.float32, scale=True), v2.Normalize(list(mean), list(std))])


def eval_transform(image_size: int, resize_size: int, mean: tuple[float, ...], std: tuple[float, ...]) -> v2.Transform:
    """Resize the short side, then the central crop: no randomness."""
    return v2.Compose(
        [
            v2.Resize(resize_size, antialias=True),
            v2.CenterCrop(image_size),
            v2.ToDtype(torch.float32, scale=True),
            v2.Normalize(list(mean), list(std)),
        ]
    )


@dataclass(frozen=True)
class ImageFolderLayout:
    """The class names and the image files of each split, as found on disk."""

    classes: list[str]
    train: list[tuple[Path, int]]
    val: list[tuple[Path, int]] | None  # None: no val/ folder, split off train
    test: list[tuple[Path, int]] | None  # None: no test/ folder, the val split serves
    skipped: int


def find_classes(data_dir: str) -> list[str]:
    """The class names of an ImageFolder, its train/ folder's sub-folders, sorted: one directory listing, no file read,
    so the launcher can afford it before any rank starts (app/run/config_checks.py)."""
    root = Path(data_dir)
    if not (root / "train").is_dir():
        where = f"{root.resolve()} does not exist" if not root.exists() else f"{root.resolve()} has no train/ folder"
        raise DataNotFoundError(
            f"ImageFolder data not found: {where}. Fix: point data.init_args.data_dir at a folder holding "
            "train/<class>/<image> (and optionally val/<class>/<image>)."
        )
    classes = class_folders(root / "train")
    if not classes:
        raise DataNotFoundError(
            f"{root / 'train'} holds no class folder. Fix: put each class's images in train/<class>/."
        )
    return classes


def check_class_count(num_classes: int, classes: list[str], where: str) -> str | None:
    """Refuse a classifier with fewer outputs than the data has classes (the loss would fail at the first batch with a
    target out of range, inside every rank); return a warning line for more outputs than classes (it trains: the extra
    outputs are never a target), None when they agree."""
    found = len(classes)
    if num_classes == found:
        return None
    shown = ", ".join(classes[:3]) + (f", ... {classes[-1]}" if found > 3 else "")
    if num_classes < found:
        raise InvalidConfigError(
            f"model.init_args.num_classes is {num_classes} but {where} holds {found} classes ({shown}): "
            f"targets {num_classes} to {found - 1} would have no output. Fix: --model.init_args.num_classes {found}."
        )
    return (
        f"ddp-app: warning: model.init_args.num_classes is {num_classes} but {where} holds {found} classes "
        f"({shown}): {num_classes - found} outputs are never a target. For a head that fits: "
        f"--model.init_args.num_classes {found}."
    )


def cpu_first_run_advice(precision: str, processes: int | None, cores: int) -> str | None:
    """One line for an image config written for GPUs and run without one: what to change (bf16 is emulated on such CPUs;
    `devices: auto` uses one core). None when it does neither."""
    changes = []
    if precision.startswith("bf16"):
        changes.append(f"precision {precision} -> --trainer.precision 32-true (autocast is slower on most CPUs)")
    if processes == 1 and cores > 1:
        changes.append(
            f"1 process -> --trainer.devices {cores} (each rank runs one thread: one process uses 1 of {cores} cores)"
        )
    if not changes:
        return None
    return (
        f"ddp-app: no GPU here: this image config is written for GPUs. For the CPU: {'; '.join(changes)}; and "
        "smaller images, batches and epochs (docs/usage.md, 'A first run on a CPU')."
    )


def read_layout(
    data_dir: str, skip_bad_files: bool = False, check_files: bool = False, scan: Scan = unreadable_files
) -> ImageFolderLayout:
    """The classes and files under `data_dir`; with `check_files`, `scan` reads every file's first bytes and a bad one
    is an error (or left out and counted, with `skip_bad_files`)."""
    root = Path(data_dir)
    classes = find_classes(data_dir)
    splits: dict[str, list[tuple[Path, int]] | None] = {}
    for split in ("val", "test"):
        if not (root / split).is_dir():
            splits[split] = None
            continue
        found = class_folders(root / split)
        if found != classes:
            missing, extra = sorted(set(classes) - set(found)), sorted(set(found) - set(classes))
            difference = "; ".join(
                part
                for part in (
                    f"missing from {split}/: {', '.join(missing)}" if missing else "",
                    f"not in train/: {', '.join(extra)}" if extra else "",
                )
                if part
            )
            raise DataNotFoundError(
                f"{root / split} has other classes than {root / 'train'} ({difference}). "
                f"Fix: give {split}/ exactly train/'s class folders."
            )
        splits[split] = list_images(root / split, classes)
    train = list_images(root / "train", classes)
    skipped = 0
    if check_files:
        listed = [train, *(files for files in splits.values() if files is not None)]
        problems = scan([path for files in listed for path, _ in files])
        train, skipped = drop_unreadable(train, problems, skip_bad_files)
        for split in ("val", "test"):
            if splits[split] is not None:
                splits[split], count = drop_unreadable(splits[split], problems, skip_bad_files)
                skipped += count
    return ImageFolderLayout(classes, train, splits["val"], splits["test"], skipped)


def imagefolder_splits(
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
) -> Splits:
    """(train, val, test) from `data_dir`: train/ augmented; val/ (or `val_fraction` of train/ when there is no val/)
    and test/ (or the val split) resized and center-cropped."""
    check_split_settings(val_fraction, crop_scale)
    layout = read_layout(data_dir, skip_bad_files, check_files)
    augmented = train_transform(image_size, crop_scale, horizontal_flip, mean, std)
    plain = eval_transform(image_size, resize_size, mean, std)
    return layout_splits(layout, val_fraction, split_seed, augmented, plain, skip_bad_files)


def check_split_settings(val_fraction: float, crop_scale: tuple[float, float]) -> None:
    if not 0 < val_fraction < 1:
        raise InvalidConfigError(f"data.val_fraction must lie in (0, 1), got {val_fraction}.")
    check_crop_scale(crop_scale)


def check_crop_scale(crop_scale: tuple[float, float]) -> None:
    """The RandomResizedCrop area fraction of the training transform (ImageFolder's and the shards')."""
    if not 0 < crop_scale[0] <= crop_scale[1] <= 1:
        raise InvalidConfigError(
            f"data.crop_scale must be [low, high] with 0 < low <= high <= 1, got {list(crop_scale)}."
        )


def layout_splits(
    layout: ImageFolderLayout,
    val_fraction: float,
    split_seed: int,
    augmented: v2.Transform,
    plain: v2.Transform,
    skip_bad_files: bool,
) -> Splits:
    """The datasets of a layout already read: train/ with `augmented`, the evaluation splits with `plain`."""
    train_full = ImageFiles(layout.train, augmented, skip_bad_files)
    if layout.val is not None:
        train: Dataset = train_full
        val: Dataset = ImageFiles(layout.val, plain, skip_bad_files)
    else:
        total = len(layout.train)
        val_size = int(total * val_fraction)
        if not 0 < val_size < total:
            raise InvalidConfigError(
                f"data.val_fraction={val_fraction} of {total} training images leaves no val or no train image. "
                "Fix: a larger fraction, or a val/ folder."
            )
        order = torch.randperm(total, generator=torch.Generator().manual_seed(split_seed)).tolist()
        train = Subset(train_full, order[val_size:])
        val = Subset(ImageFiles(layout.train, plain, skip_bad_files), order[:val_size])
    test = ImageFiles(layout.test, plain, skip_bad_files) if layout.test is not None else val
    return train, val, test
