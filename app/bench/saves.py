"""`python -m app.bench.saves [--hidden 1536] [--layers 8] [--saves 3] [--dir D] [--json F]`: what a checkpoint save
costs the training loop, synchronous against background (issue 44).

One CPU process trains `layers` Linear(hidden, hidden) layers with AdamW; at each save the dict a Lightning checkpoint
holds goes through `SafeCheckpointIO` (written on the training thread) or `BackgroundCheckpointIO` (a host snapshot,
written on the writer thread: "async" into the previous save's buffers, "async_fresh" into fresh memory;
app/checkpoints/staging.py), or with `overlap_copy` (parameters and AdamW's state copied during the next step, whose
optimizer step waits). Under DDP rank 0 makes exactly this call. Per mode: the milliseconds the training thread is
blocked per save, and the median step time with and without a background write in flight (one run).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from app.checkpoints import state as checkpoint_state
from app.checkpoints.plugin import BackgroundCheckpointIO, SafeCheckpointIO
from app.checkpoints.staging import HostStaging
from app.cluster.threads import configure_cpu_threads


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: torch.Tensor) -> float:
    started = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    model(batch).square().mean().backward()
    optimizer.step()
    return time.perf_counter() - started


def measure(hidden: int, layers: int, saves: int, directory: Path) -> dict[str, object]:
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(hidden, hidden) for _ in range(layers)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = torch.randn(32, hidden)
    for _ in range(3):  # AdamW's state exists after the first step; the rest warms the allocator
        train_step(model, optimizer, batch)
    quiet = [train_step(model, optimizer, batch) for _ in range(10)]

    def checkpoint() -> dict[str, object]:
        return checkpoint_state.lightning_checkpoint(model.state_dict(), [optimizer.state_dict()])

    sync, background, overlap = SafeCheckpointIO(), BackgroundCheckpointIO(), BackgroundCheckpointIO(overlap_copy=True)
    fresh = BackgroundCheckpointIO()
    for io in (background, overlap, fresh):
        io.writer.in_background = True  # as during fit's training (`start_background_writes`)
    overlap.writer.watch(model, [optimizer])
    blocked: dict[str, list[float]] = {"sync": [], "async": [], "async_fresh": [], "overlap": []}
    during_write: list[float] = []
    write_s: list[float] = []
    for _ in range(saves):
        started = time.perf_counter()
        sync.save_checkpoint(checkpoint(), directory / "sync.ckpt")
        blocked["sync"].append(time.perf_counter() - started)
        started = time.perf_counter()
        background.save_checkpoint(checkpoint(), directory / "async.ckpt")
        blocked["async"].append(time.perf_counter() - started)
        while background.writer.writing():
            during_write.append(train_step(model, optimizer, batch))
        write_s.append(time.perf_counter() - started)
        quiet += [train_step(model, optimizer, batch) for _ in range(3)]
        fresh.staging = HostStaging()  # no buffers from an earlier save
        started = time.perf_counter()
        fresh.save_checkpoint(checkpoint(), directory / "fresh.ckpt")
        blocked["async_fresh"].append(time.perf_counter() - started)
        fresh.writer.wait()
        quiet += [train_step(model, optimizer, batch) for _ in range(3)]
        started = time.perf_counter()
        overlap.save_checkpoint(checkpoint(), directory / "overlap.ckpt")
        call_s, waited_before = time.perf_counter() - started, overlap.writer.staging_wait_s
        train_step(model, optimizer, batch)  # its optimizer step waits for the copy, if it is not made yet
        blocked["overlap"].append(call_s + overlap.writer.staging_wait_s - waited_before)
        overlap.writer.wait()
        quiet += [train_step(model, optimizer, batch) for _ in range(3)]
    for io in (background, overlap, fresh):
        io.teardown()
    parameters = sum(parameter.numel() for parameter in model.parameters())
    sync_ms, async_ms, fresh_ms, overlap_ms = (
        1000 * statistics.median(blocked[mode]) for mode in ("sync", "async", "async_fresh", "overlap")
    )
    quiet_ms = 1000 * statistics.median(quiet)
    during_ms = 1000 * statistics.median(during_write) if during_write else None
    return {
        "parameters": parameters,
        "checkpoint_mb": (directory / "sync.ckpt").stat().st_size / 2**20,
        "blocked_ms_per_save": {
            "sync": sync_ms,
            "async": async_ms,
            "async_over_sync": async_ms / sync_ms,
            "async_fresh": fresh_ms,
            "async_fresh_over_sync": fresh_ms / sync_ms,
            "overlap": overlap_ms,
            "overlap_over_sync": overlap_ms / sync_ms,
        },
        "background_write_s": statistics.median(write_s),
        "step_ms": {
            "no_write": quiet_ms,
            "during_background_write": during_ms,
            "steps_during_writes": len(during_write),
            "during_over_no_write": during_ms / quiet_ms if during_ms is not None else None,
        },
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m app.bench.saves", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--hidden", type=int, default=1536, help="width of each Linear layer")
    parser.add_argument("--layers", type=int, default=8, help="number of Linear layers")
    parser.add_argument("--saves", type=int, default=3, help="saves per mode (the medians are over these)")
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: a temporary directory)")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args(argv)
    configure_cpu_threads()
    with tempfile.TemporaryDirectory(dir=args.dir) as directory:
        figures = measure(args.hidden, args.layers, args.saves, Path(directory))
    blocked, steps = figures["blocked_ms_per_save"], figures["step_ms"]
    print(f"checkpoint {figures['checkpoint_mb']:.0f} MB ({figures['parameters']:,} parameters, AdamW), 1 CPU process")
    print(
        f"{'blocked per save':<30}{'sync ms':>10}{'async ms':>10}{'async/sync':>12}{'fresh ms':>10}{'/sync':>8}"
        f"{'overlap ms':>12}{'/sync':>8}"
    )
    print(
        f"{'':<30}{blocked['sync']:>10.0f}{blocked['async']:>10.0f}{blocked['async_over_sync']:>12.1%}"
        f"{blocked['async_fresh']:>10.0f}{blocked['async_fresh_over_sync']:>8.1%}"
        f"{blocked['overlap']:>12.0f}{blocked['overlap_over_sync']:>8.1%}"
    )
    print("(fresh: the background save copying into fresh memory at every save, as before its buffers were kept)")
    during = steps["during_background_write"]
    print(f"{'step time':<30}{'no write':>10}{'writing':>10}{'ratio':>12}")
    if during is not None:
        print(f"{'':<30}{steps['no_write']:>10.0f}{during:>10.0f}{steps['during_over_no_write']:>12.2f}")
    if args.json is not None:
        command = " ".join(["python -m app.bench.saves", *(argv if argv is not None else sys.argv[1:])])
        args.json.write_text(json.dumps({"command": command, **figures}, indent=2))


if __name__ == "__main__":
    main()
