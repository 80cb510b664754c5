"""The tests' zygote (tests/helpers/zygote.py) runs a `ddp-app` command as a new interpreter would:
same output and exit status, the command's own environment and working directory, and every process
of its job found and stopped by `kill_job`."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.run import (
    BIN,
    EXEC_ONLY,
    REPO,
    clean_env,
    kill_job,
    live_job_processes,
    rank_pids,
    start,
    start_interpreter,
    zygote,
)
from tests.helpers.zygote import ForkedCommand


def both_ways(args: list[str], env: dict[str, str], cwd: Path) -> tuple[tuple, tuple]:
    """(returncode, stdout, stderr) of the command forked from the zygote and as a new interpreter."""
    forked = start(args, env=env, cwd=cwd)
    assert isinstance(forked, ForkedCommand)
    outcomes = []
    for process in (forked, start_interpreter(args, env, cwd)):
        stdout, stderr = process.communicate(timeout=120)
        outcomes.append((process.returncode, stdout, stderr))
    return outcomes[0], outcomes[1]


@pytest.mark.more_cases  # two new interpreters (about 20 s): the default run's, not the quick tier's
@pytest.mark.skipif(EXEC_ONLY, reason="DDP_APP_TESTS_EXEC=1: every command is a new interpreter")
def test_a_forked_command_reads_its_own_environment_and_directory_and_exits_as_the_interpreter_would(
    tmp_path: Path,
) -> None:
    (tmp_path / "my.yaml").write_text("trainer:\n  max_epochs: 7\n")
    env = clean_env(DDP_APP_TEST_SEEN="from the test")
    args = [str(BIN / "ddp-app"), "fit", "--config", str(REPO / "configs" / "digits.yaml"), "--config", "my.yaml"]
    forked, executed = both_ways([*args, "--print_config"], env, tmp_path)
    assert forked == executed
    assert forked[0] == 0 and "max_epochs: 7" in forked[1]  # my.yaml, relative to the command's directory

    forked, executed = both_ways([*args, "--trainer.max_epochs=many"], env, tmp_path)
    assert forked == executed
    assert forked[0] == 2 and "max_epochs" in forked[2], forked[2]


@pytest.mark.distributed
@pytest.mark.skipif(EXEC_ONLY, reason="DDP_APP_TESTS_EXEC=1: every command is a new interpreter")
def test_kill_job_finds_and_stops_every_rank_of_a_forked_command(tmp_path: Path) -> None:
    args = [str(BIN / "ddp-app"), "fit", "--config", "configs/digits.yaml", "--trainer.max_epochs=50",
            f"--trainer.default_root_dir={tmp_path}", "--trainer.enable_progress_bar=false"]  # fmt: skip
    job = start(args)
    assert isinstance(job, ForkedCommand)
    try:
        deadline = time.monotonic() + 120
        while len(rank_pids(job.pid)) < 2 and job.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        ranks = rank_pids(job.pid)
        assert sorted(ranks) == [0, 1], job.poll()
        assert set(ranks.values()) | {job.pid} <= set(live_job_processes(job.pid))
        members = live_job_processes(job.pid)
        assert os.getpid() not in members and zygote().process.pid not in members
    finally:
        kill_job(job.pid)
        job.wait(timeout=60)
    deadline = time.monotonic() + 30
    while live_job_processes(job.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert live_job_processes(job.pid) == []


@pytest.mark.more_cases  # two new interpreters (about 20 s): the default run's, not the quick tier's
@pytest.mark.skipif(EXEC_ONLY, reason="DDP_APP_TESTS_EXEC=1: every command is a new interpreter")
def test_a_forked_python_m_command_runs_its_module_as_main_as_the_interpreter_would(tmp_path: Path) -> None:
    """`python -m app ...` runs app/__main__.py as __main__, though the zygote imported it already; a
    module of the tests sees the working directory first on sys.path and its own file as argv[0]."""
    env = clean_env()
    args = [sys.executable, "-m", "app", "fit", "--config", str(REPO / "configs" / "digits.yaml"), "--print_config"]
    forked, executed = both_ways(args, env, tmp_path)
    assert forked == executed and forked[0] == 0 and "max_epochs:" in forked[1], forked
    script = tmp_path / "tests" / "where.py"
    script.parent.mkdir()
    (script.parent / "__init__.py").write_text("")
    script.write_text("import os, sys\nprint(__name__, sys.argv, sys.path[0] == os.getcwd())\nsys.exit(3)\n")
    forked, executed = both_ways([sys.executable, "-m", "tests.where", "a b"], env, tmp_path)
    assert forked == executed, (forked, executed)
    assert forked[0] == 3 and forked[1] == f"__main__ [{str(script)!r}, 'a b'] True\n", forked
