"""What every PNG ddp-app writes records about itself, and when two series may share a y axis.

`save` stores, as PNG text under PANELS_KEY, one JSON entry per panel: title, labels, limits and scales, secondary x
ticks, and per series (an artist with a legend label) its name, style and data min and max. Read it with
`read_panels(path)`, or PIL: `json.loads(Image.open(path).text["ddp-app:panels"])`.

Readability rule (`readable`): a series may share a y axis only where the axis shows it: its values span at least
MIN_SHARE of the axis's range, or it is flat (changes by at most FLAT_CHANGE of its level) and the axis shows its level
(log axes always; linear when the level is a tenth of the range). Log spans are in decades. `fits_one_axis` applies it
with matplotlib's default margins."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

PANELS_KEY = "ddp-app:panels"
MIN_SHARE = 0.1  # a tenth of the axis: series whose spans differ by more than ~10x get their own axes
FLAT_CHANGE = 0.25  # a series moving by at most this fraction of its level is flat: its level is what to read
Y_MARGIN = 0.05  # matplotlib's default axes.ymargin: autoscaled limits add this fraction on each side


def readable(low: float, high: float, axis_low: float, axis_high: float, log: bool = False) -> bool:
    """Whether a series with values in [low, high] is readable on a y axis from axis_low to axis_high (the module's
    docstring states the rule)."""
    level = max(abs(low), abs(high))
    if log:
        changes_visible = math.log10(high / low) >= MIN_SHARE * math.log10(axis_high / axis_low)
        level_visible = True
    else:
        changes_visible = high - low >= MIN_SHARE * (axis_high - axis_low)
        level_visible = level >= MIN_SHARE * (axis_high - axis_low)
    return changes_visible or (high - low <= FLAT_CHANGE * level and level_visible)


def fits_one_axis(ranges: list[tuple[float, float]], log: bool) -> bool:
    """Whether series with these (min, max) ranges all stay readable on one autoscaled y axis."""
    low, high = min(low for low, _ in ranges), max(high for _, high in ranges)
    if log:
        pad = (high / low) ** Y_MARGIN
        axis_low, axis_high = low / pad, high * pad
    else:
        axis_low, axis_high = low - Y_MARGIN * (high - low), high + Y_MARGIN * (high - low)
    return all(readable(series_low, series_high, axis_low, axis_high, log) for series_low, series_high in ranges)


def _finite(values: Iterable[Any]) -> list[float]:
    import numpy as np

    array = np.ma.filled(np.ma.asarray(list(values), dtype=float), np.nan).ravel()
    return [float(value) for value in array if math.isfinite(value)]


def _flatten(artists: Iterable[Any]) -> Iterable[Any]:
    for artist in artists:
        if isinstance(artist, tuple | list):
            yield from _flatten(artist)
        elif artist is not None:
            yield artist


def series_of(axis: Any) -> list[dict[str, Any]]:
    """The labelled data series drawn on one matplotlib Axes, with their data min and max."""
    drawn: list[tuple[str, str, list[float], dict[str, float]]] = []
    inside_containers = set()
    for container in axis.containers:
        inside_containers.update(id(artist) for artist in _flatten(container))
        if type(container).__name__ == "BarContainer":
            tops = _finite(patch.get_y() + patch.get_height() for patch in container.patches)
            bases = _finite(patch.get_y() for patch in container.patches)
            # a bar is read from its base: the base belongs to what it draws
            drawn.append((container.get_label(), "bar", tops, {"base": min(bases, default=0.0)}))
        elif type(container).__name__ == "ErrorbarContainer" and container.lines[0] is not None:
            drawn.append((container.get_label(), "errorbar", _finite(container.lines[0].get_ydata()), {}))
    for line in axis.lines:
        if id(line) not in inside_containers:
            drawn.append((line.get_label(), "line", _finite(line.get_ydata()), {}))
    for collection in axis.collections:
        if id(collection) not in inside_containers:
            offsets = collection.get_offsets()
            drawn.append((collection.get_label(), "scatter", _finite(offsets[:, 1] if len(offsets) else []), {}))
    return [
        {"name": name, "drawn": how, "min": min(values), "max": max(values), "n": len(values), **extra}
        for name, how, values, extra in drawn
        if values and name and not name.startswith("_")
    ]


def describe(figure: Any) -> list[dict[str, Any]]:
    """One entry per panel of a drawn figure (limits and tick labels are final only once drawn)."""
    panels = []
    for axis in figure.axes:
        secondary = [child for child in axis.child_axes if type(child).__name__ == "SecondaryAxis"]
        panels.append(
            {
                "title": " ".join(filter(None, (axis.get_title(loc) for loc in ("left", "center", "right")))),
                "xlabel": axis.get_xlabel(),
                "ylabel": axis.get_ylabel(),
                "xlim": [float(limit) for limit in axis.get_xlim()],
                "ylim": [float(limit) for limit in axis.get_ylim()],
                "xscale": axis.get_xscale(),
                "yscale": axis.get_yscale(),
                "top_axes": [
                    {
                        "label": child.get_xlabel(),
                        "ticks": [float(tick) for tick in child.get_xticks()],
                        "tick_labels": [label.get_text() for label in child.get_xticklabels()],
                    }
                    for child in secondary
                ],
                "series": series_of(axis),
            }
        )
    return panels


def save(figure: Any, path: Path, dpi: int) -> None:
    """Write the figure as a PNG that records its panels (PANELS_KEY), then close it."""
    import matplotlib.pyplot as plt

    figure.canvas.draw()
    metadata = {PANELS_KEY: json.dumps(describe(figure))}
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=dpi, metadata=metadata)
    plt.close(figure)


def read_panels(path: Path) -> list[dict[str, Any]]:
    """The panels a PNG written by `save` records."""
    from PIL import Image

    with Image.open(path) as image:
        return json.loads(image.text[PANELS_KEY])
