"""The run plan (app/run/plan.py): every decision made once, into a value each rank reads.

The launcher's parse-only pass returns the plan (no exception as a return value); a forked rank makes
its own plan through the same function but does not read the checkpoint again; and the rank's
LightningCLI takes the checkpoint's model arguments from that one reading.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import app.run.plan as plan_module
from app.checkpoints.io import summarize_checkpoint
from app.checkpoints.plugin import SafeCheckpointIO
from app.checkpoints.save_mode import SaveMode
from app.cli import DDPAppCLI
from app.cli.entry import check_before_launch
from app.parallel.strategy import StrategyKind
from app.run.plan import RunPlan, hand_to_forked_ranks
from tests.helpers.run import REPO

DIGITS = ["fit", "--config", str(REPO / "configs" / "digits.yaml")]


@pytest.fixture(scope="module")
def one_rank_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """configs/digits.yaml, 2 steps on one process, in this process (strategy auto on one device)."""
    root = tmp_path_factory.mktemp("one_rank")
    DDPAppCLI(args=[*DIGITS, "--trainer.devices=1", "--trainer.max_steps=2", "--trainer.enable_progress_bar=false",
                    f"--trainer.default_root_dir={root}"])  # fmt: skip
    return root / "checkpoints" / "last.ckpt"


def test_the_parse_only_pass_returns_the_plan_of_the_run(tmp_path: Path) -> None:
    plan = check_before_launch([*DIGITS, f"--trainer.default_root_dir={tmp_path}"]).plan
    assert isinstance(plan, RunPlan)
    assert plan.subcommand == "fit" and plan.strategy.kind is StrategyKind.DDP
    assert plan.launch is not None and plan.world_size == 2 and plan.ranks.processes == 2
    assert plan.run_dir == tmp_path and plan.rank_zero and plan.resume.written is None
    assert plan.checkpoints.mode is SaveMode.BACKGROUND and plan.mesh is None
    assert "(ddp)" in plan.describe() and "precision: 32-true" in plan.describe()
    with pytest.raises(AttributeError):
        plan.subcommand = "validate"  # type: ignore[misc]  (frozen: decided once)


def count_torch_loads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The files `torch.load` reads from now on, in order."""
    loads: list[str] = []
    original = torch.load

    def counting_load(source, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        loads.append(str(source))
        return original(source, *args, **kwargs)

    monkeypatch.setattr(torch, "load", counting_load)
    return loads


def test_a_forked_rank_does_not_read_the_checkpoint_the_launcher_read(
    one_rank_checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The launcher reads `--ckpt_path` once (its summary); a rank it forks inherits that reading, so
    the rank's only read is Lightning's own load of the weights. Before the plan, a rank read the file
    twice more before that load: ddp-app's summary and LightningCLI's `_parse_ckpt_path`."""
    loads = count_torch_loads(monkeypatch)
    args = [
        *DIGITS,
        "--trainer.devices=1",
        f"--trainer.default_root_dir={tmp_path}",
        f"--ckpt_path={one_rank_checkpoint}",
    ]
    launcher = check_before_launch(args).plan
    assert launcher.resume.summary is not None and len(loads) == 1
    monkeypatch.setattr(plan_module, "_HANDED_RESUME", None)
    hand_to_forked_ranks(launcher)
    rank = DDPAppCLI(args=args, parse_only=True, check_machine=True)
    assert rank.plan is not None and rank.plan.resume is launcher.resume
    assert len(loads) == 1, loads
    # The checkpoint's model arguments still win over the config's, as LightningCLI's rule says.
    assert rank.config["fit"]["model"]["init_args"]["hidden"] == launcher.resume.summary.hyper_parameters["hidden"]


def test_a_rank_without_a_launcher_reads_the_checkpoint_once(
    one_rank_checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rank started by torchrun or srun makes its own plan: the summary's read of `--ckpt_path` (or of
    the last.ckpt `--ckpt_path last` finds) is the read Lightning's load gets, once; a file rewritten
    since, or a second load, is read again."""
    loads = count_torch_loads(monkeypatch)
    monkeypatch.setattr(plan_module, "_HANDED_RESUME", None)
    args = [
        *DIGITS,
        "--trainer.devices=1",
        f"--trainer.default_root_dir={tmp_path}",
        f"--ckpt_path={one_rank_checkpoint}",
    ]
    rank = DDPAppCLI(args=args, parse_only=True, check_machine=True)
    assert rank.plan is not None and rank.plan.resume.summary is not None and len(loads) == 1
    loaded = SafeCheckpointIO().load_checkpoint(one_rank_checkpoint)
    assert "state_dict" in loaded and len(loads) == 1, loads
    SafeCheckpointIO().load_checkpoint(one_rank_checkpoint)
    assert len(loads) == 2, loads  # kept for one load only
    copy = tmp_path / "copy.ckpt"
    copy.write_bytes(one_rank_checkpoint.read_bytes())
    summarize_checkpoint(copy)
    copy.write_bytes(one_rank_checkpoint.read_bytes() + b"")  # rewritten: a new mtime
    os.utime(copy, ns=(0, 0))
    SafeCheckpointIO().load_checkpoint(copy)
    assert len(loads) == 4, loads


def test_the_strategy_a_rank_runs_is_its_own_not_the_launchers(tmp_path: Path) -> None:
    """`ddp_spawn` runs as `ddp` in the ranks (the launcher adds `--trainer.strategy=ddp`): each process
    resolves the strategy its own command line names, once."""
    launcher = check_before_launch([*DIGITS, "--trainer.strategy=ddp_spawn", f"--trainer.default_root_dir={tmp_path}"])
    assert launcher.plan.strategy.written == "ddp_spawn" and launcher.plan.ranks.extra_args == (
        "--trainer.strategy=ddp",
    )
    rank = check_before_launch([*DIGITS, "--trainer.strategy=ddp_spawn", *launcher.plan.ranks.extra_args,
                                f"--trainer.default_root_dir={tmp_path}"])  # fmt: skip
    assert rank.plan.strategy.written == "ddp" and rank.plan.strategy.kind is StrategyKind.DDP


def test_a_checkpoint_supplied_at_load_replaces_the_file_once(
    one_rank_checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A restarted replica group joins its peers when `fit` loads its own last.ckpt (app/run/build.py,
    `supply_at_load`): the supplier runs then, once; its checkpoint (a peer's state) replaces the file and
    the summary's stale read of it; a supplier that gives None (not behind) leaves the file to be read."""
    from app.checkpoints.io import supply_at_load

    loads = count_torch_loads(monkeypatch)
    monkeypatch.setattr(plan_module, "_HANDED_RESUME", None)
    summarize_checkpoint(one_rank_checkpoint)  # the plan's read, kept for the load
    peer = {"state_dict": {}, "global_step": 99}
    calls: list[str] = []
    supply_at_load(one_rank_checkpoint, lambda: calls.append("joined") or peer)
    assert SafeCheckpointIO().load_checkpoint(one_rank_checkpoint) is peer and calls == ["joined"]
    assert peer["callbacks"] == {}  # as any loaded checkpoint: ExactResume sees it
    loaded = SafeCheckpointIO().load_checkpoint(one_rank_checkpoint)  # supplied once; the summary's read forgotten
    assert loaded["global_step"] != 99 and calls == ["joined"] and len(loads) == 2, loads
    supply_at_load(one_rank_checkpoint, lambda: calls.append("not behind") and None)
    assert SafeCheckpointIO().load_checkpoint(one_rank_checkpoint)["global_step"] == loaded["global_step"]
    assert calls == ["joined", "not behind"] and len(loads) == 3, loads
