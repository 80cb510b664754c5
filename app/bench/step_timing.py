"""`python -m app.bench.step_timing [--pairs 4] [--epochs 6] [--json F]`: what the per-step timing costs.

Runs `ddp-app fit --config configs/digits.yaml` (2 ranks) with `step_timing.enabled` false and true,
alternating the order within each pair (off-on, on-off, ...), and times every training step from
outside (app/bench/callback.py `BenchTimer`: one step start to the next, within an epoch). Each
run's figure is rank 0's median step; the cost is the median over pairs of on/off - 1, with the
pairs' min and max, side by side with the step times. Separate processes differ by more than the
cost, so it also times, in this one process, what timing adds to a step (`added_work`): its three
callback hooks, called as Lightning calls them, and digits' backward with and without its
post-accumulate-grad hook on every parameter (alternating, median of `ADDED_REPEATS`), against the
fits' median step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from app.bench.recorder import DIR_VARIABLE


def median_step_s(record: dict) -> float:
    starts, epochs = record["starts"], record["epochs"]
    gaps = [b - a for a, b, ea, eb in zip(starts, starts[1:], epochs, epochs[1:], strict=False) if ea == eb]
    return statistics.median(gaps)


def run(enabled: bool, epochs: int, workdir: Path) -> float:
    out = Path(tempfile.mkdtemp(dir=workdir))
    args = [
        sys.executable, "-m", "app", "fit", "--config", "configs/digits.yaml", f"--trainer.max_epochs={epochs}",
        f"--trainer.default_root_dir={out / 'run'}", "--trainer.enable_progress_bar=false",
        "--trainer.callbacks+=app.bench.callback.BenchTimer", f"--step_timing.enabled={str(enabled).lower()}",
    ]  # fmt: skip
    env = {**os.environ, DIR_VARIABLE: str(out)}
    subprocess.run(args, env=env, check=True, stdout=subprocess.DEVNULL)
    return median_step_s(json.loads((out / "lightning-rank0.json").read_text()))


ADDED_REPEATS = 15
ADDED_STEPS = 300


def added_work() -> dict[str, float]:
    """Microseconds StepTiming adds to one digits step in this process: its three hooks' bodies, and its gradient hooks'
    share of the backward (with them against without, alternating)."""
    from app.models import MLPClassifier
    from app.run.step_timing import StepTiming

    torch.manual_seed(0)
    module = MLPClassifier()
    inputs, targets = torch.randn(32, 64), torch.randint(0, 10, (32,))
    timing = StepTiming()

    def backward() -> None:
        module.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(module(inputs), targets).backward()

    def hooks() -> None:
        timing.on_train_batch_start(None, module, None, 0)  # type: ignore[arg-type]
        timing.on_after_backward(None, module)  # type: ignore[arg-type]
        timing.on_train_batch_end(None, module, None, None, 0)  # type: ignore[arg-type]

    def per_step_us(function: Any) -> float:
        started = time.perf_counter()
        for _ in range(ADDED_STEPS):
            function()
        return (time.perf_counter() - started) / ADDED_STEPS * 1e6

    for _ in range(50):  # warm-up
        backward()
        hooks()
    hook_us, plain, hooked = [], [], []
    for _ in range(ADDED_REPEATS):
        hook_us.append(per_step_us(hooks))
        plain.append(per_step_us(backward))
        handles = [p.register_post_accumulate_grad_hook(timing._gradient_ready) for p in module.parameters()]
        hooked.append(per_step_us(backward))
        for handle in handles:
            handle.remove()
    gradient_us = statistics.median(b - a for a, b in zip(plain, hooked, strict=True))
    return {
        "hooks_us": statistics.median(hook_us),
        "gradient_hooks_us": gradient_us,
        "parameters": len(list(module.parameters())),
        "backward_us": statistics.median(plain),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m app.bench.step_timing", description=__doc__)
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    started = time.time()
    pairs = []
    with tempfile.TemporaryDirectory(prefix="bench-step-timing-") as workdir:
        for index in range(args.pairs):
            order = (False, True) if index % 2 == 0 else (True, False)
            times = {enabled: run(enabled, args.epochs, Path(workdir)) for enabled in order}
            pairs.append({"off_ms": 1000 * times[False], "on_ms": 1000 * times[True]})
            print(f"pair {index}: off {pairs[-1]['off_ms']:.3f} ms, on {pairs[-1]['on_ms']:.3f} ms", flush=True)
    ratios = [pair["on_ms"] / pair["off_ms"] for pair in pairs]
    added = added_work()
    report = {
        "config": "configs/digits.yaml",
        "world_size": 2,
        "epochs": args.epochs,
        "pairs": pairs,
        "off_step_ms_median": statistics.median(pair["off_ms"] for pair in pairs),
        "on_step_ms_median": statistics.median(pair["on_ms"] for pair in pairs),
        "overhead_pct": {
            "median": 100 * (statistics.median(ratios) - 1),
            "min": 100 * (min(ratios) - 1),
            "max": 100 * (max(ratios) - 1),
        },
        "added_work": added,
        "bench_seconds": time.time() - started,
        "cpu_count": os.cpu_count(),
    }
    overhead = report["overhead_pct"]
    print(
        f"digits step, 2 ranks: timing off {report['off_step_ms_median']:.3f} ms, on {report['on_step_ms_median']:.3f} "
        f"ms; cost {overhead['median']:+.2f}% [{overhead['min']:+.2f}, {overhead['max']:+.2f}] over {args.pairs} pairs"
    )
    added_us = added["hooks_us"] + max(added["gradient_hooks_us"], 0.0)
    report["added_pct_of_step"] = 100 * added_us / 1000 / report["off_step_ms_median"]
    print(
        f"added in one process: hooks {added['hooks_us']:.1f} us, gradient hooks {added['gradient_hooks_us']:.1f} us "
        f"({added['parameters']} parameters) per step: {report['added_pct_of_step']:.2f}% of the "
        f"{report['off_step_ms_median']:.3f} ms step"
    )
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
