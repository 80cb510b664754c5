"""`python -m app.bench --profile FIRST:COUNT`: where rank 0's main thread spends a step, per side.

Each side's rank 0 runs cProfile over COUNT steady-state steps from step FIRST (the batch's fetch and every hook
included) and the bench prints the functions with the most own time per step. On a GPU a call that waits for the GPU
shows as its own time. cProfile slows Python more than kernels: read where the time goes from a profiled run, how much
from a plain one.
"""

from __future__ import annotations

import pstats
from pathlib import Path


def parse_profile_steps(text: str) -> tuple[int, int]:
    """ "FIRST:COUNT" -> (FIRST, COUNT), both positive."""
    first, _, count = text.partition(":")
    steps = (int(first), int(count))
    if steps[0] < 0 or steps[1] < 1:
        raise ValueError(text)
    return steps


def _where(function: tuple[str, int, str]) -> str:
    file, line, name = function
    if file == "~":  # a builtin: "<built-in method torch.conv2d>"
        return name
    for marker in ("site-packages/", "/app/", "/lib/python"):
        if marker in file:
            file = ("app/" if marker == "/app/" else "") + file.split(marker, 1)[1]
            break
    return f"{file}:{line}({name})"


def profile_table(prof: Path, steps: int, top: int = 25) -> str:
    """The `top` functions by own time, in ms and calls per step, after the profiled total per step."""
    stats = pstats.Stats(str(prof))
    rows = sorted(stats.stats.items(), key=lambda item: item[1][2], reverse=True)  # type: ignore[attr-defined]
    lines = [
        f"{stats.total_tt / steps * 1e3:.3f} ms per step profiled; own time per step, calls per step, function:"  # type: ignore[attr-defined]
    ]
    for function, (_, calls, own, _cumulative, _) in rows[:top]:
        lines.append(f"{own / steps * 1e3:9.3f} ms {calls / steps:8.1f}  {_where(function)}")
    return "\n".join(lines)
