"""`python -m app.bench.network --config configs/bench_cnn.yaml [--json F] [--plot F]` (as root)

DDP on a slow network: two ranks, each in its own network namespace (a "node"), joined by one
veth link that tc's token bucket filter caps at 100 Mbit/s, 1 Gbit/s or leaves unlimited. For
each link and each gradient-compression setting (no hook, fp16, bf16, PowerSGD, auto) and strategy
diloco (no DDP: local steps and an outer all-reduce every `--diloco-sync-every`, in line; `diloco_overlap`:
the same, each all-reduce started `--diloco-overlap-steps` inner steps before its outer step), and at one
link (1 Gbit/s) for each DDP bucket size (1, 25, 100 MB), it reports:

  step time        a training step on the config's network and batches (forward, backward with the
                   gradient exchange, optimizer step), the slower rank's mean over the timed steps
                   (diloco: over whole periods of sync_every steps, each with its one outer step),
                   after auto's probe steps and warm-up steps; median [min, max] over repeats;
  samples/s        2 x per-rank batch / step time;
  scaling eff.     2-rank samples/s / (2 x 1-rank samples/s), each repeat paired with the 1-rank
                   baseline measured beside it;
  bytes per step   what each rank's interface sent during the timed steps (kernel counters), per
                   step: gradients plus TCP/IP headers and retransmissions;
  auto             the method it chose per repeat, and its step time over the best setting's.

Settings alternate within a repeat, reversed every other repeat. The ranks start once and run the whole schedule
(app/bench/network_worker.py); the namespaces are removed in a `finally` (also after Ctrl-C or SIGTERM), by exact name
(app/bench/netns.py).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from app.bench.netns import (
    ADDRESSES,
    INTERFACES,
    NAMESPACES,
    TBF_LATENCY,
    Link,
    namespace_pair,
    parse_link,
    refuse,
    refuse_unless_able,
    run_ranks,
    stopped_cleanly,
    tbf_burst_bytes,
)
from app.bench.network_report import build_report, format_table, plot
from app.cluster.launch import env_without_launcher
from app.parallel.compression import METHODS

PROG = "python -m app.bench.network"
# The settings measured: DDP with each gradient compression method, and strategy diloco (no DDP: an
# outer step every --diloco-sync-every steps, app/reference/diloco.py's on the same network; diloco_overlap: its
# all-reduce overlapped with the --diloco-overlap-steps inner steps before the outer step).
DILOCO_METHODS = ("diloco", "diloco_overlap")
BENCH_METHODS = (*METHODS, *DILOCO_METHODS)
DDP_DEFAULT_BUCKET_MB = 25.0  # DistributedDataParallel's bucket_cap_mb default
MASTER_PORT = 29500  # inside rank 0's namespace, where nothing else listens


def comma_list(text: str) -> list[str]:
    items = [part.strip() for part in text.split(",") if part.strip()]
    if not items:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}")
    return items


def link_type(text: str) -> Link:
    try:
        return parse_link(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def link_list(text: str) -> list[Link]:
    links = [link_type(part) for part in comma_list(text)]
    if len({link.rate_mbit for link in links}) != len(links):
        raise argparse.ArgumentTypeError(f"a link speed is listed twice in {text!r}")
    return links


def method_list(text: str) -> list[str]:
    methods = comma_list(text)
    unknown = [method for method in methods if method not in BENCH_METHODS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown method {unknown[0]!r}: expected some of {', '.join(BENCH_METHODS)}")
    return list(dict.fromkeys(methods))


def bucket_list(text: str) -> list[float]:
    try:
        buckets = [float(part) for part in comma_list(text)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected bucket sizes in MB such as 1,25,100; got {text!r}") from None
    if any(bucket <= 0 for bucket in buckets):
        raise argparse.ArgumentTypeError(f"bucket sizes must be > 0 MB, got {text!r}")
    return sorted(set(buckets))


def default_bucket_mb(config: dict[str, Any]) -> float:
    """The config's `trainer.strategy.init_args.bucket_cap_mb`, else DDP's default."""
    strategy = (config.get("trainer") or {}).get("strategy")
    init_args = (strategy.get("init_args") or {}) if isinstance(strategy, dict) else {}
    return float(init_args.get("bucket_cap_mb") or DDP_DEFAULT_BUCKET_MB)


def build_schedule(
    links: list[Link],
    methods: list[str],
    buckets: list[float],
    bucket_link: Link,
    default_bucket: float,
    repeats: int,
) -> list[dict[str, Any]]:
    """Every measurement in run order: per repeat and link, the 1-rank baseline and each (method, bucket); odd repeats
    reversed; non-default buckets at `bucket_link` only."""
    schedule = []
    for repeat in range(repeats):
        for link in links if repeat % 2 == 0 else links[::-1]:
            swept = link.rate_mbit == bucket_link.rate_mbit
            sweep = sorted({*buckets, default_bucket}) if swept else [default_bucket]
            # diloco has no DDP buckets: measured once, at the default size's place.
            settings = [("none", default_bucket, 1)] + [
                (m, b, 2) for b in sweep for m in methods if m not in DILOCO_METHODS or b == default_bucket
            ]
            for method, bucket, world_size in settings if repeat % 2 == 0 else settings[::-1]:
                schedule.append(
                    {
                        "index": len(schedule),
                        "repeat": repeat,
                        "link": {"name": link.name, "rate_mbit": link.rate_mbit},
                        "method": method,
                        "bucket_cap_mb": bucket,
                        "world_size": world_size,
                    }
                )
    return schedule


def diloco_settings(args: argparse.Namespace) -> dict[str, Any]:
    """diloco's settings in the plan and the report (overlap_steps: diloco_overlap's only)."""
    return {
        "sync_every": args.diloco_sync_every,
        "outer_dtype": args.diloco_outer_dtype,
        "overlap_steps": args.diloco_overlap_steps,
    }


def run_bench(args: argparse.Namespace, config: dict[str, Any], batch_size: int) -> dict[str, Any]:
    default_bucket = default_bucket_mb(config)
    schedule = build_schedule(args.links, args.methods, args.buckets, args.bucket_link, default_bucket, args.repeats)
    if args.out.exists():
        shutil.rmtree(args.out)
    args.out.mkdir(parents=True)
    records = args.out / "records.jsonl"
    compression = {
        "powersgd_rank": args.powersgd_rank,
        "start_iter": args.powersgd_start_iter,
        "warm_start": True,
        "error_feedback": True,
    }
    plan = {
        "config": config,
        "master_addr": ADDRESSES[0],
        "master_port": MASTER_PORT,
        "interfaces": list(INTERFACES),
        "collective_timeout_s": args.collective_timeout,
        "steps": args.steps,
        "warmup_steps": args.warmup_steps,
        "repeats": args.repeats,
        "compression": compression,
        "diloco": diloco_settings(args),
        "schedule": schedule,
        "records": str(records.resolve()),
    }
    plan_path = args.out / "plan.json"
    plan_path.write_text(json.dumps(plan, indent=1))
    loadavg_before, started = os.getloadavg(), time.perf_counter()
    print(f"{PROG}: {len(schedule)} measurements, ranks in {' and '.join(NAMESPACES)}", flush=True)
    with namespace_pair():
        worker = ["app.bench.network_worker", "--plan", str(plan_path)]
        ranks = [(rank, [*worker, "--rank", str(rank)]) for rank in range(len(NAMESPACES))]
        run_ranks(PROG, ranks, env_without_launcher(os.environ), args.out, args.timeout)
    context = {
        "config": str(args.config),
        "per_rank_batch_size": batch_size,
        "world_size": 2,
        "repeats": args.repeats,
        "steps": args.steps,
        "warmup_steps": args.warmup_steps,
        "default_bucket_cap_mb": default_bucket,
        # The key in "links" where the buckets were swept, if that link was measured.
        "bucket_link": next((link.name for link in args.links if link.rate_mbit == args.bucket_link.rate_mbit), None),
        "compression": compression,
        "diloco": diloco_settings(args),
        "tbf": {
            "burst_bytes": {link.name: tbf_burst_bytes(link.rate_mbit) for link in args.links if link.rate_mbit},
            "latency": TBF_LATENCY,
        },
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS", "1"),
        "cpu_count": os.cpu_count(),
        "loadavg_before": loadavg_before,
        "loadavg_after": os.getloadavg(),
        "bench_seconds": round(time.perf_counter() - started, 1),
        "command": " ".join([PROG, *sys.argv[1:]]),
    }
    records_list = [json.loads(line) for line in records.read_text().splitlines()]
    return build_report(records_list, args.links, context)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", required=True, type=Path, help="the YAML that ddp-app takes")
    parser.add_argument(
        "--links",
        type=link_list,
        default=link_list("100mbit,1gbit,unlimited"),
        help="link speeds, tc spelling (default: 100mbit,1gbit,unlimited)",
    )
    parser.add_argument(
        "--methods",
        type=method_list,
        default=list(BENCH_METHODS),
        help=f"gradient compression settings and diloco (default: {','.join(BENCH_METHODS)})",
    )
    parser.add_argument(
        "--buckets",
        type=bucket_list,
        default=[1.0, 25.0, 100.0],
        help="DDP bucket_cap_mb values swept at --bucket-link (default: 1,25,100)",
    )
    parser.add_argument(
        "--bucket-link",
        type=link_type,
        default=parse_link("1gbit"),
        help="the link (one of --links) where the buckets are swept (default: 1gbit)",
    )
    parser.add_argument("--repeats", type=int, default=3, help="rounds over every setting (default: 3)")
    parser.add_argument("--steps", type=int, default=15, help="timed steps per measurement (default: 15)")
    parser.add_argument("--warmup-steps", type=int, default=4, help="untimed steps first (default: 4)")
    parser.add_argument("--powersgd-rank", type=int, default=4, help="PowerSGD's matrix rank (default: 4)")
    parser.add_argument(
        "--powersgd-start-iter",
        type=int,
        default=2,
        help="steps of plain all-reduce before PowerSGD compresses (default: 2)",
    )
    parser.add_argument(
        "--diloco-sync-every", type=int, default=50, help="diloco's inner steps per outer step (default: 50)"
    )
    parser.add_argument(
        "--diloco-overlap-steps",
        type=int,
        default=None,
        help="diloco_overlap's inner steps beside each all-reduce, below --diloco-sync-every (default: half of it)",
    )
    parser.add_argument(
        "--diloco-outer-dtype", choices=("float32", "bfloat16"), default="float32", help="diloco's outer_dtype"
    )
    parser.add_argument("--out", type=Path, default=Path("runs/bench_network"), help="plan, records, rank logs")
    parser.add_argument("--json", type=Path, default=None, help="default: <out>/bench_network.json")
    parser.add_argument("--plot", type=Path, default=None, help="a PNG: step time vs link speed per setting")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds allowed for the whole run")
    parser.add_argument(
        "--collective-timeout", type=float, default=300.0, help="gloo's timeout: a rank whose peer died stops within it"
    )
    args = parser.parse_args(argv)
    if not args.config.is_file():
        parser.error(f"config {args.config} does not exist. Fix: pass one of the files in configs/.")
    for name in ("repeats", "steps", "powersgd_rank", "diloco_sync_every"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.diloco_overlap_steps is None:
        args.diloco_overlap_steps = args.diloco_sync_every // 2
    if not 0 <= args.diloco_overlap_steps < args.diloco_sync_every:
        parser.error(
            f"--diloco-overlap-steps must be from 0 to --diloco-sync-every - 1 = {args.diloco_sync_every - 1}, "
            f"got {args.diloco_overlap_steps}"
        )
    if args.warmup_steps < 0:
        parser.error(f"--warmup-steps must be >= 0, got {args.warmup_steps}")
    if args.powersgd_start_iter < 2:
        # As app.parallel.compression.check_settings: DDP rebuilds its buckets after the first step.
        parser.error(f"--powersgd-start-iter must be >= 2, got {args.powersgd_start_iter}")
    if "powersgd" in args.methods and args.warmup_steps <= args.powersgd_start_iter:
        parser.error(
            f"--warmup-steps {args.warmup_steps} <= --powersgd-start-iter {args.powersgd_start_iter}: PowerSGD's "
            "uncompressed first steps would be timed. Fix: raise --warmup-steps."
        )
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    refuse_unless_able(PROG)
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError as error:
            refuse(PROG, f"--plot needs matplotlib ({error}). Fix: pip install -e '.[plot]', or drop --plot.")
    from app.reference.config import build_job, load_config  # imports torch: after the cheap checks

    try:
        config = load_config(args.config)
        batch_size = build_job(config).batch_size
    except (ValueError, KeyError) as error:
        refuse(PROG, f"{args.config}: {error}")
    with stopped_cleanly(PROG):
        report = run_bench(args, config, batch_size)
    print(format_table(report))
    json_path = args.json or args.out / "bench_network.json"
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(report, indent=2))
    if args.plot:
        plot(report, args.plot)
    print(f"\n{report['bench_seconds']} s; JSON: {json_path}" + (f"; plot: {args.plot}" if args.plot else ""))


if __name__ == "__main__":
    main()
