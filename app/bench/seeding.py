"""`python -m app.bench.seeding [--json FILE]`: what per-sample seeding costs per batch.

Loads the digits and CNN (FakeData 1x28x28) training sets in this process with and without `PerSampleSeeded`,
alternating, and prints the added microseconds per sample and per batch. With `num_workers: 0` this is the worst case
(generators also saved and restored per batch); with workers the seeding runs beside the training step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset

from app.data.datasets import digits_splits
from app.data.seeding import PerSampleSeeded, SampleKey


def seconds_per_epoch(dataset: Dataset, batch_size: int, seeded: bool, epoch: int) -> float:
    source = PerSampleSeeded(dataset, seed=0) if seeded else dataset
    indices = [SampleKey(epoch, index) for index in range(len(dataset))] if seeded else list(range(len(dataset)))
    loader = DataLoader(source, batch_size=batch_size, sampler=indices)
    start = time.perf_counter()
    for _ in loader:
        pass
    return time.perf_counter() - start


def measure(name: str, dataset: Dataset, batch_size: int, repeats: int) -> dict[str, float]:
    plain, seeded = [], []
    for repeat in range(repeats):
        plain.append(seconds_per_epoch(dataset, batch_size, False, repeat))
        seeded.append(seconds_per_epoch(dataset, batch_size, True, repeat))
    samples = len(dataset)
    added = (statistics.median(seeded) - statistics.median(plain)) / samples
    result = {
        "samples": samples,
        "batch_size": batch_size,
        "plain_us_per_sample": statistics.median(plain) / samples * 1e6,
        "seeded_us_per_sample": statistics.median(seeded) / samples * 1e6,
        "added_us_per_sample": added * 1e6,
        "added_ms_per_batch": added * batch_size * 1e3,
    }
    print(
        f"{name}: +{result['added_us_per_sample']:.1f} us per sample, "
        f"+{result['added_ms_per_batch']:.3f} ms per batch of {batch_size}"
    )
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m app.bench.seeding", description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    digits_train = digits_splits(val_fraction=0.15, test_fraction=0.15, split_seed=0)[0]
    from torchvision.datasets import FakeData
    from torchvision.transforms import ToTensor

    fake = FakeData(size=1024, image_size=(1, 28, 28), num_classes=10, transform=ToTensor())
    results = {
        "digits": measure("digits (batch 32)", digits_train, 32, args.repeats),
        "cnn": measure("CNN FakeData 1x28x28 (batch 64)", fake, 64, args.repeats),
    }
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
