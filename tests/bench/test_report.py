"""`app.bench --plot` from the reports in docs/: throughput and step time on panels of their own,
every series readable, the PNG recording what it draws."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from app.bench.report import plot
from tests.helpers.plots import drawn_panels, names_by_panel
from tests.helpers.run import REPO

REPORTS = sorted(
    path.name for path in (REPO / "docs").glob("bench*.json") if "by_world_size" in json.loads(path.read_text())
)


@pytest.mark.parametrize("name", REPORTS)
def test_a_bench_plot_draws_throughput_and_step_time_readably(name: str, tmp_path: Path) -> None:
    report = json.loads((REPO / "docs" / name).read_text())
    plot(report, tmp_path / "bench.png")
    throughput, step_time = drawn_panels(tmp_path / "bench.png")
    assert {"reference", "lightning"} <= names_by_panel([throughput])[0]
    assert throughput["title"] == "throughput" and throughput["ylim"][0] == 0
    assert names_by_panel([step_time]) == [{"reference", "lightning"}]
    assert all(series["drawn"] == "bar" and series["base"] == 0 for series in step_time["series"])
