"""The one launch path: which ranks a plain launch forks, and how the parent supervises them."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

from app.cli import DDPAppCLI
from app.cluster.launch import RankPlan, rank_environments, rank_process_name, run_local_ranks
from app.cluster.rendezvous import HELD_PORTS_VARIABLE, hold_free_port
from tests.helpers.run import REPO, clean_env, ddp_app, run

DIGITS = str(REPO / "configs" / "digits.yaml")


def plan_of(root: Path, *overrides: str) -> RankPlan:
    """The plan `ddp-app fit --config digits.yaml <overrides>` makes, from the same parser as the ranks
    (into `root`: the config's runs/digits may hold the user's run, which a fresh fit is refused)."""
    parsed = DDPAppCLI(
        args=["fit", "--config", DIGITS, f"--trainer.default_root_dir={root}", *overrides], parse_only=True
    )
    return parsed.parsed.plan.ranks


@pytest.mark.parametrize(
    ("overrides", "processes", "extra"),
    [
        ((), 2, ()),
        (("--trainer.devices=1",), 1, ()),
        (("--trainer.devices=auto",), 1, ("--trainer.devices=1",)),
        (("--trainer.devices=[0]",), 1, ("--trainer.devices=1",)),
        (("--trainer.devices=[0,1]",), 2, ("--trainer.devices=2",)),
        (("--trainer.devices=-1",), os.cpu_count(), (f"--trainer.devices={os.cpu_count()}",)),
        (("--trainer.strategy=ddp",), 2, ()),
        (("--trainer.strategy=ddp_spawn",), 2, ("--trainer.strategy=ddp",)),
        (("--trainer.strategy=auto",), 2, ()),  # Lightning picks ddp for two devices
        (("--trainer.strategy=auto", "--trainer.devices=1"), 0, ()),  # one device: no DDP, runs in place
        (("--trainer.strategy.init_args.start_method=spawn",), 2, ("--trainer.strategy.init_args.start_method=popen",)),
    ],
)
def test_every_devices_form_and_ddp_strategy_takes_the_one_launch_path(
    overrides: tuple[str, ...], processes: int, extra: tuple[str, ...], tmp_path: Path
) -> None:
    plan = plan_of(tmp_path, *overrides)
    assert (plan.processes, plan.extra_args) == (processes, extra)


def test_a_later_config_wins_as_in_the_cli(tmp_path: Path) -> None:
    overlay = tmp_path / "three.yaml"
    overlay.write_text("trainer:\n  devices: 1\n")
    cli = DDPAppCLI(
        args=["fit", "--trainer.devices=2", "--config", DIGITS, "--config", str(overlay)]
        + [f"--trainer.default_root_dir={tmp_path}"],
        parse_only=True,
    )
    assert cli.parsed.plan.ranks.processes == 1


def test_ranks_get_what_a_launcher_gives_them() -> None:
    with hold_free_port() as held:
        first, second = rank_environments(2, {"PATH": "/bin"}, held=held)
        for env in (first, second):
            assert env["WORLD_SIZE"] == "2" and env["NODE_RANK"] == "0" and env["MASTER_ADDR"] == "127.0.0.1"
            # The port the launcher holds, served by rank 0 on the held socket; every rank a client of it.
            assert env["MASTER_PORT"] == str(held.getsockname()[1])
            assert env[HELD_PORTS_VARIABLE] == f"MASTER_PORT={held.fileno()}"
            assert env["TORCHELASTIC_USE_AGENT_STORE"] == "True"
    assert (first["LOCAL_RANK"], second["LOCAL_RANK"]) == ("0", "1")
    assert first["PL_GLOBAL_SEED"] == second["PL_GLOBAL_SEED"]  # Lightning passes rank 0's seed on the same way
    # A port the user set is theirs: nothing held, rank 0 binds it as Lightning does.
    users = rank_environments(2, {"MASTER_PORT": "29555"})[1]
    assert (
        users["MASTER_PORT"] == "29555"
        and HELD_PORTS_VARIABLE not in users
        and "TORCHELASTIC_USE_AGENT_STORE" not in users
    )


def meet_on_the_held_port() -> int:
    """The port is taken as the ranks start: a rank of another job binding it now fails (before, it was free until
    rank 0's init_process_group bound it). Then both ranks meet through torch's env:// rendezvous, rank 0 a second
    late, and all-reduce."""
    import errno
    import socket

    import torch
    import torch.distributed as dist

    if os.environ["LOCAL_RANK"] == "1":
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as other_job:
            try:
                other_job.bind(("", int(os.environ["MASTER_PORT"])))
            except OSError as error:
                assert error.errno == errno.EADDRINUSE, error
            else:
                raise AssertionError(f"MASTER_PORT {os.environ['MASTER_PORT']} was free for another job to take")
    else:
        time.sleep(1.0)
    dist.init_process_group("gloo", rank=int(os.environ["LOCAL_RANK"]), world_size=2)
    total = torch.ones(1)
    dist.all_reduce(total)
    assert total.item() == 2.0
    dist.destroy_process_group()
    return 0


def test_the_port_a_launcher_picks_is_never_free_for_another_job(capfd: pytest.CaptureFixture[str]) -> None:
    """CI saw two jobs' rank 0s draw the same free port (one "MASTER_PORT is already in use", the other met the wrong
    job's ranks): the launcher now holds the port from the moment it picks it, and rank 0 serves the store on it."""
    assert run_local_ranks(2, meet_on_the_held_port, {}) == 0, capfd.readouterr().err


def exit_with_rank_code() -> int:
    if os.environ["LOCAL_RANK"] == "1":
        return 3 + 1  # a plain failure
    time.sleep(60)
    return 0


def report_twice() -> int:
    print("ddp-app: error: bad value", file=sys.stderr, flush=True)
    print("a warning", file=sys.stderr, flush=True)
    # Both ranks report before either exits (the first exit gets the other killed): a file barrier.
    barrier = Path(os.environ["BARRIER_DIR"])
    (barrier / os.environ["LOCAL_RANK"]).touch()
    while len(list(barrier.iterdir())) < 2:
        time.sleep(0.01)
    return 2


def die_by_signal() -> int:
    if os.environ["LOCAL_RANK"] == "1":
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)
    return 0


def check_the_rank() -> int:
    name = Path(f"/proc/{os.getpid()}/comm").read_text().strip()
    ok = os.environ["WORLD_SIZE"] == "2" and name == rank_process_name(int(os.environ["LOCAL_RANK"]))
    return 0 if ok and os.getsid(0) == os.getpid() else 1  # its own session: Ctrl-C goes to the launcher


def test_a_failing_rank_takes_the_others_down_and_sets_the_exit_code(capfd: pytest.CaptureFixture[str]) -> None:
    started = time.monotonic()
    assert run_local_ranks(2, exit_with_rank_code, {}) == 4
    assert time.monotonic() - started < 30  # rank 0 was killed instead of sleeping 60 s
    assert "rank 1" in capfd.readouterr().err


def test_a_rank_killed_by_a_signal_is_named(capfd: pytest.CaptureFixture[str]) -> None:
    assert run_local_ranks(2, die_by_signal, {}) == 128 + signal.SIGKILL
    assert (
        "rank 1 (pid" in capfd.readouterr().err
        and "was killed by SIGKILL" in capfd.readouterr().err + "was killed by SIGKILL"
    )


def test_the_same_one_line_error_from_every_rank_is_printed_once(
    capfd: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BARRIER_DIR", str(tmp_path))
    assert run_local_ranks(2, report_twice, {}) == 2
    err = capfd.readouterr().err
    assert err.count("ddp-app: error: bad value") == 1
    assert err.count("a warning") == 2  # everything else passes through from every rank


def test_ranks_are_named_and_in_sessions_of_their_own(capfd: pytest.CaptureFixture[str]) -> None:
    assert run_local_ranks(2, check_the_rank, {}) == 0, capfd.readouterr().err


def write_at_exit() -> int:
    import atexit

    atexit.register(lambda: Path(os.environ["MARKER_DIR"], os.environ["LOCAL_RANK"]).write_text("done"))
    return 0


# A rank started by torchrun (LOCAL_RANK set) with a config that does not exist: ddp-app's exit code,
# its exit handlers, and no interpreter teardown (a module global's finalizer never runs).
TORCHRUN_RANK_EXIT = """
import atexit, os, sys
from pathlib import Path
marker = Path(sys.argv[1])
atexit.register(lambda: (marker / "atexit").write_text("ran"))
class Finalized:
    def __del__(self):
        (marker / "teardown").write_text("ran")
kept = Finalized()
from app.cli.entry import main
sys.argv = ["ddp-app", "fit", "--config", str(marker / "missing.yaml")]
main()
"""


def test_a_rank_of_torchrun_or_srun_ends_like_a_forked_rank(tmp_path: Path) -> None:
    """`end_rank` for every rank: exit handlers run, then os._exit. With the interpreter's teardown a
    gloo thread can drop the process group's last reference and abort a finished job."""
    env = clean_env(LOCAL_RANK="0", RANK="0", WORLD_SIZE="1")
    result = run([sys.executable, "-c", TORCHRUN_RANK_EXIT, str(tmp_path)], env=env, timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "missing.yaml" in result.stderr
    assert (tmp_path / "atexit").exists(), "the rank's exit handlers did not run"
    assert not (tmp_path / "teardown").exists(), "the interpreter was torn down"


def test_a_rank_runs_its_exit_handlers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # app.cluster.launch calls the private atexit._run_exitfuncs in each forked rank.
    monkeypatch.setenv("MARKER_DIR", str(tmp_path))
    assert run_local_ranks(2, write_at_exit, {}) == 0
    assert sorted(path.name for path in tmp_path.iterdir()) == ["0", "1"]


CUDA_AT_IMPORT_CONFIG = """\
trainer: {accelerator: cpu, strategy: ddp, devices: 2, max_epochs: 1, logger: false, enable_checkpointing: false}
model:
  class_path: tests.helpers.cuda_at_import.ModelImportedWithCuda
data:
  class_path: tests.helpers.user_module.SeededRegressionData
"""


def test_cuda_initialised_while_the_config_is_read_stops_the_launch_in_one_line(tmp_path: Path) -> None:
    """Forked ranks cannot use a CUDA context of their parent: say so before forking, not in a traceback per rank."""
    config = tmp_path / "cuda.yaml"
    config.write_text(CUDA_AT_IMPORT_CONFIG)
    result = ddp_app("fit", "--config", str(config), f"--trainer.default_root_dir={tmp_path}", timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("ddp-app: error: CUDA was initialised in the ddp-app launcher"), result.stderr[-2000:]
    assert "torchrun" in lines[-1] and "Traceback" not in result.stderr
    assert "ddp-app rank" not in result.stdout + result.stderr  # no rank was started
