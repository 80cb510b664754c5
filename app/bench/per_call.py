"""`python -m app.bench.per_call [--calls 3000] [--repeats 5]`: the per-step costs `ddp-app` cut.

Each row times the old and the new way of doing one thing that runs every training step,
alternating the two within one run (median over repeats of microseconds per call):

  train accuracy   a torchmetrics `MulticlassAccuracy.update` vs two tensor additions (the
                   correct and seen counts `ClassifierModule` keeps), digits batch of 32
  NaN-guard grads  walking `pl_module.parameters()` (every submodule, metrics included) vs the
                   list `NonFiniteGuard` collects once at train start, digits MLPClassifier
  profiler         Lightning's `PassThroughProfiler.profile` vs `NoProfiler.profile`, entered
                   and left once (Lightning does this about 70 times per step)
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from lightning.pytorch.profilers import PassThroughProfiler
from torchmetrics.classification import MulticlassAccuracy

from app.cli import NoProfiler
from app.cluster.threads import configure_cpu_threads
from app.models import MLPClassifier


def microseconds_per_call(function: Callable[[], object], calls: int) -> float:
    for _ in range(min(calls, 100)):  # warm-up: allocator, caches, lazy initialisation
        function()
    started = time.perf_counter()
    for _ in range(calls):
        function()
    return (time.perf_counter() - started) / calls * 1e6


def cases() -> dict[str, tuple[Callable[[], object], Callable[[], object]]]:
    """name -> (before, after)."""
    logits, targets = torch.randn(32, 10), torch.randint(0, 10, (32,))
    metric = MulticlassAccuracy(num_classes=10, average="micro")
    correct, seen = torch.zeros((), dtype=torch.long), torch.zeros((), dtype=torch.long)

    def counters() -> None:
        correct.add_((logits.argmax(dim=1) == targets).sum())
        seen.add_(targets.numel())

    module = MLPClassifier()
    for parameter in module.parameters():
        parameter.grad = torch.zeros_like(parameter)
    cached = [parameter for parameter in module.parameters() if parameter.requires_grad]

    def enter(profiler: PassThroughProfiler) -> Callable[[], None]:
        def once() -> None:
            with profiler.profile("[Callback]x.on_train_batch_end"):
                pass

        return once

    return {
        "train accuracy": (lambda: metric.update(logits, targets), counters),
        "NaN-guard grads": (
            lambda: [parameter.grad for parameter in module.parameters() if parameter.grad is not None],
            lambda: [parameter.grad for parameter in cached if parameter.grad is not None],
        ),
        "profiler": (enter(PassThroughProfiler()), enter(NoProfiler())),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m app.bench.per_call", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--calls", type=int, default=3000, help="calls per timing")
    parser.add_argument("--repeats", type=int, default=5, help="(before, after) timings per row, alternating")
    args = parser.parse_args(argv)
    configure_cpu_threads()
    print(f"{'':<18}{'before us':>10}{'after us':>10}{'before/after':>14}")
    for name, (before, after) in cases().items():
        timings = [
            (microseconds_per_call(before, args.calls), microseconds_per_call(after, args.calls))
            for _ in range(args.repeats)
        ]
        old = statistics.median(pair[0] for pair in timings)
        new = statistics.median(pair[1] for pair in timings)
        ratio = statistics.median(pair[0] / pair[1] for pair in timings)
        print(f"{name:<18}{old:>10.2f}{new:>10.2f}{ratio:>13.1f}x")


if __name__ == "__main__":
    main()
