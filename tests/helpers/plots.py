"""Read what a ddp-app PNG says it draws (app/figures.py) and check that a person can read it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from app.figures import read_panels, readable


def drawn_panels(png: Path) -> list[dict[str, Any]]:
    """The panels the PNG records; every series on them readable on its axis."""
    panels = read_panels(png)
    assert panels, f"{png} records no panels"
    for panel in panels:
        for series in panel["series"]:
            low = min(series["min"], series.get("base", series["min"]))  # a bar is drawn from its base
            axis_low, axis_high = panel["ylim"]
            assert axis_low <= low and series["max"] <= axis_high, (series, panel["ylim"])
            assert readable(low, series["max"], axis_low, axis_high, panel["yscale"] == "log"), (
                f"{series['name']} ({low:g} to {series['max']:g}) is flattened on the y axis "
                f"{axis_low:g} to {axis_high:g} ({panel['yscale']}) of panel {panel['ylabel'] or panel['title']!r}"
            )
    return panels


def names_by_panel(panels: list[dict[str, Any]]) -> list[set[str]]:
    return [{series["name"] for series in panel["series"]} for panel in panels]
