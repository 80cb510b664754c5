"""`python -m app.bench.data [--config configs/imagefolder_resnet18.yaml] [--data-dir D] [--json F]`: is data the limit?

The samples per second a training DataLoader delivers here (batches iterated, no model), at each of `--workers` (0, 1, 2
and 4 loader workers), from:

  imagefolder   image files in the ImageFolder layout, read by `ImageFolderDataModule`'s training split:
                decoded and transformed (random resized crop, flip, normalize) in the workers, seeded
                per sample. `--images` small JPEGs in `--classes` classes are generated into a
                temporary folder, or `--data-dir` names your own folder (its train/ split is read).
  litdata       the same images written as LitData shards (chunks of `--chunk-bytes`) and read by
                `StreamingDataModule`'s training split: chunk-aware order, same transforms and seeding
  in memory     the same samples, decoded and transformed once beforehand, as a TensorDataset: the
                ceiling any loader reaches with this batch size and worker count

against the training step of the config's model (one batch of the same size on `--device`, one thread per rank),
measured in the same run. Each round times the model and every (source, workers) cell once, in rotated order; a cell is
one untimed and one timed epoch of a persistent-worker loader. "÷ model" is the loader's samples/s over the model's
within a round: below 1, the model waits for data. The loader is timed alone, so in CPU training, where workers share
the cores, it delivers less.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import yaml
from torch.utils.data import DataLoader, Dataset, TensorDataset
from torchvision.io import encode_jpeg

from app.bench.report import bench_parser, counts, shown_and_saved, spread
from app.cluster.threads import configure_cpu_threads
from app.data.imagefolder import ImageFolderDataModule
from app.data.litdata_shards import StreamingDataModule
from app.data.samplers import ResumableDistributedSampler
from app.data.seeding import PerSampleSeeded, training_loader_generator
from app.data.shard import DEFAULT_CHUNK_BYTES, write_shards
from app.reference.config import instantiate

SOURCES = ("imagefolder", "litdata", "in memory")


def write_image_folder(root: Path, images: int, classes: int, pixels: int, seed: int = 0) -> Path:
    """`images` random JPEGs of `pixels` x `pixels` in `root/train/<class>/`, plus one per class in val/."""
    generator = torch.Generator().manual_seed(seed)
    for split, count in (("train", images), ("val", classes)):
        for index in range(count):
            folder = root / split / f"class_{index % classes}"
            folder.mkdir(parents=True, exist_ok=True)
            image = torch.randint(0, 256, (3, pixels, pixels), dtype=torch.uint8, generator=generator)
            (folder / f"{index:05d}.jpg").write_bytes(encode_jpeg(image, quality=90).numpy().tobytes())
    return root


def image_folder_module(data_dir: Path, data_options: dict[str, Any], batch_size: int) -> ImageFolderDataModule:
    """The config's ImageFolderDataModule (its transforms) on `data_dir`, with this batch size."""
    options = {key: value for key, value in data_options.items() if key not in ("data_dir", "batch_size")}
    module = ImageFolderDataModule(data_dir=str(data_dir), batch_size=batch_size, **options)
    module.setup("fit")
    return module


def shards_module(
    module: ImageFolderDataModule, data_options: dict[str, Any], out: Path, chunk_bytes: str
) -> StreamingDataModule:
    """`module`'s splits written as LitData shards under `out`, read back by a StreamingDataModule with the same
    transforms and batch size."""
    write_shards(module, out, chunk_bytes, None, workers=1, seed=0, source="python -m app.bench.data")
    keys = ("image_size", "crop_scale", "horizontal_flip", "resize_size", "mean", "std", "seed")
    options = {key: value for key, value in data_options.items() if key in keys}
    streaming = StreamingDataModule(data_dir=str(out), batch_size=module.batch_size, **options)
    streaming.setup("fit")
    return streaming


def training_loader(module: ImageFolderDataModule | StreamingDataModule, workers: int) -> DataLoader:
    """The training loader the module gives a one-rank Trainer: per-sample seeded, shuffled (for shards, in the
    chunk-aware order)."""
    dataset = module.train_dataset
    sampler = ResumableDistributedSampler(dataset, 1, 0, True, module.seed, module.batch_size, keyed=True)
    return DataLoader(
        PerSampleSeeded(dataset, module.seed),
        batch_size=module.batch_size,
        sampler=sampler,
        generator=training_loader_generator(module.seed),
        num_workers=workers,
        persistent_workers=workers > 0,
    )


def in_memory_dataset(dataset: Dataset) -> TensorDataset:
    """Every sample of `dataset` read once (decoded and transformed) into two tensors."""
    images, targets = zip(*(dataset[index] for index in range(len(dataset))), strict=True)
    return TensorDataset(torch.stack(images), torch.tensor(targets))


def in_memory_loader(dataset: TensorDataset, batch_size: int, workers: int, seed: int) -> DataLoader:
    return DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=True,
        generator=torch.Generator().manual_seed(seed),
        num_workers=workers,
        persistent_workers=workers > 0,
    )


def timed_epoch_samples_per_s(loader: DataLoader) -> float:
    """One untimed epoch (workers start, files enter the page cache), then one timed: samples/s."""
    samples, elapsed = 0, 0.0
    for epoch in (0, 1):  # the second epoch's figures are the ones kept
        if hasattr(loader.sampler, "set_epoch"):
            loader.sampler.set_epoch(epoch)
        samples = 0
        started = time.perf_counter()
        for inputs, _ in loader:
            samples += len(inputs)
        elapsed = time.perf_counter() - started
    return samples / elapsed


def model_step_ms(config: dict[str, Any], batch: tuple[torch.Tensor, torch.Tensor], device: str, steps: int) -> float:
    """The median time of the config's training step (forward, loss, backward, optimizer step) on `batch`."""
    model = instantiate(config["model"]).to(device)
    net, criterion = model.net, model.criterion
    optimizer = instantiate(config["optimizer"], net.parameters())
    inputs, targets = (tensor.to(device) for tensor in batch)
    times = []
    for step in range(steps + 1):  # the first step is a warm-up (allocator, lazy initialisation)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        started = time.perf_counter()
        optimizer.zero_grad()
        criterion(net(inputs), targets).backward()
        optimizer.step()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        if step:
            times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)


def cells(workers: list[int]) -> list[tuple[str, int]]:
    return [(source, count) for source in SOURCES for count in workers]


def measure(args: argparse.Namespace, data_dir: Path, scratch: Path) -> dict[str, Any]:
    config = yaml.safe_load(args.config.read_text())
    data_options = dict(config["data"].get("init_args") or {})
    if args.image_size is not None:
        data_options["image_size"] = args.image_size
    module = image_folder_module(data_dir, data_options, args.batch_size)
    config["model"].setdefault("init_args", {})["num_classes"] = len(module.classes)
    shards = shards_module(module, data_options, scratch / "shards", args.chunk_bytes)
    memory = in_memory_dataset(PerSampleSeeded(module.train_dataset, module.seed))
    batch = (memory.tensors[0][: args.batch_size], memory.tensors[1][: args.batch_size])
    order = cells(args.workers)
    step_ms: list[float] = []
    samples_per_s: dict[tuple[str, int], list[float]] = {cell: [] for cell in order}
    for round_index in range(args.rounds):
        step_ms.append(model_step_ms(config, batch, args.device, args.model_steps))
        shift = round_index % len(order)
        for source, workers in order[shift:] + order[:shift]:
            if source == "imagefolder":
                loader = training_loader(module, workers)
            elif source == "litdata":
                loader = training_loader(shards, workers)
            else:
                loader = in_memory_loader(memory, args.batch_size, workers, module.seed)
            samples_per_s[(source, workers)].append(timed_epoch_samples_per_s(loader))
            del loader  # stops its persistent workers before the next cell starts its own
    model_samples_per_s = [args.batch_size / ms * 1e3 for ms in step_ms]
    return {
        "model": {
            "class_path": config["model"]["class_path"],
            "device": args.device,
            "step_ms": spread(step_ms),
            "samples_per_s": spread(model_samples_per_s),
        },
        "train_images": len(module.train_dataset),
        "classes": len(module.classes),
        "loaders": {
            source: {
                str(workers): {
                    "samples_per_s": spread(samples_per_s[(source, workers)]),
                    "over_model": spread(
                        [
                            loader / model
                            for loader, model in zip(samples_per_s[(source, workers)], model_samples_per_s, strict=True)
                        ]
                    ),
                }
                for workers in args.workers
            }
            for source in SOURCES
        },
    }


def print_table(results: dict[str, Any]) -> None:
    model = results["model"]
    print(
        f"model {model['class_path'].rpartition('.')[2]} on {model['device']}: "
        f"{model['step_ms']['median']:.1f} ms per step, {model['samples_per_s']['median']:.0f} samples/s"
    )
    print(f"{'source':<13}{'workers':>8}{'samples/s':>11}{'÷ model':>9}   (median [min, max] over rounds)")
    for source, by_workers in results["loaders"].items():
        for workers, figures in by_workers.items():
            rate, ratio = figures["samples_per_s"], figures["over_model"]
            print(
                f"{source:<13}{workers:>8}{rate['median']:>11.0f}{ratio['median']:>9.2f}"
                f"   [{ratio['min']:.2f}, {ratio['max']:.2f}]"
            )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = bench_parser("python -m app.bench.data", __doc__, "configs/imagefolder_resnet18.yaml")
    parser.add_argument("--data-dir", type=Path, default=None, help="your own ImageFolder (else generated)")
    parser.add_argument("--images", type=int, default=512, help="generated training images")
    parser.add_argument("--classes", type=int, default=4, help="generated classes")
    parser.add_argument("--pixels", type=int, default=32, help="generated images' side")
    parser.add_argument("--image-size", type=int, default=32, help="the training crop (config: data.image_size)")
    parser.add_argument("--batch-size", type=int, default=32, help="per-rank batch")
    parser.add_argument(
        "--workers", type=lambda text: counts(text, 0, "--workers"), default=[0, 1, 2, 4], help="e.g. 0,1,2,4"
    )
    parser.add_argument("--chunk-bytes", default=DEFAULT_CHUNK_BYTES, help="LitData chunk size (default 64MB)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model-steps", type=int, default=5, help="timed model steps per round")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args(argv)
    threads = configure_cpu_threads()
    # More workers than cores is what the bench measures on a small machine, not a mistake to warn of.
    warnings.filterwarnings("ignore", message="This DataLoader will create", category=UserWarning)
    with tempfile.TemporaryDirectory(prefix="bench_data_") as scratch:
        data_dir = args.data_dir
        if data_dir is None:
            data_dir = write_image_folder(Path(scratch) / "images", args.images, args.classes, args.pixels)
        results = measure(args, data_dir, Path(scratch))
    results = {
        "command": " ".join(["python -m app.bench.data", *(argv if argv is not None else sys.argv[1:])]),
        "machine": {"cpu_count": os.cpu_count(), "threads_per_rank": threads, "cuda": torch.cuda.is_available()},
        "generated": None if args.data_dir is not None else {"pixels": args.pixels, "format": "JPEG"},
        "chunk_bytes": args.chunk_bytes,
        "batch_size": args.batch_size,
        "image_size": args.image_size,
        "rounds": args.rounds,
        **results,
    }
    return shown_and_saved(results, args.json, print_table)


if __name__ == "__main__":
    main()
