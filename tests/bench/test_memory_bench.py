"""`python -m app.bench.memory`: FSDP2 keeps about 1/N of the parameter, gradient and optimizer bytes
per rank that DDP keeps (docs/performance.md quotes docs/bench_memory_nov27.json, checked here)."""

from __future__ import annotations

import json

import pytest

from app.bench.memory import main, summarize
from tests.helpers.run import REPO

FIGURES = REPO / "docs" / "bench_memory_nov27.json"


def memory_bench_table(figures: dict) -> str:
    """performance.md's table of a `python -m app.bench.memory` run, formatted from its JSON."""
    lines = [
        "| strategy | ranks | parameters MB | gradients MB | optimizer MB | total MB | ÷ DDP | step ms | ÷ DDP |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for key, run in figures["runs"].items():
        strategy, ranks = key.split("-")
        megabytes = [
            run[kind] / 1e6 for kind in ("parameter_bytes", "gradient_bytes", "optimizer_bytes", "total_bytes")
        ]
        over = f"{run['over_ddp']:.3f}" if "over_ddp" in run else "1"
        step_over = f"{run['step_over_ddp']:.2f}" if "step_over_ddp" in run else "1"
        cells = " | ".join(f"{value:.2f}" for value in megabytes)
        lines.append(f"| {strategy} | {ranks} | {cells} | {over} | {run['step_ms']:.0f} | {step_over} |")
    return "\n".join(lines)


def test_fsdp2_holds_at_most_030_of_ddps_bytes_per_rank_at_4_ranks() -> None:
    runs = json.loads(FIGURES.read_text())["runs"]
    assert runs["fsdp-4"]["over_ddp"] <= 0.30, runs["fsdp-4"]
    for ranks in (1, 2, 4):  # DDP holds the whole model on every rank, whatever their number
        assert runs[f"ddp-{ranks}"]["total_bytes"] == runs["ddp-1"]["total_bytes"]


def test_performance_doc_quotes_the_memory_bench() -> None:
    figures = json.loads(FIGURES.read_text())
    text = (REPO / "docs" / "performance.md").read_text()
    assert memory_bench_table(figures) in text, memory_bench_table(figures)


def test_summary_takes_the_largest_rank_and_the_slowest_step() -> None:
    rank = {"parameter_bytes": 100, "gradient_bytes": 100, "optimizer_bytes": 200, "parameters": 25, "step_ms": 10.0}
    runs = {
        "ddp-2": {"ranks": [rank, {**rank, "step_ms": 12.0}]},
        "fsdp-2": {"ranks": [{**rank, "parameter_bytes": 52, "gradient_bytes": 52, "optimizer_bytes": 104}, {
            **rank, "parameter_bytes": 48, "gradient_bytes": 48, "optimizer_bytes": 96, "step_ms": 18.0}]},
    }  # fmt: skip
    summary = summarize(runs, batch_tokens=64)
    assert summary["ddp-2"]["total_bytes"] == 400 and summary["ddp-2"]["step_ms"] == 12.0
    assert summary["fsdp-2"]["total_bytes"] == 208 and summary["fsdp-2"]["over_ddp"] == 208 / 400
    assert summary["fsdp-2"]["step_over_ddp"] == 1.5 and summary["ddp-2"]["tokens_per_s"] == 64 * 2 / 12.0 * 1e3


@pytest.mark.slow
@pytest.mark.distributed
def test_the_bench_measures_half_the_bytes_at_2_ranks(tmp_path) -> None:
    """The real thing, small: the config's own model, 1 and 2 ranks, 3 steps each."""
    results = main(["--ranks", "1,2", "--steps", "3", "--model-args", "--json", str(tmp_path / "memory.json")])
    assert results["runs"]["fsdp-1"]["over_ddp"] == 1.0
    assert 0.5 <= results["runs"]["fsdp-2"]["over_ddp"] <= 0.52  # half, plus padding of odd first dimensions
