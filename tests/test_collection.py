"""Every tier collects its tests in one order, whatever Python's hash seed: pytest-xdist refuses to run
when its workers collect differently ("Different tests were collected between gw0 and gw1"), which a
parametrize over a set once did to `./quickstart.sh test -m slow` (README, Tests)."""

from __future__ import annotations

import subprocess
import sys

from tests.helpers.run import REPO, clean_env

EVERY_TIER = "slow or not slow or slurm or gpu"


def test_the_whole_suite_collects_in_the_same_order_under_any_hash_seed() -> None:
    command = [sys.executable, "-m", "pytest", "-m", EVERY_TIER, "--collect-only", "-q", "-p", "no:cacheprovider"]
    collections = [
        subprocess.Popen(command, cwd=REPO, env=clean_env(PYTHONHASHSEED=seed), stdout=subprocess.PIPE, text=True)
        for seed in ("1", "2")
    ]
    orders = []
    for process in collections:
        output, _ = process.communicate(timeout=300)
        assert process.returncode == 0, output[-3000:]
        orders.append([line for line in output.splitlines() if "::" in line])
    assert len(orders[0]) > 500, orders[0][-5:]
    different = [(first, second) for first, second in zip(*orders, strict=True) if first != second]
    assert not different, f"{len(different)} tests collected in another order, first: {different[0]}"


def test_ci_runs_the_slow_shard_this_stop_names() -> None:
    """`.ci/run` reads this stop's third of the slow tier from `.ci/slow_shard` (moved on at each stop)."""
    from tests.slow_shards import parse_shard

    index, count = parse_shard((REPO / ".ci" / "slow_shard").read_text().strip())
    assert count == 3 and 1 <= index <= 3
    assert "$(cat .ci/slow_shard)" in (REPO / ".ci" / "run").read_text()
