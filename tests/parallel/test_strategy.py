"""`trainer.strategy` is resolved once (app/parallel/strategy.py): every form a config may use gives the
kind the launcher, the checks and the tools act on, a user's own subclass included, and a name
nobody knows is one line that suggests the nearest (`fsdp2` -> `fsdp`)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from jsonargparse import Namespace
from lightning.pytorch.strategies import DDPStrategy

from app.cli.entry import check_before_launch
from app.cluster.exit_codes import BAD_INPUT_EXIT_CODE
from app.cluster.launch import rank_plan
from app.errors import UserFacingError
from app.parallel.fsdp import FSDP2Strategy
from app.parallel.strategy import (
    FSDP_CLASS_PATH,
    MeshLayout,
    StrategyKind,
    mesh_layout,
    resolve_strategy,
)
from app.run.plan import RunPlan, expand_strategy_names
from tests.helpers.run import REPO, clean_env, ddp_app


class UsersOwnDDP(DDPStrategy):
    """A user's subclass, named by its class path: not a name ddp-app knows, and still DDP."""


class UsersOwnFSDP(FSDP2Strategy):
    pass


HERE = __name__


@pytest.mark.parametrize(
    ("written", "world_size", "kind", "runs_as", "start_method"),
    [
        ("ddp", 2, StrategyKind.DDP, None, None),
        ("ddp_spawn", 2, StrategyKind.DDP, "ddp", None),
        ("ddp_notebook_find_unused_parameters_true", 2, StrategyKind.DDP, "ddp_find_unused_parameters_true", None),
        ("auto", 2, StrategyKind.DDP, None, None),
        ("auto", 1, StrategyKind.SINGLE, None, None),
        (None, 1, StrategyKind.SINGLE, None, None),
        ("single_device", 1, StrategyKind.SINGLE, None, None),
        ("fsdp", 2, StrategyKind.FSDP, None, None),
        ("deepspeed", 2, StrategyKind.OTHER, None, None),
        (Namespace(class_path="lightning.pytorch.strategies.DDPStrategy"), 2, StrategyKind.DDP, None, None),
        (
            Namespace(class_path="lightning.pytorch.strategies.DDPStrategy", init_args=Namespace(start_method="spawn")),
            2,
            StrategyKind.DDP,
            None,
            "spawn",
        ),
        ({"class_path": FSDP_CLASS_PATH}, 2, StrategyKind.FSDP, None, None),
        (Namespace(class_path=f"{HERE}.UsersOwnDDP"), 2, StrategyKind.DDP, None, None),
        (Namespace(class_path=f"{HERE}.UsersOwnFSDP"), 2, StrategyKind.FSDP, None, None),
        (UsersOwnDDP(), 2, StrategyKind.DDP, None, None),
    ],
)
def test_every_form_of_a_strategy_resolves_to_its_kind(written, world_size, kind, runs_as, start_method) -> None:
    resolved = resolve_strategy(written, world_size)
    assert (resolved.kind, resolved.runs_as, resolved.start_method) == (kind, runs_as, start_method)
    assert resolved.forks_ranks == (kind in (StrategyKind.DDP, StrategyKind.FSDP))
    assert resolved.is_sharded == (kind is StrategyKind.FSDP)


def test_a_users_ddp_subclass_forks_its_ranks_as_ddp_does() -> None:
    """Before, only a class path ending in `DDPStrategy` was forked; a subclass ran in one process."""
    plan = rank_plan(resolve_strategy(Namespace(class_path=f"{HERE}.UsersOwnDDP"), 2), 2, True, 2)
    assert plan.processes == 2
    spawned = rank_plan(resolve_strategy("ddp_spawn", 2), 2, True, 2)
    assert spawned.extra_args == ("--trainer.strategy=ddp",) and "runs as ddp" in spawned.notice


def test_strategy_fsdp_expands_to_fsdp2_and_other_names_stay() -> None:
    trainer = {"strategy": "fsdp"}
    expand_strategy_names(trainer)
    assert trainer["strategy"].class_path == FSDP_CLASS_PATH
    trainer = {"strategy": "ddp"}
    expand_strategy_names(trainer)
    assert trainer["strategy"] == "ddp"


@pytest.mark.parametrize(("written", "suggested"), [("fsdp2", "`fsdp`"), ("FSDP", "`fsdp`"), ("dpp", "`ddp`")])
def test_an_unknown_name_suggests_the_nearest(written: str, suggested: str) -> None:
    with pytest.raises(UserFacingError, match=f"Did you mean {suggested}") as raised:
        resolve_strategy(written, 2)
    assert "\n" not in str(raised.value) and repr(written) in str(raised.value)


def test_an_unknown_name_is_refused_by_the_launcher_before_any_rank(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        check_before_launch(["fit", "--config", str(REPO / "configs" / "digits.yaml"), "--trainer.strategy", "fsdp2"])
    assert exited.value.code == BAD_INPUT_EXIT_CODE
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "`fsdp`" in err, err


@pytest.mark.distributed
def test_the_issue_command_names_fsdp_in_one_line(tmp_path) -> None:
    """The acceptance line as a user types it (exit 2, one line, before any rank)."""
    result = ddp_app(
        "fit", "--config", "configs/digits.yaml", "--trainer.strategy", "fsdp2",
        "--trainer.default_root_dir", str(tmp_path / "run"), timeout=120, cwd=REPO, env=clean_env(),
    )  # fmt: skip
    assert isinstance(result, subprocess.CompletedProcess)
    assert result.returncode == BAD_INPUT_EXIT_CODE, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "`fsdp`" in lines[0], result.stderr
    assert not (tmp_path / "run").exists()


@pytest.fixture(scope="module")
def one_step_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """configs/gpt_fsdp.yaml trained one step under strategy ddp (a checkpoint of one file) and under
    strategy fsdp (a directory of shards), one rank each."""
    runs = {}
    for strategy in ("ddp", "fsdp"):
        root = tmp_path_factory.mktemp(strategy)
        result = ddp_app(
            "fit", "--config", "configs/gpt_fsdp.yaml", "--trainer.strategy", strategy, "--trainer.devices", "1",
            "--trainer.max_steps", "1", "--trainer.default_root_dir", str(root), timeout=300, cwd=REPO, env=clean_env(),
        )  # fmt: skip
        assert result.returncode == 0, result.stderr[-3000:]
        runs[strategy] = root
    return runs


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("written_by", "resumed_under", "named"), [("ddp", "fsdp", "one file"), ("fsdp", "ddp", "sharded")]
)
@pytest.mark.parametrize("ckpt_path", ["last", "file"])
def test_a_checkpoint_of_another_strategy_is_refused_before_any_rank(
    one_step_runs: dict[str, Path], written_by: str, resumed_under: str, named: str, ckpt_path: str,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    """Before, a DDP checkpoint resumed under fsdp was refused by every rank after the tracker had
    counted an attempt and the model summary had printed; now the launcher refuses it, and the run
    directory is left as it was."""
    root = one_step_runs[written_by]
    before = sorted(str(path) for path in root.rglob("*"))
    path = "last" if ckpt_path == "last" else str(root / "checkpoints" / "last.ckpt")
    args = ["fit", "--config", str(REPO / "configs" / "gpt_fsdp.yaml"), "--trainer.strategy", resumed_under,
            "--trainer.default_root_dir", str(root), "--ckpt_path", path, "--trainer.max_steps", "2"]  # fmt: skip
    with pytest.raises(SystemExit) as exited:
        check_before_launch(args)
    assert exited.value.code == BAD_INPUT_EXIT_CODE
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and named in err and f"--trainer.strategy {written_by}" in err, err
    assert sorted(str(path) for path in root.rglob("*")) == before


@pytest.mark.parametrize(
    ("shard_group_size", "world_size", "per_node", "replicas", "shards", "words"),
    [
        (None, 4, 2, 1, 4, "1 replica x 4 shards"),
        ("node", 4, 2, 2, 2, "2 replicas x 2 shards"),
        ("node", 2, 2, 1, 2, "1 replica x 2 shards"),  # one node: full sharding
        (2, 8, 8, 4, 2, "4 replicas x 2 shards"),
        (1, 2, 2, 2, 1, "2 replicas x 1 shard"),
    ],
)
def test_shard_group_size_lays_the_ranks_out_as_replicas_of_shard_groups(
    shard_group_size, world_size, per_node, replicas, shards, words
) -> None:
    written = Namespace(class_path=FSDP_CLASS_PATH, init_args=Namespace(shard_group_size=shard_group_size))
    layout = resolve_strategy(written).mesh(world_size, per_node)
    assert layout == MeshLayout(replicas, shards) and layout.describe() == words
    assert layout.is_hybrid == (replicas > 1)
    assert resolve_strategy(FSDP2Strategy(shard_group_size=shard_group_size)).mesh(world_size, per_node) == layout
    assert resolve_strategy("ddp").mesh(world_size, per_node) is None


@pytest.mark.parametrize(
    ("shard_group_size", "message"),
    [
        (3, r"^trainer\.strategy\.init_args\.shard_group_size=3 \(3 ranks\) does not divide the run's 4 ranks into "
            r"equal shard groups\. Fix: one of 1, 2, 4, `node`, or null"),
        (8, r"shard_group_size=8 \(8 ranks\) does not divide the run's 4 ranks"),
        (0, r"^trainer\.strategy\.init_args\.shard_group_size=0 is not a group size\. Fix: "),
        ("nodes", r"shard_group_size='nodes' is not a group size"),
    ],
)  # fmt: skip
def test_a_shard_group_size_that_cannot_lay_out_the_ranks_is_one_line(shard_group_size, message) -> None:
    with pytest.raises(UserFacingError, match=message):
        mesh_layout(shard_group_size, 4, 2)


def test_a_shard_group_size_that_does_not_divide_the_ranks_stops_the_launch_before_any_rank(tmp_path: Path) -> None:
    result = ddp_app(
        "fit", "--config", "configs/gpt_fsdp.yaml", "--trainer.strategy.init_args.shard_group_size=3",
        f"--trainer.default_root_dir={tmp_path / 'run'}", timeout=120,
    )  # fmt: skip
    assert result.returncode == BAD_INPUT_EXIT_CODE, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "shard_group_size=3 (3 ranks) does not divide the run's 2 ranks" in lines[0], lines
    assert "Fix: one of 1, 2, `node`, or null" in lines[0]
    assert not (tmp_path / "run").exists()  # nothing written: no rank started


GPT = ["fit", "--config", str(REPO / "configs" / "gpt_fsdp.yaml")]


def plan_of(tmp_path: Path, *args: str) -> RunPlan:
    return check_before_launch([*args, f"--trainer.default_root_dir={tmp_path}"]).plan


def test_a_strategy_name_takes_init_args_on_the_command_line(tmp_path: Path) -> None:
    """Issue 56: `--trainer.strategy fsdp --trainer.strategy.init_args.shard_group_size 2` ended in
    jsonargparse's "NestedArg ... expected str"; it is hybrid sharding 2 x 2 on 4 ranks."""
    plan = plan_of(tmp_path, *GPT, "--trainer.strategy", "fsdp", "--trainer.strategy.init_args.shard_group_size", "2",
                   "--trainer.devices", "4")  # fmt: skip
    assert plan.strategy.kind is StrategyKind.FSDP and plan.mesh == MeshLayout(2, 2)
    # The name is FSDP2 with its defaults: the config's own init_args (shard_modules) are not kept under it.
    named = plan_of(tmp_path, *GPT, "--trainer.strategy=fsdp", "--trainer.strategy.init_args.shard_group_size=1")
    assert named.mesh == MeshLayout(2, 1)
    # A Lightning name with registered arguments keeps them, and takes more.
    digits = str(REPO / "configs" / "digits.yaml")
    ddp = check_before_launch(["fit", "--config", digits, f"--trainer.default_root_dir={tmp_path}",
                               "--trainer.strategy", "ddp_find_unused_parameters_true",
                               "--trainer.strategy.init_args.static_graph", "false"])  # fmt: skip
    init_args = ddp.config["trainer"]["strategy"]["init_args"]
    assert ddp.plan.strategy.kind is StrategyKind.DDP and init_args["find_unused_parameters"] is True
    assert init_args["static_graph"] is False


def test_a_name_in_a_config_file_takes_init_args_from_the_command_line(tmp_path: Path) -> None:
    named = tmp_path / "named.yaml"
    named.write_text("trainer:\n  strategy: fsdp\n")
    plan = plan_of(tmp_path, *GPT, "--config", str(named), "--trainer.strategy.init_args.shard_group_size", "1")
    assert plan.strategy.kind is StrategyKind.FSDP and plan.mesh == MeshLayout(2, 1)


def test_a_class_path_works_with_or_without_init_args(tmp_path: Path) -> None:
    """Issue 56: `--trainer.strategy app.parallel.fsdp.FSDP2Strategy` alone was refused as an unknown name."""
    plan = plan_of(tmp_path, *GPT, "--trainer.strategy", FSDP_CLASS_PATH, "--trainer.devices", "4")
    assert plan.strategy.kind is StrategyKind.FSDP and plan.mesh == MeshLayout(1, 4)
    hybrid = plan_of(tmp_path, *GPT, "--trainer.strategy", FSDP_CLASS_PATH, "--trainer.devices", "4",
                     "--trainer.strategy.init_args.shard_group_size", "2")  # fmt: skip
    assert hybrid.mesh == MeshLayout(2, 2)
    own = plan_of(tmp_path, *GPT, "--trainer.strategy", f"{HERE}.UsersOwnFSDP")
    assert own.strategy.kind is StrategyKind.FSDP


def test_the_unknown_name_line_suggests_only_forms_that_work(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The fix the line gives (a class path such as FSDP2's) is accepted when followed; a class path that
    is no strategy is refused in one line naming it."""
    with pytest.raises(SystemExit):
        plan_of(tmp_path, *GPT, "--trainer.strategy", "fsdq")
    err = capsys.readouterr().err
    suggested = err.split("class path such as ")[1].split()[0].rstrip(".")
    assert plan_of(tmp_path, *GPT, "--trainer.strategy", suggested).strategy.kind is StrategyKind.FSDP
    with pytest.raises(SystemExit) as exited:
        plan_of(tmp_path, *GPT, "--trainer.strategy", "os.path.join")
    err = capsys.readouterr().err.strip()
    assert exited.value.code == BAD_INPUT_EXIT_CODE and len(err.splitlines()) == 1 and "os.path.join" in err
