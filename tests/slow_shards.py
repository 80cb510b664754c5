"""The slow tier in thirds, so CI runs one third each stop (`.ci/run`; issue 56).

A module's slow tests stay together (they share module-scoped runs, trained once per module). Modules
go to shards longest first, each to the shard with the least time so far, by the durations kept in
`tests/slow_durations.json` (seconds per module; a module not listed counts `UNMEASURED_S`, so an
empty file splits by module count). The same file always gives the same shards, on any machine.
Record durations there from a whole slow-tier run (`--durations=0`) to balance the thirds by time.
"""

from __future__ import annotations

import json
from pathlib import Path

DURATIONS = Path(__file__).with_name("slow_durations.json")
UNMEASURED_S = 120.0


def parse_shard(value: str) -> tuple[int, int]:
    """`K/N` (1 <= K <= N) as (K, N)."""
    index, _, count = value.partition("/")
    try:
        k, n = int(index), int(count)
    except ValueError:
        raise ValueError(f"--slow-shard {value!r}: expected K/N, e.g. 1/3") from None
    if not 1 <= k <= n:
        raise ValueError(f"--slow-shard {value!r}: K must be between 1 and N")
    return k, n


def shards(modules: list[str], count: int, durations: dict[str, float] | None = None) -> list[list[str]]:
    """`modules` in `count` shards of about equal measured time (longest first, to the emptiest shard)."""
    durations = json.loads(DURATIONS.read_text()) if durations is None else durations
    cost = {module: float(durations.get(module, UNMEASURED_S)) for module in modules}
    bins: list[list[str]] = [[] for _ in range(count)]
    totals = [0.0] * count
    for module in sorted(modules, key=lambda module: (-cost[module], module)):
        emptiest = totals.index(min(totals))
        bins[emptiest].append(module)
        totals[emptiest] += cost[module]
    return bins
