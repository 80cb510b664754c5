"""`python -m app.bench.data` on a tiny setting, in this process: the JSON's shape, every figure positive.

Its speed is not checked: timings on a shared 2-core VM are not a pass or fail.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from app.bench.data import SOURCES, main
from tests.helpers.run import REPO


def test_data_bench_writes_every_cell_with_positive_figures(tmp_path: Path) -> None:
    output = tmp_path / "bench_data.json"
    argv = ["--images", "32", "--workers", "0,1", "--rounds", "1", "--batch-size", "8", "--model-steps", "1"]
    config = REPO / "configs" / "imagefolder_resnet18.yaml"
    main([*argv, "--config", str(config), "--device", "cpu", "--json", str(output)])
    results = json.loads(output.read_text())
    assert results["train_images"] == 32 and results["classes"] == 4
    assert results["model"]["class_path"] == "app.models.ResNetClassifier"
    figures = [results["model"]["step_ms"], results["model"]["samples_per_s"]]
    assert set(results["loaders"]) == set(SOURCES)
    for by_workers in results["loaders"].values():
        assert set(by_workers) == {"0", "1"}
        for cell in by_workers.values():
            figures += [cell["samples_per_s"], cell["over_model"]]
    for summary in figures:
        assert summary["n"] == 1
        assert all(math.isfinite(summary[key]) and summary[key] > 0 for key in ("median", "min", "max")), summary


def data_bench_table(figures: dict) -> str:
    """performance.md's table of a `python -m app.bench.data` run, formatted from its JSON."""
    lines = ["| source | workers | samples/s | ÷ model (median [min, max]) |", "|---|---|---|---|"]
    for source, by_workers in figures["loaders"].items():
        for workers, cell in by_workers.items():
            ratio = cell["over_model"]
            lines.append(
                f"| {source} | {workers} | {cell['samples_per_s']['median']:.0f} "
                f"| {ratio['median']:.1f} [{ratio['min']:.1f}, {ratio['max']:.1f}] |"
            )
    return "\n".join(lines)


def test_performance_doc_quotes_the_data_bench() -> None:
    figures = json.loads((REPO / "docs" / "bench_data_nov27.json").read_text())
    text = (REPO / "docs" / "performance.md").read_text()
    assert data_bench_table(figures) in text, data_bench_table(figures)
    model = figures["model"]
    prose = " ".join(text.split())
    quoted = f"{model['step_ms']['median']:.0f} ms per step, {model['samples_per_s']['median']:.0f} samples/s"
    assert quoted in prose, quoted
