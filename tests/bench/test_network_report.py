"""`app.bench.network --plot` from the reports in docs/: step time per compression method against the
link speed and the bucket size, every series readable, the PNG recording what it draws."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from app.bench.network_report import plot
from tests.helpers.plots import drawn_panels, names_by_panel
from tests.helpers.run import REPO


@pytest.mark.parametrize("name", ["bench_network.json", "bench_network_slow_vm.json"])
def test_a_network_bench_plot_draws_every_method_readably(name: str, tmp_path: Path) -> None:
    report = json.loads((REPO / "docs" / name).read_text())
    plot(report, tmp_path / "net.png")
    panels = drawn_panels(tmp_path / "net.png")
    methods = {setting["method"] for entry in report["links"].values() for setting in entry["settings"].values()}
    names = names_by_panel(panels)
    floor = {name for name in names[0] if name.startswith("1 rank, no communication")}
    assert len(floor) == 1 and names[0] == methods | floor, names
    assert panels[0]["yscale"] == "log"
    if report["links"].get(report["bucket_link"]):
        assert names[1] == methods
