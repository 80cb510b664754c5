"""`python -m app.data.shard --config C --out DIR`: write a config's data set as LitData shards.

The config's data module (with `--data.init_args.NAME=VALUE` overrides) is set up as for training and each split written
with LitData's `optimize` into `DIR/train`, `DIR/val`, `DIR/test` (chunks of `--chunk-bytes`), plus
`DIR/ddp_app_shards.json` (what was written from what, an ImageFolder's class names included for the launcher's
num_classes check). `StreamingDataModule` trains from it.

A sample holds an image file's encoded bytes and class index (decoded and augmented in training), or, for any other data
set that draws no random number when read, `dataset[index]` as returned. A data set that augments when read is refused
(its shards would freeze one draw).

The training split is written in a seeded random order (`--seed`), so no chunk is one class; other splits keep their
order. An `--out` with files is refused, and a write that ends short is an error."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import torch
import yaml
from lightning.fabric.utilities.exceptions import MisconfigurationException
from torch.utils.data import Dataset, Subset

from app.data.seeding import reads_without_randomness
from app.data.shard_watch import WriterWatch, no_process_outlives
from app.errors import InvalidConfigError, UserFacingError

SPLITS = ("train", "val", "test")
MANIFEST = "ddp_app_shards.json"
DEFAULT_CHUNK_BYTES = "64MB"  # LitData's advice: chunks of tens of MB stream well from object storage
# A write in which no writer process makes a sample for this long is stuck, and is ended (app/data/shard_watch.py).
DEFAULT_STALL_SECONDS = 300.0


def image_files_of(dataset: Dataset) -> tuple[list[tuple[Path, int]], list[int]] | None:
    """(the image files with their class indices, the indices `dataset` reads of them) for a split of
    `ImageFolderDataModule` (an `ImageFiles`, or Subsets of one); None for any other data set."""
    from app.data.image_datasets import ImageFiles

    indices: list[int] | None = None
    while isinstance(dataset, Subset):
        indices = [int(dataset.indices[i]) for i in indices] if indices is not None else list(dataset.indices)
        dataset = dataset.dataset
    if not isinstance(dataset, ImageFiles):
        return None
    return dataset.samples, indices if indices is not None else list(range(len(dataset.samples)))


def image_record(samples: list[tuple[Path, int]], index: int) -> dict[str, Any]:
    """One image file's sample: its encoded bytes and class index, decoded once here so shards never hold an image
    training cannot decode."""
    from torchvision.io import ImageReadMode, decode_image

    from app.data.image_datasets import UnreadableImageError

    path, target = samples[index]
    try:
        encoded = Path(path).read_bytes()
        decode_image(torch.frombuffer(bytearray(encoded), dtype=torch.uint8), mode=ImageReadMode.RGB)
    except (OSError, RuntimeError, ValueError) as error:
        text = str(error).strip()
        reason = getattr(error, "strerror", None) or (text.splitlines()[0] if text else type(error).__name__)
        raise UnreadableImageError(f"{path} cannot be decoded ({reason})") from None
    return {"image": encoded, "label": int(target)}


class NotedRecord:
    """Makes sample `index`'s record; a failure is written to `notes` and the sample left out (None).

    It never raises: LitData's `optimize` waits forever for a writer whose function raised (0.2.76); `write_split`
    reports the notes. `made` counts samples per writer slot (the watch's heartbeat). The first call in a forked writer
    sets torch to one thread: an OpenMP pool used before the fork hangs the child's first parallel op."""

    def __init__(self, make: Any, notes: Path, made: Any) -> None:
        self.make, self.notes, self.made = make, notes, made
        self.pid = os.getpid()
        self.slot = 0

    def __call__(self, index: int) -> Any:
        from app.data.image_datasets import UnreadableImageError

        if self.pid != os.getpid():  # the first sample in this writer process
            self.pid = os.getpid()
            torch.set_num_threads(1)
            self.slot = int(os.environ.get("DATA_OPTIMIZER_GLOBAL_RANK", 0)) % len(self.made)
        try:
            record = self.make(index)
        except Exception as error:  # reported by write_split: a bad file in one line, a bug with its traceback
            note = {"index": index, "bad_data": isinstance(error, UnreadableImageError), "message": str(error)}
            note["traceback"] = traceback.format_exc()
            (self.notes / f"{index}.json").write_text(json.dumps(note))
            record = None
        self.made[self.slot] += 1
        return record


def dataset_record(dataset: Dataset, index: int) -> Any:
    """One sample as the data set returns it; tensors are made contiguous and owning (a view of a whole split's tensor
    would otherwise be written with the split)."""
    sample = dataset[index]
    if isinstance(sample, torch.Tensor):
        return sample.clone()
    if isinstance(sample, (tuple, list)):
        return tuple(part.clone() if isinstance(part, torch.Tensor) else part for part in sample)
    return sample


def split_writer(dataset: Dataset, name: str) -> tuple[Any, list[int], str]:
    """(the function that makes sample `i`'s record, the indices to write, what a record holds)."""
    files = image_files_of(dataset)
    if files is not None:
        samples, indices = files
        return partial(image_record, samples), indices, "encoded image bytes and class index"
    if not reads_without_randomness(dataset):
        raise InvalidConfigError(
            f"the {name} split ({type(dataset).__name__}) may draw random numbers when a sample is read "
            "(augmentation), and shards would keep one draw forever. Fix: write the shards from the data set "
            "without its random transforms (a TensorDataset of the raw samples, or an ImageFolder), and "
            "augment in training."
        )
    return partial(dataset_record, dataset), list(range(len(dataset))), "the samples as the data set returns them"


def samples_in_index(out: Path) -> int:
    """How many samples the chunks listed in `out`'s LitData index hold (0 for no index, or chunks missing)."""
    try:
        chunks = json.loads((out / "index.json").read_text())["chunks"]
        if not all((out / chunk["filename"]).is_file() for chunk in chunks):
            return 0
        return sum(int(chunk["chunk_size"]) for chunk in chunks)
    except (OSError, ValueError, KeyError, TypeError):
        return 0


@contextlib.contextmanager
def optimize_kept_to_itself(scratch: Path) -> Iterator[None]:
    """Undo what LitData's `optimize` (0.2.76) changes in the calling process, and give it caches of its own.

    - its cache folders (shared /tmp/chunks, /tmp/data, deleted at start): each write gets its own under `scratch`;
    - its SIGINT handler (Ctrl-C would `os._exit(0)`), the multiprocessing start method and the global seeds it sets to
      42 are put back."""
    import multiprocessing
    import random

    import numpy

    variables = {
        "DATA_OPTIMIZER_CACHE_FOLDER": scratch / "chunks",
        "DATA_OPTIMIZER_DATA_CACHE_FOLDER": scratch / "data",
    }
    saved_env = {key: os.environ.get(key) for key in variables}
    interrupt = signal.getsignal(signal.SIGINT)
    start_method = multiprocessing.get_start_method(allow_none=True)
    generators = (random.getstate(), numpy.random.get_state(), torch.get_rng_state())
    os.environ.update({key: str(path) for key, path in variables.items()})
    try:
        yield
    finally:
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        signal.signal(signal.SIGINT, interrupt)
        multiprocessing.set_start_method(start_method, force=True)
        random.setstate(generators[0])
        numpy.random.set_state(generators[1])
        torch.set_rng_state(generators[2])


def write_split(
    dataset: Dataset,
    name: str,
    out: Path,
    chunk_bytes: str,
    chunk_size: int | None,
    workers: int,
    seed: int,
    skip_bad_files: bool = False,
    stall_seconds: float = DEFAULT_STALL_SECONDS,
) -> dict[str, Any]:
    """Write one split with LitData's `optimize`; the record of what was written.

    `optimize` returns without error when its writers died silently, so the index is counted here; and it waits forever
    for a stuck writer, so a `WriterWatch` ends the write. No process LitData forked outlives the call."""
    from multiprocessing.sharedctypes import RawArray

    from litdata import optimize

    record, indices, holds = split_writer(dataset, name)
    if name == "train":
        order = torch.randperm(len(indices), generator=torch.Generator().manual_seed(seed)).tolist()
        indices = [indices[position] for position in order]
    started = time.perf_counter()
    made = RawArray("q", max(1, workers))  # shared memory the forked writers count their samples in
    cause = None
    with tempfile.TemporaryDirectory(prefix="ddp_app_shard_") as scratch, no_process_outlives() as marker:
        notes = Path(scratch) / "notes"
        notes.mkdir()
        watch = WriterWatch(marker, made, stall_seconds) if marker else contextlib.nullcontext()
        try:
            with optimize_kept_to_itself(Path(scratch)), watch:
                optimize(
                    fn=NotedRecord(record, notes, made),
                    inputs=indices,
                    output_dir=str(out),
                    chunk_bytes=None if chunk_size else chunk_bytes,
                    chunk_size=chunk_size,
                    num_workers=max(1, workers),
                    keep_data_ordered=True,  # sample i of the shards is inputs[i]: a rewrite gives the same shards
                    start_method="fork",  # the record functions and the data set need no pickling
                    verbose=False,
                )
        except Exception:
            if getattr(watch, "cause", None) is None:
                raise  # LitData's own error, not one of the watch's kills
        cause = getattr(watch, "cause", None)
        failed = [json.loads(note.read_text()) for note in sorted(notes.iterdir())]
    expected = len(indices) - len(failed)
    if cause is not None:
        raise UserFacingError(
            f"writing the {name} split to {out} ended with {sum(made)} of its {expected} samples made: {cause}, "
            f"so the write was stopped and nothing is kept. Fix: correct the cause and run again (fewer --workers "
            f"if memory ran out; a larger --stall-seconds than {stall_seconds:g} if one sample takes that long)."
        )
    bugs = [note for note in failed if not note["bad_data"]]
    if bugs:
        raise RuntimeError(f"writing sample {bugs[0]['index']} of the {name} split failed:\n{bugs[0]['traceback']}")
    if failed and not skip_bad_files:
        raise InvalidConfigError(
            f"{len(failed)} files of the {name} split cannot be decoded, e.g. {failed[0]['message']}. Fix: remove or "
            "replace them, or add --skip-bad-files to leave them out (they are listed in ddp_app_shards.json)."
        )
    written = samples_in_index(out)
    if written != expected:
        raise UserFacingError(
            f"writing the {name} split to {out} ended with {written} of its {expected} samples: "
            "a LitData writer process ended early (an error above, or killed by a signal: the OOM killer, a kill). "
            "Fix: correct the cause and run again (fewer --workers if memory ran out)."
        )
    size = sum(path.stat().st_size for path in out.iterdir())
    chunks = len(json.loads((out / "index.json").read_text())["chunks"])
    return {
        "samples": written,
        "chunks": chunks,
        "bytes": size,
        "seconds": round(time.perf_counter() - started, 2),
        "holds": holds,
        "shuffled_with_seed": seed if name == "train" else None,
        "left_out": [note["message"] for note in failed],
    }


def module_splits(module: Any) -> dict[str, Dataset]:
    """The data module's train, val and test data sets: ddp-app's modules keep them as `train_dataset`, ...; any other
    module's are its loaders' `dataset` (a test split that is the val split is left out: StreamingDataModule reads val/
    when there is no test/)."""
    splits: dict[str, Dataset] = {}
    for name in SPLITS:
        dataset = getattr(module, f"{name}_dataset", None)
        if dataset is None and not hasattr(module, f"{name}_dataset"):
            try:
                loader = getattr(module, f"{name}_dataloader")()
            except (NotImplementedError, AttributeError, TypeError, RuntimeError, MisconfigurationException):
                loader = None  # a module without this split (Lightning's hooks raise or are missing)
            dataset = getattr(loader[0] if isinstance(loader, (list, tuple)) else loader, "dataset", None)
        if dataset is not None and not any(dataset is kept for kept in splits.values()):
            splits[name] = dataset
    if "train" not in splits:
        raise InvalidConfigError(
            f"{type(module).__name__} gives no training data set (no train_dataset, no train_dataloader().dataset). "
            "Fix: write the shards from a data module that has one."
        )
    return splits


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """`--data.init_args.NAME=VALUE` (or `--data.init_args.NAME VALUE`) applied to the config's `data:` entry."""
    init_args = dict(data.get("init_args") or {})
    prefix = "--data.init_args."
    index = 0
    while index < len(overrides):
        argument = overrides[index]
        if not argument.startswith(prefix):
            raise InvalidConfigError(
                f"unknown argument {argument!r}. Fix: only --data.init_args.NAME=VALUE overrides the config's data."
            )
        name, equals, value = argument[len(prefix) :].partition("=")
        if not equals:
            if index + 1 >= len(overrides):
                raise InvalidConfigError(f"{argument} has no value. Fix: {argument}=VALUE.")
            index += 1
            value = overrides[index]
        init_args[name] = yaml.safe_load(value)
        index += 1
    return {**data, "init_args": init_args}


def build_data_module(config: Path, overrides: list[str]) -> Any:
    """The config's data module, set up for fit and test (its splits as training would read them)."""
    from lightning.pytorch.cli import instantiate_class  # what LightningCLI builds a class_path entry with

    if not config.is_file():
        raise InvalidConfigError(f"--config {config} does not exist. Fix: give a config file (configs/*.yaml).")
    data = (yaml.safe_load(config.read_text()) or {}).get("data")
    if not isinstance(data, dict) or "class_path" not in data:
        raise InvalidConfigError(f"{config} has no data: entry with a class_path. Fix: give a training config.")
    module = instantiate_class((), apply_overrides(data, overrides))
    module.setup("fit")
    return module


def check_out(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise InvalidConfigError(
            f"--out {out} already holds files; nothing is overwritten. Fix: remove it, or give another --out."
        )


def write_shards(
    module: Any,
    out: Path,
    chunk_bytes: str,
    chunk_size: int | None,
    workers: int,
    seed: int,
    source: str,
    skip_bad_files: bool = False,
    stall_seconds: float = DEFAULT_STALL_SECONDS,
) -> dict[str, Any]:
    """Write the module's train, val and test splits (test only where it is not the val split) under `out`."""
    check_out(out)
    splits = module_splits(module)
    manifest: dict[str, Any] = {
        "written": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "source": source,
        "data_module": f"{type(module).__module__}.{type(module).__name__}",
        # StreamingDataModule.classes_on_disk reads these back: the launcher checks the model's num_classes against them
        # before any rank starts.
        "classes": list(getattr(module, "classes", []) or []),
        "num_classes": len(getattr(module, "classes", []) or []) or None,
        "splits": {},
    }
    out.mkdir(parents=True, exist_ok=True)
    try:
        for name, dataset in splits.items():
            if dataset is None:
                continue
            print(f"ddp-app: writing the {name} split ({len(dataset)} samples) to {out / name} ...", flush=True)
            manifest["splits"][name] = write_split(
                dataset, name, out / name, chunk_bytes, chunk_size, workers, seed, skip_bad_files, stall_seconds
            )
            done = manifest["splits"][name]
            print(
                f"ddp-app: {name}: {done['samples']} samples in {done['chunks']} chunks, "
                f"{done['bytes'] / 1e6:.1f} MB, {done['seconds']} s",
                flush=True,
            )
            if done["left_out"]:
                print(f"ddp-app: {name}: left out {len(done['left_out'])} files that cannot be decoded "
                      f"(--skip-bad-files; listed in {out / MANIFEST})", flush=True)  # fmt: skip
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)  # never leave shards that look complete but are not
        raise
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m app.data.shard",
        description="Write a config's data set (train, val, test) as LitData shards for StreamingDataModule.",
        epilog="Any --data.init_args.NAME=VALUE overrides the config's data entry, e.g. "
        "--data.init_args.data_dir=/scratch/imagenet.",
    )
    parser.add_argument("--config", type=Path, required=True, help="a training config whose data: entry is written")
    parser.add_argument("--out", type=Path, required=True, help="the folder to write (must not hold files)")
    parser.add_argument("--chunk-bytes", default=DEFAULT_CHUNK_BYTES, help="chunk size, e.g. 64MB (default)")
    parser.add_argument("--chunk-size", type=int, default=None, help="samples per chunk instead of --chunk-bytes")
    parser.add_argument("--workers", type=int, default=1, help="writer processes (default 1)")
    parser.add_argument("--seed", type=int, default=0, help="the seed of the training split's written order")
    parser.add_argument(
        "--skip-bad-files", action="store_true", help="leave out image files that cannot be decoded (else an error)"
    )
    parser.add_argument(
        "--stall-seconds", type=float, default=DEFAULT_STALL_SECONDS,
        help=f"end the write when no writer makes a sample for this long (default {DEFAULT_STALL_SECONDS:g})",
    )  # fmt: skip
    args, overrides = parser.parse_known_args(argv)
    try:
        check_out(args.out)  # before the data set is read
        module = build_data_module(args.config, overrides)
        source = " ".join([f"--config {args.config}", *overrides])
        manifest = write_shards(
            module,
            args.out,
            args.chunk_bytes,
            args.chunk_size,
            args.workers,
            args.seed,
            source,
            args.skip_bad_files,
            args.stall_seconds,
        )
    except UserFacingError as error:
        print(f"ddp-app: error: {error}", file=sys.stderr)
        return 2
    total = sum(split["samples"] for split in manifest["splits"].values())
    print(f"ddp-app: wrote {total} samples to {args.out}; train from them with --data=app.data.StreamingDataModule "
          f"--data.init_args.data_dir={args.out} (images: configs/streaming_resnet18.yaml)", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
