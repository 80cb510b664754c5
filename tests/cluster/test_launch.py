"""`ddp-app` starts every local rank up front only when it is sure what Lightning would do."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from app.cluster.launch import local_ranks_to_start, rank_environments, run_local_ranks
from tests.helpers.run import REPO

DIGITS = str(REPO / "configs" / "digits.yaml")


def write_config(tmp_path: Path, trainer: str) -> str:
    path = tmp_path / "config.yaml"
    path.write_text(f"trainer:\n{trainer}")
    return str(path)


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["fit", "--config", DIGITS], 2),
        (["fit", f"--config={DIGITS}"], 2),
        (["validate", "--config", DIGITS, "--ckpt_path", "last"], 2),
        (["fit", "--config", DIGITS, "--trainer.devices", "1"], 0),
        (["fit", "--config", DIGITS, "--trainer.devices=3"], 3),
        (["fit", "--trainer.devices=4", "--config", DIGITS], 2),  # the config comes later and wins
        (["fit", "--config", DIGITS, "--trainer.num_nodes=2"], 0),
        (["fit", "--config", DIGITS, "--trainer.strategy=ddp_spawn"], 0),
        (["fit", "--config", DIGITS, "--trainer.strategy=ddp"], 2),
        (["fit", "--config", DIGITS, "--trainer.devices=auto"], 0),
        (["fit", "--config", DIGITS, "--trainer.devices=[0,1]"], 0),
        (["fit", "--config", DIGITS, "--trainer.accelerator=tpu"], 0),
        (["fit", "--config", DIGITS, "--print_config"], 0),
        (["fit", "--config", DIGITS, "--help"], 0),
        (["--config", DIGITS], 0),  # no subcommand
        (["fit", "--config", "no/such/file.yaml"], 0),  # the CLI reports it
        (["fit", "--trainer.devices=2", "--trainer.strategy=ddp"], 2),
        (["fit", "--trainer.devices=2"], 0),  # strategy "auto": Lightning decides
    ],
)
def test_which_commands_start_their_ranks_up_front(argv: list[str], expected: int) -> None:
    assert local_ranks_to_start(argv, {}) == expected


@pytest.mark.parametrize(
    "variable", ["LOCAL_RANK", "RANK", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "SLURM_PROCID", "DDP_APP_LAUNCHER"]
)
def test_an_existing_launcher_or_the_opt_out_leaves_it_to_lightning(variable: str) -> None:
    env = {variable: "lightning" if variable == "DDP_APP_LAUNCHER" else "0"}
    assert local_ranks_to_start(["fit", "--config", DIGITS], env) == 0


def test_a_ddp_strategy_object_counts_unless_it_spawns(tmp_path: Path) -> None:
    strategy = "  devices: 2\n  strategy:\n    class_path: lightning.pytorch.strategies.DDPStrategy\n"
    assert local_ranks_to_start(["fit", "--config", write_config(tmp_path, strategy)], {}) == 2
    spawning = strategy + "    init_args:\n      start_method: spawn\n"
    assert local_ranks_to_start(["fit", "--config", write_config(tmp_path, spawning)], {}) == 0


def test_ranks_get_what_lightnings_launcher_gives_them() -> None:
    first, second = rank_environments(2, {"PATH": "/bin"})
    assert (first["LOCAL_RANK"], second["LOCAL_RANK"]) == ("0", "1")
    for env in (first, second):
        assert env["WORLD_SIZE"] == "2" and env["NODE_RANK"] == "0" and env["MASTER_ADDR"] == "127.0.0.1"
        assert env["PATH"] == "/bin"
    # One rendezvous port and one seed for all ranks (Lightning passes rank 0's seed on the same way).
    assert first["MASTER_PORT"] == second["MASTER_PORT"]
    assert first["PL_GLOBAL_SEED"] == second["PL_GLOBAL_SEED"]


def run_ranks(tmp_path: Path, script: str, capfd: pytest.CaptureFixture[str]) -> tuple[int, str]:
    path = tmp_path / "rank.py"
    path.write_text(script)
    code = run_local_ranks(2, [sys.executable, str(path)], {"PATH": "/usr/bin:/bin"})
    return code, capfd.readouterr().err


def test_a_failing_rank_takes_the_others_down_and_sets_the_exit_code(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    script = "import os, sys, time\nif os.environ['LOCAL_RANK'] == '1':\n    sys.exit(3)\ntime.sleep(60)\n"
    code, _ = run_ranks(tmp_path, script, capfd)
    assert code == 3  # rank 1's code; rank 0 was killed instead of waiting 60 s


def test_the_same_one_line_error_from_every_rank_is_printed_once(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    script = (
        "import sys\nprint('ddp-app: error: bad value', file=sys.stderr)\n"
        "print('a warning', file=sys.stderr)\nimport time; time.sleep(0.5)\nsys.exit(2)\n"
    )  # the pause: both ranks have reported before the first exit gets the other one killed
    code, err = run_ranks(tmp_path, script, capfd)
    assert code == 2
    assert err.count("ddp-app: error: bad value") == 1
    assert err.count("a warning") == 2  # everything else passes through from every rank


def test_all_ranks_succeeding_is_success(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    code, err = run_ranks(tmp_path, "import os\nassert os.environ['WORLD_SIZE'] == '2'\n", capfd)
    assert code == 0, err
