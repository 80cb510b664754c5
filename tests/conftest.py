"""Shared fixtures: leave no distributed state or launcher variables behind, and the user's runs alone."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch.distributed
from lightning.pytorch.utilities import rank_zero_only

from app.cluster.launch import LAUNCHER_VARIABLES
from tests import slow_shards
from tests.helpers import run
from tests.helpers.run import REPO

# Tiers that start processes, need the Slurm cluster or take long; every other test is `quick`.
# `more_cases`: further command tests whose case or mechanism the quick tier already runs once (a
# bad input refused in one line, a subprocess that must not import something; each starts a
# process, 4.5 to 7 s of imports on a 2-core machine); the default run has them all.
NOT_QUICK = ("distributed", "slurm", "parity", "slow", "gpu", "more_cases")


# The default run's longest modules (each runs on one worker, `--dist loadgroup`), longest first: started
# first, so that the two workers finish together instead of one waiting for the other's last long module.
LONGEST_FIRST = (
    "tests/fault/test_resume_matrix.py",
    "tests/test_readme_tour.py",
    "tests/fault/test_hangs.py",
    "tests/reference/test_reference.py",
    "tests/fault/test_resume_check.py",
    "tests/test_bench.py",
    "tests/fault/test_resume.py",
    "tests/tracking/test_trackers.py",
    "tests/fault/test_restart.py",
    "tests/fault/test_elastic_resume.py",
)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--slow-shard",
        default=None,
        help="K/N: of the `slow` tests, run only those of shard K of N (tests/slow_shards.py); CI runs one "
        "shard per stop beside the default run (.ci/run).",
    )
    parser.addoption(
        "--slow-budget-min",
        type=float,
        default=None,
        help="Minutes after which a pytest process starts no further `slow` test (each is skipped, saying "
        "so): keeps CI's slow shard inside its share of CI's time.",
    )


SESSION_STARTED = time.monotonic()


def keep_one_slow_shard(config: pytest.Config, items: list[pytest.Item]) -> None:
    """`--slow-shard K/N`: deselect the slow tests of the other shards (whole modules go together)."""
    written = config.getoption("--slow-shard")
    if not written:
        return
    index, count = slow_shards.parse_shard(written)
    modules = sorted({item.nodeid.split("::")[0] for item in items if item.get_closest_marker("slow")})
    kept = set(slow_shards.shards(modules, count)[index - 1])
    deselected = [item for item in items if item.get_closest_marker("slow") and item.nodeid.split("::")[0] not in kept]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = [item for item in items if item not in deselected]


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups (its own hook of the same name)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """`quick`: every in-process test, plus the few marked `quick` by hand (one real 2-rank fit,
    one Lightning-vs-reference check): the tier to run before every commit (README, Tests)."""
    keep_one_slow_shard(config, items)
    rank = {module: index for index, module in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable: the rest in order
    for item in items:
        if not any(item.get_closest_marker(name) for name in NOT_QUICK):
            item.add_marker(pytest.mark.quick)
        # Under pytest-xdist's `--dist loadgroup` (README, Tests) a module runs on one worker, so its
        # module-scoped runs are trained once; the Slurm tier shares one cluster, on one worker; the tests
        # that create the bench's fixed-name namespaces (app/bench/netns.py) take turns on one worker.
        group = item.nodeid.split("::")[0]
        for shared in ("slurm", "network_namespaces"):
            if item.get_closest_marker(shared):
                group = shared
        item.add_marker(pytest.mark.xdist_group(group))


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Stop this test process's zygote (tests/helpers/zygote.py), if a test started it."""
    run.stop_zygote()


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Let `tests.helpers.run` check that a test which starts several ranks is marked `distributed`
    (set before any fixture runs: a module-scoped fixture may start the ranks); skip a slow test once
    `--slow-budget-min` is spent."""
    run.CURRENT_MARKERS = {marker.name for marker in item.iter_markers()}
    budget_min = item.config.getoption("--slow-budget-min")
    if budget_min is not None and item.get_closest_marker("slow"):
        spent_min = (time.monotonic() - SESSION_STARTED) / 60
        if spent_min > budget_min:
            pytest.skip(f"--slow-budget-min {budget_min:g} spent ({spent_min:.0f} min): runs in a later CI stop")


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


# What a user's commands write in the repository: `./quickstart.sh train` writes runs/digits and the
# README's tour the rest of runs/; a fit without a default_root_dir writes lightning_logs/ (and a tool
# its outputs) into the working directory, the repository for a test. A test that read them would pass
# or fail by what the user ran before (issue 42: 12 failures after `./quickstart.sh train`); one that
# wrote them would change the user's runs. So a test gives every run a directory of its own (tmp_path).
USER_RUNS = run.REPO / "runs"


def user_output() -> dict[str, int]:
    """The repository's top-level names (but dot-names: tooling's caches) and every path under runs/
    with its modification time (ns)."""
    state = {entry.name: 0 for entry in run.REPO.iterdir() if not entry.name.startswith(".")}
    for directory, names, files in os.walk(USER_RUNS):
        for name in (*names, *files):
            path = os.path.join(directory, name)
            with contextlib.suppress(FileNotFoundError):
                state[path] = os.lstat(path).st_mtime_ns
    return state


def changes(before: dict[str, int], after: dict[str, int]) -> list[str]:
    return sorted(
        {f"{name} (new)" for name in after.keys() - before.keys()}
        | {f"{name} (gone)" for name in before.keys() - after.keys()}
        | {f"{name} (rewritten)" for name in before.keys() & after.keys() if before[name] != after[name]}
    )


@pytest.fixture(scope="session")
def user_output_seen() -> Iterator[dict[str, int]]:
    """The user's outputs as the last check saw them; at the session's end a session or module
    fixture's teardown is checked too."""
    seen = user_output()
    yield seen
    changed = changes(seen, user_output())
    if changed:
        pytest.fail(f"the test session changed the user's outputs in {run.REPO}: {changed[:10]}")


@pytest.fixture(autouse=True)
def leave_the_users_runs_alone(user_output_seen: dict[str, int]) -> Iterator[None]:
    """Fail a test that wrote into runs/ or the repository's top level. Compared with the state after
    the previous test, so a wider-scoped fixture set up for this test is caught here too."""
    yield
    now = user_output()
    changed = changes(user_output_seen, now)
    user_output_seen.clear()
    user_output_seen.update(now)
    if changed:
        pytest.fail(
            f"this test (or its fixtures; under pytest-xdist possibly a test running beside it) changed "
            f"the user's outputs in {run.REPO}: {changed[:10]}. Fix: give its runs "
            f"--trainer.default_root_dir under tmp_path, or run it with cwd=tmp_path."
        )


@pytest.fixture(scope="session")
def digits_trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default job (configs/digits.yaml) trained on 2 ranks for 3 epochs, once per test session:
    its run directory (`checkpoints/last.ckpt`, logs). Read it only: `tests.helpers.run.copy_of`
    gives a test a directory of its own to write into."""
    root = tmp_path_factory.mktemp("digits_trained")
    run.train("configs/digits.yaml", root, epochs=3)
    return root


@pytest.fixture(scope="session")
def shipped_config_overrides(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[str]]:
    """The data_dir overrides for the shipped configs whose data the launcher checks before any rank
    starts (their `data/imagenet` is a placeholder; app/run/config_checks.py): 10 class folders of small
    JPEGs, and their shards. By config file name; `.get(name, [])` for the others."""
    from app.bench.data import write_image_folder
    from app.data.shard import main as shard_main

    folder = write_image_folder(tmp_path_factory.mktemp("images"), images=20, classes=10, pixels=16)
    shards = tmp_path_factory.mktemp("shards") / "out"
    image_config = str(REPO / "configs" / "imagefolder_resnet18.yaml")
    assert shard_main(["--config", image_config, "--out", str(shards), f"--data.init_args.data_dir={folder}"]) == 0
    return {
        "imagefolder_resnet18.yaml": [f"--data.init_args.data_dir={folder}"],
        "streaming_resnet18.yaml": [f"--data.init_args.data_dir={shards}"],
    }
