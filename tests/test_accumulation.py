"""Gradient accumulation with DDP: static_graph (set by our shipped configs) is dropped for such a run,
the ranks stay in sync, and the command from the issue trains."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import yaml

from app.cli import DDPAppCLI
from app.reference.config import ddp_arguments, load_config
from app.reference.model_parallel import run_model_parallel
from tests.helpers.run import REPO, clean_env, ddp_app

# DDP configs: static_graph and no_sync are DDP's (a strategy fsdp config has neither: tests/fsdp/).
CONFIGS = sorted(path for path in (REPO / "configs").glob("*.yaml") if "fsdp" not in path.name)
NOTICE = "so this run uses static_graph=false"


@pytest.mark.parametrize("config", CONFIGS, ids=lambda path: path.name)
def test_accumulation_runs_ddp_without_static_graph_on_both_sides(
    config: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], shipped_config_overrides: dict[str, list[str]]
) -> None:
    trainer_config = load_config(config)["trainer"]
    configured = ddp_arguments(trainer_config).get("static_graph", False)
    cli = DDPAppCLI(
        args=[
            "--config",
            str(config),
            "--trainer.accumulate_grad_batches=2",
            f"--trainer.default_root_dir={tmp_path}",
            *shipped_config_overrides.get(config.name, []),
        ],  # fmt: skip
        run=False,
    )
    # What DistributedDataParallel will be given (a private attribute: this fails loudly if it moves).
    assert not cli.trainer.strategy._ddp_kwargs.get("static_graph", False)
    assert not ddp_arguments({**trainer_config, "accumulate_grad_batches": 2}).get("static_graph", False)
    # The notice appears exactly when the config asked for static_graph, once (this is global rank 0).
    assert capsys.readouterr().out.count(NOTICE) == (1 if configured else 0)


def test_without_accumulation_static_graph_stays_as_configured() -> None:
    assert ddp_arguments(load_config(REPO / "configs" / "digits.yaml")["trainer"])["static_graph"] is True


@pytest.mark.distributed
def test_the_issue_command_trains(tmp_path: Path) -> None:
    """The exact command from issue 10, run from another directory so its runs/ lands in tmp_path."""
    result = ddp_app(
        "fit", "--config", str(REPO / "configs" / "digits.yaml"), "--trainer.accumulate_grad_batches=2",
        "--trainer.max_epochs=2", cwd=tmp_path, timeout=240,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert (result.stdout + result.stderr).count(NOTICE) == 1  # rank 0 only
    assert (tmp_path / "runs" / "digits" / "checkpoints" / "last.ckpt").is_file()


@pytest.mark.distributed
def test_ranks_hold_equal_weights_after_accumulated_steps(tmp_path: Path) -> None:
    """k=3 over 20 batches per epoch: six full groups and a short one (which steps), two epochs."""
    # The ranks import the test callback from this checkout.
    env = clean_env(PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    result = ddp_app(
        "fit", "--config", "configs/digits.yaml", "--trainer.accumulate_grad_batches=3", "--trainer.max_epochs=2",
        "--trainer.enable_progress_bar=false", "--trainer.logger=false", f"--trainer.default_root_dir={tmp_path}",
        "--trainer.callbacks+=tests.helpers.rank_weights.SaveRankWeights",
        f"--trainer.callbacks.dirpath={tmp_path / 'weights'}", env=env, timeout=240,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    rank0 = torch.load(tmp_path / "weights" / "rank0.pt", weights_only=True)
    rank1 = torch.load(tmp_path / "weights" / "rank1.pt", weights_only=True)
    assert rank0.keys() == rank1.keys()
    different = [name for name in rank0 if not torch.equal(rank0[name], rank1[name])]
    assert not different, f"the ranks' weights differ after accumulated steps, first: {different[0]}"


def test_model_parallel_reference_refuses_accumulation(tmp_path: Path) -> None:
    config = load_config(REPO / "configs" / "toy.yaml")
    config["trainer"]["accumulate_grad_batches"] = 2
    path = tmp_path / "toy_accumulate.yaml"
    path.write_text(yaml.safe_dump(config))
    with pytest.raises(ValueError, match="accumulate_grad_batches"):
        run_model_parallel(path, tmp_path / "out", world_size=2, max_epochs=1, timeout_s=30)
