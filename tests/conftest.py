"""Shared fixtures: leave no distributed state or launcher variables behind."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch.distributed
from lightning.pytorch.utilities import rank_zero_only

from app.cluster.launch import LAUNCHER_VARIABLES
from tests.helpers import run

# Tiers that start processes, need the Slurm cluster or take long; every other test is `quick`.
# `more_cases`: further command tests whose case or mechanism the quick tier already runs once (a
# bad input refused in one line, a subprocess that must not import something; each starts a
# process, 4.5 to 7 s of imports on a 2-core machine); the default run has them all.
NOT_QUICK = ("distributed", "slurm", "parity", "slow", "gpu", "more_cases")


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups (its own hook of the same name)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """`quick`: every in-process test, plus the few marked `quick` by hand (one real 2-rank fit,
    one Lightning-vs-reference check): the tier to run before every commit (README, Tests)."""
    for item in items:
        if not any(item.get_closest_marker(name) for name in NOT_QUICK):
            item.add_marker(pytest.mark.quick)
        # Under pytest-xdist's `--dist loadgroup` (README, Tests) a module runs on one worker, so its
        # module-scoped runs are trained once; the Slurm tier shares one cluster, on one worker.
        group = "slurm" if item.get_closest_marker("slurm") else item.nodeid.split("::")[0]
        item.add_marker(pytest.mark.xdist_group(group))


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Let `tests.helpers.run` check that a test which starts several ranks is marked `distributed`
    (set before any fixture runs: a module-scoped fixture may start the ranks)."""
    run.CURRENT_MARKERS = {marker.name for marker in item.iter_markers()}


@pytest.fixture(autouse=True)
def restore_distributed_state() -> Iterator[None]:
    """Restore launcher variables and the rank-zero rank (Lightning sets them in-process) and destroy a
    leftover process group."""
    saved = {key: os.environ.get(key) for key in (*LAUNCHER_VARIABLES, "OMP_NUM_THREADS")}
    rank = rank_zero_only.rank  # DDPAppCLI and Lightning's strategies set it from a launch's variables
    yield
    rank_zero_only.rank = rank
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(scope="session")
def digits_trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default job (configs/digits.yaml) trained on 2 ranks for 3 epochs, once per test session:
    its run directory (`checkpoints/last.ckpt`, logs). Read it only: `tests.helpers.run.copy_of`
    gives a test a directory of its own to write into."""
    root = tmp_path_factory.mktemp("digits_trained")
    run.train("configs/digits.yaml", root, epochs=3)
    return root
