"""`ddp-app diagnose --config CONFIG [overrides] [--steps 60] [--out DIR]`: why is my run slow?

Runs the config shortened to `--steps` steps (no validation) three times, each a `ddp-app fit`, and attributes the step
time by ablation from app/run/step_timing.py's numbers:

  as configured       the step time T (the mean of the ranks), and each rank's measured parts;
  batch in memory     the first batch again at every step: T - T(batch in memory) is the data share;
  no communication    a DDP hook that keeps each rank's own gradients: each rank's own work. T - the
                      slowest rank's own work is the lockstep cost (all-reduce, the smallest wait
                      over the ranks, plus waiting for a late rank); the slowest rank's own work
                      against the median's is the straggler share; each rank's score is the fastest
                      rank's own time over its own.

Where those say data-bound, more loader workers are tried (`check_workers`); where DDP's all-reduce is the cost and the
run has no compression, one run with PowerSGD says whether compression pays here (`check_compression`).

Each rank's figure is the mean of its steps after `WARMUP_STEPS` and one per loader worker, less its slowest tenth. It
prints a table per rank and one verdict with the fix, and writes `report.json` and `report.png` in
`<default_root_dir>-diagnose/<time>/` (or `--out`), leaving the run's directory untouched. `verdict` depends on the
recorded numbers alone (tests/test_diagnose.py)."""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from app.cli.resume_check import parse_with_config, run_ddp_app
from app.errors import UserFacingError

# The variants and the overrides that make them (besides the shortened run's).
VARIANTS = {
    "as_configured": [],
    "batch_in_memory": ["--step_timing.ablation=batch_in_memory"],
    "no_communication": ["--step_timing.ablation=no_communication", "--gradient_compression.method=none"],
}
WARMUP_STEPS = 3
# A part is the verdict when it is the largest of those past its threshold (a fraction of the step).
DATA_BOUND = 0.2
DATA_FIXED = 0.1  # a data share below this after the suggested num_workers: fixed (issue 43)
WORKER_TRIES = 3  # the suggested num_workers, then (twice at most) the one the last measured run calls for
COMMUNICATION_BOUND = 0.3
# Whether compression pays is measured where it can be (`check_compression`): one more run with PowerSGD, which pays
# when its step is at least `COMPRESSION_PAYS` shorter. At the same size it pays on one CPU and not on another
# (docs/performance.md, Diagnose), so the gradients' size is only the guess for records without that run: below
# `SMALL_GRADIENT_BYTES` per rank per step, each exchange's messages cost more than its bytes.
SMALL_GRADIENT_BYTES = 1_000_000
COMPRESSION_PAYS = 0.1
COMPRESSION_TRIED = ["--gradient_compression.method=powersgd", "--gradient_compression.start_iter=2"]
WAITING_NOTED = 0.2
STRAGGLER_SHARE = 0.1
STRAGGLER_SCORE = 0.8  # a rank at or below this score (fastest own time / its own) is a straggler
UNEVEN_DATA_RATIO = 4.0  # one rank's data wait this many times the others' largest: its own loading is slow


@dataclass(frozen=True)
class RankTimes:
    """One rank's mean step and its measured parts, in seconds (app/run/step_timing.py)."""

    rank: int
    host: str
    step: float
    data: float
    compute: float
    communication: float
    other: float


def trimmed(record: dict[str, Any], part: int) -> list[float]:
    """One part of a rank's steps after its warm-up, in step order: `WARMUP_STEPS`, and one step per loader worker (each
    worker's first batch waits for that worker to start: a cost of the first steps of an epoch, not of the loader's
    pace, which is what the share measures)."""
    warmup = WARMUP_STEPS + int(record.get("num_workers") or 0)
    steps = record["steps"][warmup:] or record["steps"]
    if not steps:
        raise ValueError(f"rank {record['rank']} recorded no timed step")
    return [step[part] for step in steps]


def rank_times(record: dict[str, Any]) -> RankTimes:
    steps = list(zip(*(trimmed(record, part) for part in range(5)), strict=True))
    kept = sorted(steps, key=lambda step: step[0])[: max(1, math.ceil(len(steps) * 0.9))]
    if record.get("outer_every"):  # strategy diloco: its slowest steps are the outer steps, the cost measured
        kept = steps
    means = [statistics.fmean(step[part] for step in kept) for part in range(5)]
    return RankTimes(record["rank"], record["host"], *means)


def suggested_workers(workers: int, step_s: float, in_memory_s: float) -> int:
    """Loader workers that keep up: each takes `max(workers, 1) x step_s` per batch as measured now, and a step without
    data takes `in_memory_s`; one more as a margin."""
    return max(workers + 1, math.ceil(max(workers, 1) * step_s / max(in_memory_s, 1e-6)) + 1)


def verdict(variants: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """The report from each variant's per-rank records (`rank<N>.json` of app/run/step_timing.py)."""
    variants = {name: sorted(records, key=lambda record: record["rank"]) for name, records in variants.items()}
    base = [rank_times(record) for record in variants["as_configured"]]
    step = statistics.fmean(rank.step for rank in base)
    in_memory = statistics.fmean(rank_times(record).step for record in variants["batch_in_memory"])
    alone = [rank_times(record).step for record in variants.get("no_communication", [])] or [
        rank.step - rank.communication for rank in base
    ]
    facts = variants["as_configured"][0]
    # What a rank's collectives carry per step: DDP all-reduces the gradients; FSDP2's were counted as they ran.
    sharded = facts.get("collectives") == "fsdp"
    moved = facts["communication_bytes"] if sharded else facts["gradient_bytes"]
    # The lockstep cost (the step less the slowest rank's alone) is the all-reduce itself plus waiting for whichever
    # rank is late at that step. The rank that arrives last at a step waits for the all-reduce alone: the steps'
    # smallest wait over the ranks measures it.
    lockstep = max(step - max(alone), 0.0)
    waits = [min(parts) for parts in zip(*(trimmed(record, 3) for record in variants["as_configured"]), strict=False)]
    all_reduce = min(statistics.fmean(waits), lockstep)
    shares = {
        "data": max(step - in_memory, 0.0) / step,
        "communication": all_reduce / step,
        "waiting": (lockstep - all_reduce) / step,
        "straggler": (max(alone) - statistics.median(alone)) / step,
    }
    shares["compute_and_other"] = max(1.0 - sum(shares.values()), 0.0)
    scores = [min(alone) / own for own in alone]
    slowest = max(range(len(alone)), key=lambda rank: alone[rank])
    report: dict[str, Any] = {
        "step_ms": 1000 * step,
        "batch_in_memory_step_ms": 1000 * in_memory,
        "shares": shares,
        "ranks": [
            {
                **asdict(rank),
                "all_reduce": min(rank.communication, all_reduce),
                "waiting": max(rank.communication - all_reduce, 0.0),
                "alone": alone[index],
                "score": scores[index],
            }
            for index, rank in enumerate(base)
        ],
        "gradient_bytes_per_step": facts["gradient_bytes"],
        "collectives": facts.get("collectives", "ddp"),
        "communication_bytes_per_step": moved,
        "num_workers": facts["num_workers"],
        "world_size": facts["world_size"],
        "cpu_count": facts["cpu_count"],
    }
    percent = {name: f"{100 * share:.0f}%" for name, share in shares.items()}
    candidates = {}
    if scores[slowest] <= STRAGGLER_SCORE and shares["straggler"] >= STRAGGLER_SHARE:
        candidates["straggler"] = shares["straggler"]
    if shares["data"] >= DATA_BOUND:
        candidates["data-bound"] = shares["data"]
    if shares["communication"] >= COMMUNICATION_BOUND:
        candidates["communication-bound"] = shares["communication"]
    # One rank's loading, not every rank's: the data share would blame the loaders of all, and a num_workers that the
    # other ranks do not need. The rank (and its host) is named instead.
    datas = [rank.data for rank in base]
    slow_loader = max(range(len(datas)), key=lambda rank: datas[rank])
    others = [data for rank, data in enumerate(datas) if rank != slow_loader] or [0.0]
    uneven_data = (datas[slow_loader] - statistics.median(others)) / step
    if len(datas) > 1 and uneven_data >= DATA_BOUND and datas[slow_loader] >= UNEVEN_DATA_RATIO * max(others):
        candidates.pop("data-bound", None)
        candidates["slow loading on one rank"] = uneven_data
    if shares["waiting"] >= WAITING_NOTED:
        candidates["waiting for late ranks"] = shares["waiting"]
    kind = max(candidates, key=candidates.__getitem__) if candidates else "compute-bound and balanced"
    if kind == "slow loading on one rank":
        host = base[slow_loader].host
        text = (
            f"slow loading on one rank: rank {slow_loader} on host {host} waits {1000 * datas[slow_loader]:.1f} ms per "
            f"step for its next batch, the other ranks {1000 * statistics.median(others):.1f} ms, and every rank waits "
            f"for it ({100 * uneven_data:.0f}% of each step). Fix: look at what that rank reads from (its host's disk "
            f"or network share, its part of the data); on a cluster exclude the node (sbatch --exclude={host})."
        )
    elif kind == "waiting for late ranks":
        text = (
            f"waiting for late ranks: the ranks wait {percent['waiting']} of each step for whichever is late at that "
            f"step (no rank is late steadily; the all-reduce itself is {percent['communication']} for "
            f"{moved / 1e6:.2f} MB per rank per step, data "
            f"{percent['data']}). Fix: other load on the host, or more threads than cores (torch threads x ranks): "
            "fewer ranks or threads per host, or a host of its own."
        )
    elif kind == "straggler":
        host = base[slowest].host
        text = (
            f"straggler: rank {slowest} on host {host} does its own work in {1000 * alone[slowest]:.1f} ms per step, "
            f"the fastest rank in {1000 * min(alone):.1f} ms (score {scores[slowest]:.2f}); the others wait for it "
            f"{percent['straggler']} of each step. Fix: find what slows that rank or host (another job on it, "
            f"throttling, its data or a callback of its own); on a cluster exclude the node (sbatch --exclude={host})."
        )
    elif kind == "data-bound":
        report["suggested_num_workers"] = suggested_workers(int(facts["num_workers"] or 0), step, in_memory)
        text = data_bound_text(report)
    elif kind == "communication-bound" and sharded:
        report["communication_cost"] = "latency" if moved < SMALL_GRADIENT_BYTES else "bandwidth"
        text = (
            f"communication-bound: FSDP2's all-gathers and reduce-scatters take {percent['communication']} of each "
            f"step ({moved / 1e6:.2f} MB per rank per step; {1000 * max(alone):.1f} ms per step without them). Fix: "
            "trainer.strategy.init_args.reshard_after_forward: false (one all-gather per unit and step, not two, "
            "for more memory), shard_group_size: node (hybrid: the all-gathers stay inside a node), a larger "
            "per-rank batch or trainer.accumulate_grad_batches (docs/fsdp.md)."
        )
    elif kind == "communication-bound" and facts.get("outer_every"):
        every = int(facts["outer_every"])
        report["communication_cost"] = "outer step"
        text = (
            f"communication-bound: strategy diloco's outer step, every {every} steps, adds "
            f"{percent['communication']} to each step spread over those {every} ({1000 * max(alone):.1f} ms per step "
            "without it). Fix: a larger trainer.strategy.init_args.sync_every (fewer outer steps; quality at large "
            "sync_every is in docs/diloco.md), overlap_steps (the all-reduce beside the inner steps before the "
            "outer step), outer_dtype: bfloat16 (half the bytes), or fragments (smaller exchanges, more often)."
        )
    elif kind == "communication-bound":
        report["alone_ms"] = 1000 * max(alone)
        text = communication_text(report)
    else:
        text = (
            f"compute-bound and balanced: data {percent['data']}, communication {percent['communication']} "
            f"({moved / 1e6:.2f} MB per rank per step), "
            f"waiting for a late rank {percent['waiting']}, straggler {percent['straggler']} of a {1000 * step:.1f} "
            f"ms step; the slowest rank scores {scores[slowest]:.2f}. Next: trainer.precision: bf16-mixed (GPUs), "
            "compile: true, a larger per-rank batch if memory allows."
        )
    if shares["waiting"] >= WAITING_NOTED and kind != "waiting for late ranks":
        text += (
            f" Note: the ranks wait {percent['waiting']} of each step for whichever is late at that step (no rank "
            "is late steadily): other load on the host, or more threads than cores (torch threads x ranks)."
        )
    report["verdict"] = kind
    report["verdict_text"] = text
    return report


def communication_text(report: dict[str, Any]) -> str:
    """DDP's communication-bound verdict. Compression is suggested where it paid in `check_compression`'s run (or,
    without that run, where the gradients are large); otherwise the cost is each exchange's messages, and the fixes
    are fewer exchanges. Sets `communication_cost` to match."""
    moved, tried = report["communication_bytes_per_step"], report.get("tried_compression")
    share, alone = f"{report['shares']['communication']:.0%}", report["alone_ms"]
    checked = ""
    if tried and "failed" in tried:
        checked = f" Compression could not be tried: the run with {tried['method']} failed ({tried['failed']})."
        pays = moved >= SMALL_GRADIENT_BYTES
    elif tried:
        pays = tried["step_ms"] <= (1 - COMPRESSION_PAYS) * report["step_ms"]
        checked = (
            f" Checked: with gradient_compression.method {tried['method']} a step took {tried['step_ms']:.1f} ms "
            f"against {report['step_ms']:.1f} ms as configured"
            + ("." if pays else f": compression does not pay here (it needs {COMPRESSION_PAYS:.0%} less).")
        )
    else:
        pays = moved >= SMALL_GRADIENT_BYTES
    report["communication_cost"] = "bandwidth" if pays else "latency"
    if pays:
        method = tried["method"] if tried and "failed" not in tried else "auto"
        return (
            f"communication-bound: the gradient all-reduce adds {share} to each step ({moved / 1e6:.2f} MB of "
            f"gradients per rank per step; {alone:.1f} ms per step without it).{checked} Fix: "
            f"gradient_compression.method: {method}{' (or auto)' if method != 'auto' else ' (or powersgd)'}, a larger "
            "per-rank batch or trainer.accumulate_grad_batches (fewer all-reduces per sample), "
            "trainer.strategy.init_args.bucket_cap_mb (docs/compression.md)."
        )
    return (
        f"communication-bound by latency: the gradient all-reduce adds {share} to each step for {moved / 1e6:.2f} MB "
        f"of gradients per rank per step ({alone:.1f} ms per step without it): the cost is each exchange's messages, "
        f"not their bytes, and compression adds exchanges and work.{checked} Fix: fewer exchanges per sample: a "
        "larger per-rank batch or trainer.accumulate_grad_batches; a faster interconnect (docs/performance.md, "
        "Diagnose)."
    )


def check_compression(
    report: dict[str, Any],
    records: dict[str, list[dict[str, Any]]],
    run_variant: Callable[..., tuple[int, Path]],
) -> None:
    """DDP communication-bound without compression: one more shortened fit with PowerSGD (`COMPRESSION_TRIED`) says
    whether compression pays on this link and these gradients, instead of guessing it from their size."""
    guessed = communication_text(report)  # what `verdict` wrote, before its note on late ranks (if any)
    code, log = run_variant("compressed", COMPRESSION_TRIED)
    if code != 0:  # a model PowerSGD cannot serve, say: named, and the guess stands
        report["tried_compression"] = {"method": "powersgd", "failed": f"exit {code}, see {log}"}
    else:
        step = statistics.fmean(rank_times(record).step for record in records["compressed"])
        report["tried_compression"] = {"method": "powersgd", "step_ms": 1000 * step}
    report["verdict_text"] = communication_text(report) + report["verdict_text"][len(guessed) :]


def data_bound_text(report: dict[str, Any]) -> str:
    """The data-bound verdict, with the suggested num_workers and what trying it measured (if tried). A num_workers
    whose try failed (a DataModule without that argument, or whose workers break) is not suggested: the try's failure is
    named instead, with the fixes that remain."""
    workers = int(report["num_workers"] or 0)
    tried = report.get("tried_num_workers") or []
    if tried and "failed" in tried[-1]:
        return (
            f"data-bound: {report['shares']['data']:.0%} of each step waits for the next batch "
            f"({report['step_ms']:.1f} ms per step, {report['batch_in_memory_step_ms']:.1f} ms with the batch already "
            f"in memory). More loader workers could not be tried: the run with data.init_args.num_workers "
            f"{tried[-1]['num_workers']} failed ({tried[-1]['failed']}). Fix: give the DataModule's DataLoader more "
            "workers (num_workers, persistent_workers=True) where it builds it, make each sample cheaper to load "
            "(decode or resize once, ahead), or keep data that fits in memory on the device (docs/performance.md)."
        )
    text = (
        f"data-bound: {report['shares']['data']:.0%} of each step waits for the next batch "
        f"({report['step_ms']:.1f} ms per step, {report['batch_in_memory_step_ms']:.1f} ms with the batch already "
        f"in memory). Fix: data.init_args.num_workers: {report['suggested_num_workers']} (now {workers}; this host "
        f"has {report['cpu_count']} cores for {report['world_size']} ranks: beyond them, workers help only loading "
        "that waits on I/O), persistent_workers: true, pin_memory: true on GPUs; data.init_args.on_device: true for "
        "data that fits in memory; LitData shards for many small files (docs/performance.md)."
    )
    if tried:
        measured = ", ".join(
            f"{row['data_share']:.0%} with {row['num_workers']} ({row['step_ms']:.1f} ms per step)" for row in tried
        )
        if tried[-1]["data_share"] < DATA_FIXED:
            return text + f" Checked: waiting for the next batch takes {measured}."
        return text + (
            f" Checked: waiting for the next batch still takes {measured}: past a few workers the cost is the CPU "
            "(the workers' and this process's handling of each batch), not waiting for samples; fewer ranks or "
            "threads per host, larger batches, or data.init_args.on_device: true for data that fits, help more."
        )
    return text


def check_workers(
    report: dict[str, Any],
    records: dict[str, list[dict[str, Any]]],
    run_variant: Callable[..., tuple[int, Path]],
) -> None:
    """Try the suggested `num_workers` with one more shortened fit (more where the data share stays `DATA_FIXED` or
    above, `WORKER_TRIES` in all); the report names the number that fixed it, or says none did."""
    in_memory = report["batch_in_memory_step_ms"] / 1000  # as `verdict` measured it
    workers, tried = report["suggested_num_workers"], []
    for _ in range(WORKER_TRIES):
        variant = f"num_workers_{workers}"
        code, log = run_variant(variant, [f"--data.init_args.num_workers={workers}"], warmup=workers)
        if code != 0:  # a DataModule without num_workers, or one the workers break: said, not tried further
            tried.append({"num_workers": workers, "failed": f"exit {code}, see {log}"})
            break
        ranks = [rank_times(record) for record in records[variant]]
        step = statistics.fmean(rank.step for rank in ranks)
        # The measured wait for the next batch (StepTiming's data part), not the step against the in-memory one, which
        # also counts the workers' use of training's cores.
        share = statistics.fmean(rank.data for rank in ranks) / step
        tried.append({"num_workers": workers, "step_ms": 1000 * step, "data_share": share})
        if share < DATA_FIXED:
            break
        workers = suggested_workers(workers, step, in_memory)
    report["tried_num_workers"] = tried
    measured = [row for row in tried if "failed" not in row]
    if measured:  # the number that did best: more than any of them bought nothing where loading is CPU-bound
        report["suggested_num_workers"] = min(measured, key=lambda row: row["data_share"])["num_workers"]
    report["verdict_text"] = data_bound_text(report)


def format_table(report: dict[str, Any]) -> str:
    """Per rank, in ms: the step and its parts, the collectives' time split into the all-reduce itself and the wait for
    a late rank (the verdict's two shares), the step alone (no communication) and the score."""
    collectives = "collectives" if report.get("collectives") == "fsdp" else "all-reduce"
    rows = [("rank", "host", "step ms", "data", "compute", collectives, "waiting", "other", "alone ms", "score")]
    parts = ("step", "data", "compute", "all_reduce", "waiting", "other")
    for rank in report["ranks"]:
        rows.append(
            (
                str(rank["rank"]),
                rank["host"],
                *(f"{1000 * rank[part]:.2f}" for part in parts),
                f"{1000 * rank['alone']:.2f}",
                f"{rank['score']:.2f}",
            )
        )
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]))]
    table = "\n".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)) for row in rows)
    if report.get("collectives") == "fsdp":  # what the collectives column carried, whatever the verdict
        table += (
            f"\ncommunication: {report['communication_bytes_per_step'] / 1e6:.2f} MB per rank per step "
            f"(FSDP2's all-gathers and reduce-scatters), {report['shares']['communication']:.0%} of the step"
        )
    return table


def plot(report: dict[str, Any], path: Path) -> None:
    """Stacked bars per rank (as configured: data, compute, all-reduce, waiting, other) beside its time alone, titled by
    the verdict: the same parts as the table and the verdict's shares."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ranks = report["ranks"]
    positions = range(len(ranks))
    figure, axes = plt.subplots(figsize=(2.2 + 1.2 * len(ranks), 4))
    bottom = [0.0] * len(ranks)
    for part in ("data", "compute", "all_reduce", "waiting", "other"):
        heights = [1000 * rank[part] for rank in ranks]
        axes.bar(positions, heights, bottom=bottom, label=part.replace("_", "-"), width=0.6)
        bottom = [low + height for low, height in zip(bottom, heights, strict=True)]
    axes.scatter(positions, [1000 * rank["alone"] for rank in ranks], marker="_", s=900, color="black", label="alone")
    axes.set_xticks(list(positions), [f"rank {rank['rank']}\n{rank['score']:.2f}" for rank in ranks])
    axes.set_ylabel("ms per step")
    axes.set_title(report["verdict"], fontsize=10)
    axes.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def report_directory(config_args: list[str]) -> Path:
    """`<default_root_dir>-diagnose/<time>`: beside the run, never inside it."""
    from app.cli import parse_config  # the CLI's own parser, files and precedence

    root = Path(parse_config(["fit", *config_args])["trainer"]["default_root_dir"] or ".").resolve()
    return root.parent / f"{root.name}-diagnose" / time.strftime("%Y%m%d-%H%M%S")


RECORDS_WAIT_S = 60.0  # how long a finished run's step times may take to appear from every node


def one_of_several(env: Mapping[str, str]) -> int | None:
    """This diagnose's index where one runs per node or per task, each starting the same fits, which join into one
    multi-node run (srun of more than one task, torchrun, a plain launch with NODE_RANK): Slurm's task, torchrun's rank
    or the node; None where it runs alone."""
    if int(env.get("SLURM_NTASKS", "1") or 1) > 1 and env.get("SLURM_PROCID", "").isdigit():
        return int(env["SLURM_PROCID"])
    for key in ("RANK", "NODE_RANK"):
        if env.get(key, "").isdigit():
            return int(env[key])
    return None


def read_records(directory: Path, timeout_s: float) -> list[dict[str, Any]]:
    """Every rank's step times of a finished run (app/run/step_timing.py `record_dir`), once all are there: on several
    nodes the other nodes' ranks may finish writing theirs a moment later."""
    deadline = time.monotonic() + timeout_s
    while True:
        records = [json.loads(path.read_text()) for path in sorted(directory.glob("rank*.json"))]
        expected = records[0]["world_size"] if records else None
        if expected is not None and len(records) == expected:
            return records
        if time.monotonic() > deadline:
            raise UserFacingError(
                f"found the step times of {len(records)} of {expected or 'all'} ranks in {directory} after the run. "
                "Fix: give diagnose --out on a filesystem every node shares (each node's ranks write theirs there)."
            )
        time.sleep(0.5)


HELP = (
    "Run your config shortened, as configured and with the data, the communication and the waiting for other ranks "
    "taken out in turn; say where each rank's step time goes and what to change."
)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="ddp-app diagnose", description=HELP)
    parser.add_argument("--steps", type=int, default=60, help="training steps of each run (default 60)")
    parser.add_argument("--out", type=Path, help="write the report and the runs here (default: beside the run)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds each run may take (default 600)")
    known, config_args = parse_with_config(parser, argv)
    if known.steps <= WARMUP_STEPS + 3:
        parser.error(f"--steps must be more than {WARMUP_STEPS + 3}, got {known.steps}")
    index = one_of_several(os.environ)
    if index is not None and known.out is None:
        parser.error(
            "on more than one node or task give --out DIR on a filesystem every node shares: each runs the same "
            "fits, which join into one run, and reads every rank's step times there"
        )
    out = known.out or report_directory(config_args)
    out.mkdir(parents=True, exist_ok=True)
    log_suffix = f".{index}" if index else ""  # each node's or task's own log of the same run

    def run_variant(variant: str, overrides: list[str], warmup: int = 0) -> tuple[int, Path]:
        """One shortened fit, `warmup` steps longer (those `trimmed` leaves out); (its exit code, its log)."""
        print(f"ddp-app diagnose: {variant.replace('_', ' ')} ...", flush=True)
        root, log = out / "runs" / variant, out / "runs" / f"{variant}{log_suffix}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        args = [
            "fit",
            *config_args,
            *overrides,
            f"--trainer.default_root_dir={root}",
            f"--trainer.max_steps={known.steps + warmup}",
            "--trainer.max_epochs=-1",
            "--trainer.limit_val_batches=0",
            "--trainer.num_sanity_val_steps=0",
            "--trainer.enable_progress_bar=false",
            "--trainer.logger=false",
            f"--step_timing.record_dir={root / 'step_times'}",
        ]
        code = run_ddp_app(args, log, known.timeout)
        if code == 0:
            records[variant] = read_records(root / "step_times", RECORDS_WAIT_S)
        return code, log

    records: dict[str, list[dict[str, Any]]] = {}
    for variant, overrides in VARIANTS.items():
        first = records["as_configured"][0] if records else {}
        if variant == "no_communication" and (first["world_size"] == 1 or first.get("collectives") == "fsdp"):
            # One rank: nobody to communicate with. FSDP2: no step runs without its all-gathers, so a
            # rank's own work is its step less its timed collectives (`verdict`).
            break
        try:
            code, log = run_variant(variant, overrides)
        except UserFacingError as error:  # `read_records`: the run's step times are not all where they should be
            print(f"ddp-app: error: {error}", file=sys.stderr, flush=True)
            return 2
        if code != 0:
            errors = [line for line in log.read_text().splitlines() if line.startswith("ddp-app: error:")]
            print(errors[-1] if errors else f"ddp-app diagnose: the {variant} run failed (exit {code}); see {log}")
            return code
    report = verdict(records)
    # DDP's gradient all-reduce, as configured without compression (not FSDP2's collectives, not diloco's outer step)
    ddp_gradients = report["verdict"] == "communication-bound" and report["collectives"] == "ddp"
    compression_unset = records["as_configured"][0].get("gradient_compression", "none") == "none"
    try:
        if report["verdict"] == "data-bound":
            check_workers(report, records, run_variant)
        elif ddp_gradients and report.get("communication_cost") in ("latency", "bandwidth") and compression_unset:
            check_compression(report, records, run_variant)
    except UserFacingError as error:
        print(f"ddp-app: error: {error}", file=sys.stderr, flush=True)
        return 2
    if index:  # the same verdict as the first node's or task's, which writes it
        print(f"ddp-app diagnose: {report['verdict']}; the report is written by the first node or task in {out}")
        return 0
    print(format_table(report))
    print(report["verdict_text"])
    (out / "report.json").write_text(json.dumps(report, indent=2))
    plot(report, out / "report.png")
    print(f"ddp-app diagnose: report {out / 'report.json'}, chart {out / 'report.png'}")
    return 0
