"""`python -m app.bench.compression_accuracy [--json docs/compression_accuracy.json]`

What gradient compression costs in accuracy: the final validation accuracy after the same epochs with each
`gradient_compression` setting, on two real workloads (2 ranks, `ddp-app fit`, the same seeds):

- digits: `configs/digits.yaml` as shipped (MLP 64-256-10, 15 epochs, Adam);
- CNN: `configs/bench_cnn.yaml`'s two-convolution network on the scikit-learn digits upscaled to 28x28 and written as
  MNIST files (MNIST itself cannot be downloaded here).
"""

from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from sklearn.datasets import load_digits

SETTINGS = {
    "none": [],
    "fp16": ["--gradient_compression.method=fp16"],
    "bf16": ["--gradient_compression.method=bf16"],
    "powersgd rank 1": ["--gradient_compression.method=powersgd", "--gradient_compression.powersgd_rank=1"],
    "powersgd rank 2": ["--gradient_compression.method=powersgd", "--gradient_compression.powersgd_rank=2"],
    "powersgd rank 4": ["--gradient_compression.method=powersgd", "--gradient_compression.powersgd_rank=4"],
}
CNN_EPOCHS = 8


def write_digits_as_mnist(root: Path) -> None:
    """sklearn's 1,797 8x8 digits as 28x28 MNIST idx files (train: 1,500, test: 297)."""
    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) * (255 / 16)
    images = torch.nn.functional.interpolate(images, size=(28, 28), mode="bilinear", align_corners=False)
    images = images.squeeze(1).clamp(0, 255).round().to(torch.uint8).numpy()
    labels = digits.target.astype(np.uint8)
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    for prefix, part in (("train", slice(0, 1500)), ("t10k", slice(1500, None))):
        for kind, array in (("images-idx3", images[part]), ("labels-idx1", labels[part])):
            header = bytes([0, 0, 0x08, array.ndim]) + b"".join(int(n).to_bytes(4, "big") for n in array.shape)
            (raw / f"{prefix}-{kind}-ubyte").write_bytes(header + array.tobytes())


def workloads(data_dir: Path) -> dict[str, list[str]]:
    cnn_data = [
        "--data=app.data.MNISTDataModule", f"--data.init_args.data_dir={data_dir}", "--data.init_args.download=false",
        "--data.init_args.val_size=300", "--data.init_args.batch_size=32", "--data.init_args.num_workers=0",
        "--data.init_args.seed=0",
    ]  # fmt: skip
    return {
        "digits MLP": ["--config", "configs/digits.yaml"],
        "digits CNN 28x28": ["--config", "configs/bench_cnn.yaml", *cnn_data, f"--trainer.max_epochs={CNN_EPOCHS}"],
    }


def final_val_acc(root: Path) -> float:
    (metrics,) = root.rglob("metrics.csv")
    with metrics.open() as file:
        values = [row["val_acc"] for row in csv.DictReader(file) if row.get("val_acc")]
    return float(values[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m app.bench.compression_accuracy", description=__doc__)
    parser.add_argument("--json", type=Path, default=Path("docs/compression_accuracy.json"))
    args = parser.parse_args(argv)
    results: dict[str, dict[str, float]] = {}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="compression-accuracy-") as work:
        write_digits_as_mnist(Path(work) / "data")
        for workload, base in workloads(Path(work) / "data").items():
            results[workload] = {}
            for setting, flags in SETTINGS.items():
                root = Path(work) / f"{workload}-{setting}".replace(" ", "_")
                command = [
                    sys.executable, "-m", "app", "fit", *base, *flags, f"--trainer.default_root_dir={root}",
                    "--trainer.enable_progress_bar=false",
                ]  # fmt: skip
                result = subprocess.run(command, capture_output=True, text=True)
                if result.returncode != 0:
                    raise SystemExit(f"{workload} / {setting} failed:\n{result.stderr[-3000:]}")
                results[workload][setting] = final_val_acc(root)
                none = results[workload]["none"]
                accuracy = results[workload][setting]
                print(f"{workload:<18} {setting:<16} val_acc {accuracy:.4f}  ({100 * (accuracy - none):+.2f} points)")
    report = {
        "world_size": 2,
        "epochs": {"digits MLP": 15, "digits CNN 28x28": CNN_EPOCHS},
        "val_acc": results,
        "points_vs_none": {
            workload: {setting: round(100 * (value - accuracies["none"]), 2) for setting, value in accuracies.items()}
            for workload, accuracies in results.items()
        },
        "seconds": round(time.perf_counter() - started, 1),
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2))
    print(f"JSON: {args.json}")


if __name__ == "__main__":
    main()
