"""`python -m app.bench.diloco_quality [--out docs/diloco_quality.json]`: what strategy diloco costs in quality.

Trains each model with `strategy: ddp` and with `strategy: diloco` at sync_every (H) 1, 10 and 50, at
H 10 in 2 fragments, and at H 10 and 50 with the outer step at face value (`avg`: outer lr 1 without
momentum, the replicas' plain average), on 2 and 4 ranks, each for the same number of samples (the same epochs: the
per-rank batch is the config's, so 4 ranks take half the steps of 2), one after the other in this
process's machine, and writes the validation metric of every run (the final one, the best and every
epoch's) to a JSON (and a plot beside
it, `.png`) that docs/diloco.md quotes (tests/test_docs_numbers.py checks it):

- digits (configs/digits.yaml: the MLP, Adam, 15 epochs): validation accuracy;
- the GPT of configs/gpt_fsdp.yaml (AdamW, 25 epochs): validation loss. Its 512 sequences are
  memorised long before 25 epochs (DDP's validation loss is lowest at epoch 3 and rises after), so
  its figure of merit is the best epoch's, not the last.

The inner optimizer and its schedule are each config's own; the outer step is the paper's (Nesterov
SGD, lr 0.7, momentum 0.9) but in the `avg` columns. Step counts divide by 50, so every run ends on an outer step.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

MODELS = {
    "digits": {"config": "configs/digits.yaml", "metric": "val_acc", "epochs": 15, "higher_is_better": True},
    "gpt": {"config": "configs/gpt_fsdp.yaml", "metric": "val_loss", "epochs": 25, "higher_is_better": False},
}
# name -> the strategy arguments (after --trainer.strategy)
VARIANTS: dict[str, list[str]] = {
    "ddp": ["--trainer.strategy=ddp"],
    "diloco H1": ["--trainer.strategy=diloco", "--trainer.strategy.init_args.sync_every=1"],
    "diloco H10": ["--trainer.strategy=diloco", "--trainer.strategy.init_args.sync_every=10"],
    "diloco H50": ["--trainer.strategy=diloco", "--trainer.strategy.init_args.sync_every=50"],
    "diloco H10 F2": [
        "--trainer.strategy=diloco",
        "--trainer.strategy.init_args.sync_every=10",
        "--trainer.strategy.init_args.fragments=2",
    ],
    # The outer step at face value (lr 1, no momentum): the replicas' plain average (local SGD).
    **{
        f"avg H{every}": [
            "--trainer.strategy=diloco",
            f"--trainer.strategy.init_args.sync_every={every}",
            "--trainer.strategy.init_args.outer_lr=1.0",
            "--trainer.strategy.init_args.outer_momentum=0.0",
        ]
        for every in (10, 50)
    },
}
WORLD_SIZES = (2, 4)


def logged_values(root: Path, metric: str) -> list[float]:
    """Every logged value of `metric` in the run's metrics.csv (one per validation), in order."""
    (path,) = sorted(root.glob("lightning_logs/*/metrics.csv"))
    with path.open(newline="") as file:
        values = [float(row[metric]) for row in csv.DictReader(file) if row.get(metric)]
    if not values:
        raise RuntimeError(f"{path} logs no {metric}")
    return values


def run(model: str, variant: str, world_size: int, work: Path) -> dict[str, Any]:
    spec = MODELS[model]
    root = work / f"{model}-{variant.replace(' ', '_')}-{world_size}"
    args = [sys.executable, "-m", "app", "fit", "--config", spec["config"], *VARIANTS[variant],
            f"--trainer.devices={world_size}", f"--trainer.max_epochs={spec['epochs']}", "--trainer.accelerator=cpu",
            f"--trainer.default_root_dir={root}", "--trainer.enable_progress_bar=false"]  # fmt: skip
    env = {**os.environ, "DDP_APP_ALLOW_OVERSUBSCRIBE": "1", "OMP_NUM_THREADS": "1"}
    started = time.perf_counter()
    result = subprocess.run(args, capture_output=True, text=True, env=env, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed ({result.returncode}):\n{result.stderr[-3000:]}")
    values = logged_values(root, spec["metric"])
    best = max(values) if spec["higher_is_better"] else min(values)
    print(f"{model:6} {variant:14} {world_size} ranks: {spec['metric']} {values[-1]:.4f} (best {best:.4f})", flush=True)
    return {"value": values[-1], "best": best, "curve": values, "seconds": round(time.perf_counter() - started, 1)}


def markdown_table(report: dict[str, Any]) -> list[str]:
    """docs/diloco.md's table (tests/test_docs_numbers.py finds every line there): digits' final
    accuracy with its difference from DDP's in points, the GPT's best validation loss with its
    difference from DDP's in percent."""
    lines = ["| model, metric | ranks | " + " | ".join(VARIANTS) + " |", "|---" * (len(VARIANTS) + 2) + "|"]
    for model, results in report["results"].items():
        spec = report["models"][model]
        key = "value" if spec["higher_is_better"] else "best"
        label = f"{model}, {'final' if key == 'value' else 'best'} {spec['metric']}"
        for world_size in report["world_sizes"]:
            ddp = results["ddp"][str(world_size)][key]
            cells = []
            for variant in VARIANTS:
                value = results[variant][str(world_size)][key]
                if variant == "ddp":
                    cells.append(f"{value:.4f}")
                elif spec["higher_is_better"]:
                    cells.append(f"{value:.4f} ({value - ddp:+.3f})")
                else:
                    cells.append(f"{value:.4f} ({100 * (value - ddp) / ddp:+.1f}%)")
            lines.append(f"| {label} | {world_size} | " + " | ".join(cells) + " |")
    return lines


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(MODELS), figsize=(6.5 * len(MODELS), 3.8))
    for axis, (model, spec) in zip(axes, MODELS.items(), strict=True):
        names = list(VARIANTS)
        width = 0.8 / len(WORLD_SIZES)
        for index, world_size in enumerate(WORLD_SIZES):
            key = "value" if spec["higher_is_better"] else "best"
            values = [report["results"][model][name][str(world_size)][key] for name in names]
            axis.bar([x + index * width for x in range(len(names))], values, width, label=f"{world_size} ranks")
        axis.set_xticks([x + width * (len(WORLD_SIZES) - 1) / 2 for x in range(len(names))], names, rotation=20)
        better = "final, higher is better" if spec["higher_is_better"] else "best epoch, lower is better"
        axis.set_title(f"{model}: {spec['metric']} ({better})")
        low = min(r[str(w)][key] for r in report["results"][model].values() for w in WORLD_SIZES)
        axis.set_ylim(bottom=low * (0.9 if spec["higher_is_better"] else 0.95))
        axis.legend(loc="upper center", ncol=2, fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m app.bench.diloco_quality", description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("docs/diloco_quality.json"))
    parser.add_argument("--models", default=",".join(MODELS))
    args = parser.parse_args(argv)
    models = [name for name in args.models.split(",") if name]
    report: dict[str, Any] = {"world_sizes": list(WORLD_SIZES), "models": {m: MODELS[m] for m in models}}
    report["results"] = {model: {variant: {} for variant in VARIANTS} for model in models}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="diloco-quality-") as work:
        for model in models:
            for world_size in WORLD_SIZES:
                for variant in VARIANTS:
                    report["results"][model][variant][str(world_size)] = run(model, variant, world_size, Path(work))
    report["seconds"] = round(time.perf_counter() - started, 1)
    report["cpu_count"] = os.cpu_count()
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    if set(models) == set(MODELS):
        plot(report, args.out.with_suffix(".png"))
    print(f"written: {args.out} ({report['seconds']} s)")


if __name__ == "__main__":
    main()
