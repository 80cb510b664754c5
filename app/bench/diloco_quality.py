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

`--study outer [--out docs/diloco_outer.json]`: why the paper's outer step falls short on digits at H 10
(`OUTER_STUDY`: the outer learning rate and momentum varied, and other seeds); `--study overlap`: what
`overlap_steps` costs (`OVERLAP_STUDY`). Each run alone, its validation metric in a JSON that
docs/diloco.md quotes (`study_table`).
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


def outer(sync_every: int, lr: float, momentum: float, nesterov: bool = True) -> list[str]:
    key = "--trainer.strategy.init_args"
    return ["--trainer.strategy=diloco", f"{key}.sync_every={sync_every}", f"{key}.outer_lr={lr}",
            f"{key}.outer_momentum={momentum}", f"{key}.outer_nesterov={str(nesterov).lower()}"]  # fmt: skip


# The outer-step study: (model, name, strategy arguments, ranks, seeds). Seed 42 is digits' own (the GPT's
# config has 0: these GPT runs differ from the quality table's, and are compared with DDP at their seed).
OUTER_STUDY: list[tuple[str, str, list[str], tuple[int, ...], tuple[int, ...]]] = [
    ("digits", "ddp", ["--trainer.strategy=ddp"], (2, 4), (42, 1, 2)),
    ("digits", "H10 lr0.7 m0.9 (paper)", outer(10, 0.7, 0.9), (2, 4), (42, 1, 2)),
    ("digits", "H10 lr1 m0 (avg)", outer(10, 1.0, 0.0), (2, 4), (42, 1, 2)),
    ("digits", "H10 lr0.7 m0.5", outer(10, 0.7, 0.5), (2, 4), (42, 1, 2)),
    ("digits", "H10 lr0.7 m0.7", outer(10, 0.7, 0.7), (2, 4), (42,)),
    ("digits", "H10 lr0.7 m0", outer(10, 0.7, 0.0), (2,), (42,)),
    ("digits", "H10 lr1 m0.9", outer(10, 1.0, 0.9), (2,), (42,)),
    ("digits", "H10 lr0.3 m0.9", outer(10, 0.3, 0.9), (2,), (42,)),
    ("digits", "H10 lr0.1 m0.9", outer(10, 0.1, 0.9), (2,), (42,)),
    ("digits", "H10 lr0.7 m0.9 heavy ball", outer(10, 0.7, 0.9, nesterov=False), (2,), (42,)),
    ("gpt", "ddp", ["--trainer.strategy=ddp"], (2, 4), (42,)),
    ("gpt", "H10 lr0.7 m0.9 (paper)", outer(10, 0.7, 0.9), (2, 4), (42,)),
    ("gpt", "H10 lr0.7 m0.5", outer(10, 0.7, 0.5), (2, 4), (42,)),
]
# What overlap_steps costs in quality: the paper's outer step and the plain average at H 10, in line and
# with the all-reduce overlapped with 5 inner steps.
OVERLAP = "--trainer.strategy.init_args.overlap_steps=5"
OVERLAP_STUDY: list[tuple[str, str, list[str], tuple[int, ...], tuple[int, ...]]] = [
    (model, name, strategy, (2, 4), (42,))
    for model in MODELS
    for name, strategy in (
        ("ddp", ["--trainer.strategy=ddp"]),
        ("H10 lr0.7 m0.9 (paper)", outer(10, 0.7, 0.9)),
        ("H10 lr0.7 m0.9 (paper), overlap 5", [*outer(10, 0.7, 0.9), OVERLAP]),
        ("H10 lr1 m0 (avg)", outer(10, 1.0, 0.0)),
        ("H10 lr1 m0 (avg), overlap 5", [*outer(10, 1.0, 0.0), OVERLAP]),
    )
]
STUDIES = {"outer": OUTER_STUDY, "overlap": OVERLAP_STUDY}


def logged_values(root: Path, metric: str) -> list[float]:
    """Every logged value of `metric` in the run's metrics.csv (one per validation), in order."""
    (path,) = sorted(root.glob("lightning_logs/*/metrics.csv"))
    with path.open(newline="") as file:
        values = [float(row[metric]) for row in csv.DictReader(file) if row.get(metric)]
    if not values:
        raise RuntimeError(f"{path} logs no {metric}")
    return values


def run(model: str, variant: str, world_size: int, work: Path, strategy: list[str] | None = None) -> dict[str, Any]:
    """One fit of `model` with `variant` (VARIANTS' arguments, or `strategy`'s), its validation metric."""
    spec = MODELS[model]
    root = work / f"{model}-{''.join(c if c.isalnum() else '_' for c in variant)}-{world_size}"
    strategy = VARIANTS[variant] if strategy is None else strategy
    args = [sys.executable, "-m", "app", "fit", "--config", spec["config"], *strategy,
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


def study(runs_of: list[tuple[str, str, list[str], tuple[int, ...], tuple[int, ...]]], out: Path) -> None:
    """Every run of a study (OUTER_STUDY, OVERLAP_STUDY), one after the other, into `out` (rewritten after
    each run)."""
    runs: list[dict[str, Any]] = []
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="diloco-outer-") as work:
        for model, name, strategy, world_sizes, seeds in runs_of:
            for world_size in world_sizes:
                for seed in seeds:
                    arguments = [*strategy, f"--seed_everything={seed}"]
                    result = run(model, f"{name} s{seed}", world_size, Path(work), arguments)
                    runs.append({"model": model, "variant": name, "world_size": world_size, "seed": seed,
                                 "args": arguments, **result})  # fmt: skip
                    report = {"runs": runs, "seconds": round(time.perf_counter() - started, 1)}
                    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"written: {out}")


def study_table(report: dict[str, Any]) -> list[str]:
    """docs/diloco.md's table of a study: per model, variant and ranks the metric over the seeds run
    (digits' final accuracy, the GPT's best loss), and its difference from DDP's at the same seeds."""
    lines = ["| model | outer step | ranks | seeds | metric | vs ddp |", "|---|---|---|---|---|---|"]
    runs = report["runs"]
    key = {model: "value" if spec["higher_is_better"] else "best" for model, spec in MODELS.items()}
    figure = lambda model, run: run[key[model]]  # noqa: E731
    for entry in runs:
        model, name, world_size = entry["model"], entry["variant"], entry["world_size"]
        same = [r for r in runs if (r["model"], r["variant"], r["world_size"]) == (model, name, world_size)]
        if same[0] is not entry or name == "ddp":
            continue
        seeds = [r["seed"] for r in same]
        ddp = {r["seed"]: figure(model, r) for r in runs
               if (r["model"], r["variant"], r["world_size"]) == (model, "ddp", world_size)}  # fmt: skip
        values = [figure(model, r) for r in same]
        differences = [figure(model, r) - ddp[r["seed"]] for r in same]
        if key[model] == "value":
            shown = ", ".join(f"{d:+.3f}" for d in differences)
        else:
            shown = ", ".join(f"{100 * d / ddp[r['seed']]:+.1f}%" for d, r in zip(differences, same, strict=True))
        metric = ", ".join(f"{v:.4f}" for v in values)
        lines.append(f"| {model} | {name} | {world_size} | {', '.join(map(str, seeds))} | {metric} | {shown} |")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m app.bench.diloco_quality", description=__doc__)
    parser.add_argument("--out", type=Path, default=None, help="default: docs/diloco_quality.json (--study NAME: "
                        "docs/diloco_NAME.json)")  # fmt: skip
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--study", choices=("table", *STUDIES), default="table")
    args = parser.parse_args(argv)
    if args.study in STUDIES:
        study(STUDIES[args.study], args.out or Path(f"docs/diloco_{args.study}.json"))
        return
    args.out = args.out or Path("docs/diloco_quality.json")
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
