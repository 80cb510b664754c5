"""`python -m app.bench --config configs/digits.yaml [--world-sizes 1,2] [--repeats 5] [--json F] [--plot F]`

Trains one config with the plain-PyTorch reference DDP trainer and with Lightning DDP on the same batches, in pairs
whose order flips every repeat (so a machine slowing down does not always penalise the second), and reports:

  per-step time  the median over epochs of the epoch's mean step time after warm-up, from one step's
                 start to the next's (data loading and every hook included; the plain median over
                 steps is shown too, but hides costs paid every N steps);
  samples/s      world size x per-rank batch / per-step time;
  first step     from launching the command to the last rank starting its first training step;
  teardown       from the last training step to the exit of every process;
  peak memory    per rank: RSS on CPU, CUDA max allocated on GPUs;
  scaling        efficiency = throughput(N) / (N x throughput(1));
  framework-free at world size 1, each side's throughput as a fraction of a plain loop with the data
                 already on the device (app/bench/bare.py), run beside every pair, and its first step.

Every Lightning-vs-reference figure is the median [min, max] of the ratios (or differences) within pairs run back to
back.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

from tqdm import tqdm

from app.bench.profiles import parse_profile_steps, profile_table
from app.bench.report import bench_parser, build_report, format_table, plot
from app.bench.runs import BARE, SIDES, RunResult, command, launch, run_env, summarize_run, variant_config
from app.reference.config import load_config


def world_size_list(text: str) -> list[int]:
    try:
        sizes = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers such as 1,2; got {text!r}") from None
    if not sizes or sizes[0] < 1:
        raise argparse.ArgumentTypeError(f"world sizes must be >= 1; got {text!r}")
    return sizes


def resolve_accelerator(requested: str) -> str:
    if requested != "auto":
        return requested
    import torch

    return "gpu" if torch.cuda.is_available() else "cpu"


def pair_order(repeat: int) -> tuple[str, ...]:
    """(reference, lightning) on even repeats, (lightning, reference) on odd ones: a fixed order would bias the paired
    ratios against whichever runs second."""
    return SIDES if repeat % 2 == 0 else SIDES[::-1]


def run_bench(args: argparse.Namespace) -> dict:
    base = load_config(args.config)
    accelerator = resolve_accelerator(args.accelerator)
    per_rank_batch_size = int(((base.get("data") or {}).get("init_args") or {}).get("batch_size", 32))
    if args.out.exists():
        shutil.rmtree(args.out)
    configs = {
        size: variant_config(base, size, accelerator, args.epochs, args.out / f"config-ws{size}.yaml")
        for size in args.world_sizes
    }
    # Warm-up launches (not timed) fill the page cache and compile bytecode, which would otherwise make the first pair
    # slower than the rest.
    schedule = [(-1, min(args.world_sizes), side) for side in SIDES] if args.warmup else []
    # At world size 1 each pair is preceded by the framework-free loop of the same repeat.
    schedule += [
        (repeat, size, side)
        for repeat in range(args.repeats)
        for size in args.world_sizes
        for side in ((BARE,) if size == 1 and args.bare else ()) + pair_order(repeat)
    ]
    loadavg_before = os.getloadavg()
    started = time.perf_counter()
    runs: list[RunResult] = []
    progress = tqdm(schedule, desc="bench", unit="run", file=sys.stderr, disable=args.quiet)
    for repeat, size, side in progress:
        progress.set_postfix_str(f"{'warm-up' if repeat < 0 else f'pair {repeat + 1}'}: {side} x{size}")
        run_dir = args.out / f"{side}-ws{size}-{'warmup' if repeat < 0 else repeat}"
        timings = run_dir / "timings"
        timings.mkdir(parents=True)
        launched, exited = launch(
            command(side, configs[size], size, run_dir),
            run_env(accelerator, timings, args.profile),
            run_dir / "output.log",
            args.timeout,
        )
        if repeat >= 0:
            runs.append(
                summarize_run(side, size, repeat, timings, launched, exited, per_rank_batch_size, args.warmup_steps)
            )
    progress.close()
    context = {
        "config": str(args.config),
        "accelerator": accelerator,
        "world_sizes": args.world_sizes,
        "repeats": args.repeats,
        "per_rank_batch_size": per_rank_batch_size,
        "warmup_steps": args.warmup_steps,
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS", "1"),
        "cpu_count": os.cpu_count(),
        "loadavg_before": loadavg_before,
        "loadavg_after": os.getloadavg(),
        "bench_seconds": round(time.perf_counter() - started, 1),
        "command": " ".join(["python -m app.bench", *sys.argv[1:]]),
    }
    return build_report(runs, args.world_sizes, context)


def print_profiles(out: Path, steps: int) -> None:
    """Each side's last timed run's profile, printed and written beside its timings as profile.txt."""
    for side in (BARE, *SIDES):
        runs = sorted(out.glob(f"{side}-ws1-[0-9]*/timings/{side}-rank0.prof"))
        if runs:
            table = profile_table(runs[-1], steps)
            (runs[-1].parent / "profile.txt").write_text(table + "\n")
            print(f"\nprofile: {side}, {runs[-1].parent.parent.name}\n{table}")


def main(argv: list[str] | None = None) -> None:
    parser = bench_parser("python -m app.bench", __doc__, None, "the YAML that ddp-app takes")
    parser.add_argument("--world-sizes", type=world_size_list, default=[1, 2], help="comma-separated (default: 1,2)")
    parser.add_argument("--repeats", type=int, default=5, help="(reference, Lightning) pairs per world size")
    parser.add_argument("--epochs", type=int, default=None, help="default: the config's trainer.max_epochs")
    parser.add_argument("--warmup-steps", type=int, default=5, help="first steps of a run left out of the timing")
    parser.add_argument("--no-warmup", dest="warmup", action="store_false", help="skip the untimed warm-up pair")
    parser.add_argument("--accelerator", choices=["auto", "cpu", "gpu"], default="auto")
    parser.add_argument("--out", type=Path, default=Path("runs/bench"), help="configs, logs and timings of every run")
    parser.add_argument("--json", type=Path, default=None, help="default: <out>/bench.json")
    parser.add_argument("--plot", type=Path, default=None, help="a PNG: throughput vs world size, per-step bars")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds allowed per run")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument(
        "--no-bare", dest="bare", action="store_false", help="skip the framework-free loop (app/bench/bare.py)"
    )
    parser.add_argument(
        "--profile",
        metavar="FIRST:COUNT",
        default=None,
        help="cProfile rank 0's main thread over steps FIRST..FIRST+COUNT-1 of every run and print each side's "
        "costliest functions per step (app/bench/profiles.py; profiled runs are slower)",
    )
    args = parser.parse_args(argv)
    profile_steps = None
    if args.profile is not None:
        try:
            profile_steps = parse_profile_steps(args.profile)
        except ValueError:
            parser.error(f"--profile takes FIRST:COUNT, such as 10:20; got {args.profile!r}")
    if not args.config.is_file():
        parser.error(f"config {args.config} does not exist. Fix: pass one of the files in configs/.")
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    report = run_bench(args)
    print(format_table(report))
    if profile_steps is not None:
        print_profiles(args.out, profile_steps[1])
    json_path = args.json or args.out / "bench.json"
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(report, indent=2))
    if args.plot:
        plot(report, args.plot)
    written = f"JSON: {json_path}" + (f"; plot: {args.plot}" if args.plot else "")
    print(f"\n{report['bench_seconds']} s; {written}")


if __name__ == "__main__":
    main()
