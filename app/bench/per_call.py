"""`python -m app.bench.per_call [--calls 3000] [--repeats 5] [--json F]`: the per-step costs `ddp-app` cut.

Each row times the old and the new way of doing one thing that runs every training step,
alternating the two within one run (median over repeats of microseconds per call):

  train accuracy   a torchmetrics `MulticlassAccuracy.update` vs two tensor additions (the
                   correct and seen counts `ClassifierModule` keeps), digits batch of 32
  NaN-guard grads  walking `pl_module.parameters()` (every submodule, metrics included) vs the
                   list `NonFiniteGuard` collects once at train start, digits MLPClassifier
  profiler         Lightning's `PassThroughProfiler.profile` vs `NoProfiler.profile`, entered
                   and left once (Lightning does this about 70 times per step)
  hook name        Lightning's `_current_fx_name` assignment through `nn.Module.__setattr__` vs
                   `QuickHookBookkeeping` (44 times per digits step)
  DDP 1 rank       a DDP forward and backward pass at one rank (gloo) of a module that holds
                   resnet18's 20 BatchNorm layers (60 buffers) and computes one multiplication:
                   with DDP's buffer broadcast vs without (app/cluster/ddp_buffers.py); timed with
                   1/10 of --calls
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.profilers import PassThroughProfiler
from torch.nn.parallel import DistributedDataParallel
from torchmetrics.classification import MulticlassAccuracy

from app.cli import NoProfiler
from app.cluster.ddp_buffers import without_single_rank_broadcast
from app.cluster.threads import configure_cpu_threads
from app.models import MLPClassifier
from app.models.nets import resnet_classifier_parts


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

    plain = L.LightningModule()

    def name_hook(module: L.LightningModule) -> Callable[[], None]:
        def once() -> None:
            module._current_fx_name = "on_train_batch_start"

        return once

    return {
        "train accuracy": (lambda: metric.update(logits, targets), counters),
        "NaN-guard grads": (
            lambda: [parameter.grad for parameter in module.parameters() if parameter.grad is not None],
            lambda: [parameter.grad for parameter in cached if parameter.grad is not None],
        ),
        "profiler": (enter(PassThroughProfiler()), enter(NoProfiler())),
        "hook name": (name_hook(plain), name_hook(module)),
    }


class ResNetBuffers(torch.nn.Module):
    """resnet18's BatchNorm layers (their buffers are what DDP broadcasts) around a trivial forward."""

    def __init__(self) -> None:
        super().__init__()
        net = resnet_classifier_parts(10, False).net
        self.norms = torch.nn.ModuleList(module for module in net.modules() if isinstance(module, torch.nn.BatchNorm2d))
        self.norms.requires_grad_(False)  # only `scale` takes part in the forward pass
        self.scale = torch.nn.Parameter(torch.ones(()))

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return inputs * self.scale


def ddp_forward_cases() -> dict[str, tuple[Callable[[], object], Callable[[], object]]]:
    """The DDP row, in a one-rank gloo process group (the caller destroys it)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    net = ResNetBuffers()
    image = torch.randn(1, 3, 32, 32)
    broadcasting = DistributedDataParallel(net)  # DDP's default
    not_broadcasting = DistributedDataParallel(net, **without_single_rank_broadcast({}, 1))

    def forward(model: DistributedDataParallel) -> Callable[[], object]:
        def once() -> None:
            # With gradients, as in training: DDP syncs buffers only before a forward that will backward.
            model(image).sum().backward()

        return once

    return {"DDP 1 rank": (forward(broadcasting), forward(not_broadcasting))}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m app.bench.per_call", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--calls", type=int, default=3000, help="calls per timing")
    parser.add_argument("--repeats", type=int, default=5, help="(before, after) timings per row, alternating")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = parser.parse_args(argv)
    configure_cpu_threads()
    print(f"{'':<18}{'before us':>10}{'after us':>10}{'before/after':>14}")
    rows = [(name, pair, args.calls) for name, pair in cases().items()]
    results = {}
    try:
        rows += [(name, pair, max(1, args.calls // 10)) for name, pair in ddp_forward_cases().items()]
        for name, (before, after), calls in rows:
            results[name] = timed_row(name, before, after, calls, args.repeats)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if args.json is not None:
        command = " ".join(["python -m app.bench.per_call", *(argv if argv is not None else sys.argv[1:])])
        args.json.write_text(json.dumps({"command": command, **results}, indent=2))


def timed_row(
    name: str, before: Callable[[], object], after: Callable[[], object], calls: int, repeats: int
) -> dict[str, float]:
    """One row, printed: before and after alternate `repeats` times; medians of microseconds per call."""
    timings = [(microseconds_per_call(before, calls), microseconds_per_call(after, calls)) for _ in range(repeats)]
    old = statistics.median(pair[0] for pair in timings)
    new = statistics.median(pair[1] for pair in timings)
    ratio = statistics.median(pair[0] / pair[1] for pair in timings)
    print(f"{name:<18}{old:>10.2f}{new:>10.2f}{ratio:>13.1f}x", flush=True)
    return {"before_us": old, "after_us": new, "ratio": ratio}


if __name__ == "__main__":
    main()
