"""Hybrid sharding (`trainer.strategy.init_args.shard_group_size`, docs/fsdp.md): the ranks form
replicas of shard groups on a 2-D mesh; every rank still reads its own samples; checkpoints written
under one layout resume under another (DCP reshards), with a notice; and the weights are those of the
plain-PyTorch reference on the same mesh, bit for bit.

The default run proves it on 2 ranks (2 replicas x 1 shard, resumed as 1 replica x 2 shards, where
every reduction is a + b and so full and hybrid sharding agree bit for bit). The slow tier runs the
layout a cluster uses, 2 replicas x 2 shards on 4 ranks, against full sharding and DDP, and resumes it
on 2 ranks and back (the two-node version on the Slurm cluster: tests/slurm/test_scripts.py).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch
import yaml

from app.parity import last_weights, relative_difference, run_command, write_variant
from tests.helpers.run import REPO, clean_env, ddp_app

pytestmark = [pytest.mark.fault, pytest.mark.distributed]

TOLERANCE = 1e-5  # of the largest weight: another summation order of the gradients (docs/parity.md)
SGD = {"class_path": "torch.optim.SGD", "init_args": {"lr": 0.1, "momentum": 0.9}}


def gpt_config(path: Path, shard_group_size: int | str | None, **changes: object) -> Path:
    """configs/gpt_fsdp.yaml with this shard_group_size and `changes` to its top level or trainer."""
    config = yaml.safe_load((REPO / "configs" / "gpt_fsdp.yaml").read_text())
    config["trainer"]["strategy"]["init_args"]["shard_group_size"] = shard_group_size
    config["trainer"]["enable_progress_bar"] = False
    for key, value in changes.items():
        (config if key in config else config["trainer"])[key] = value
    return write_variant(config, path)


def fit(config: Path, root: Path, *extra: str) -> str:
    env = clean_env(DDP_APP_ALLOW_OVERSUBSCRIBE="1")  # 4 ranks on this 2-core machine
    result = ddp_app("fit", "--config", str(config), f"--trainer.default_root_dir={root}", *extra, timeout=600, env=env)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return result.stdout + result.stderr  # stdout first: its first line is the run's (the elastic notice: stderr)


def reference(config: Path, out: Path, world_size: int) -> dict[str, torch.Tensor]:
    command = [sys.executable, "-m", "app.reference.fsdp", "--config", str(config), "--out", str(out)]
    run_command([*command, "--world-size", str(world_size), "--save-every", "0"], out.with_suffix(".log"))
    return torch.load(out / "final.pt", map_location="cpu", weights_only=True)


def assert_bit_for_bit(expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor]) -> None:
    assert expected.keys() == actual.keys()
    different = [name for name, tensor in expected.items() if not torch.equal(tensor, actual[name])]
    assert not different, f"differ: {different[:3]}"


def test_hybrid_sharding_trains_the_references_weights_and_resumes_as_full_sharding(tmp_path: Path) -> None:
    """2 ranks as 2 replicas x 1 shard, stopped at step 8 of 16 and resumed with full sharding: the run's
    first line says each mesh, the resume says DCP reshards, the step line counts each layout's
    communication (2 x 1: the replicas' all-reduce alone, no reduce-scatter), and the weights equal the
    reference's hybrid run bit for bit."""
    config = gpt_config(tmp_path / "hybrid.yaml", 1, max_epochs=1)
    root = tmp_path / "run"
    stopped = fit(config, root, "--trainer.max_steps=8")
    first_line = stopped.splitlines()[0]
    assert first_line.startswith("ddp-app: launched") and "sharded as 2 replicas x 1 shard," in first_line, stopped
    resumed = fit(config, root, "--trainer.strategy.init_args.shard_group_size=null", "--ckpt_path=last")
    assert "sharded as 1 replica x 2 shards," in resumed.splitlines()[0], resumed
    notice = (
        "ddp-app: the checkpoint's shards were written by 2 replicas x 1 shard and this run is 1 replica x 2 "
        "shards: DCP reshards the weights and the optimizer state"
    )
    assert notice in resumed, resumed[-3000:]
    for output in (stopped, resumed):
        step_line = next(
            line for line in output.splitlines() if line.strip().startswith("step ") and "communication" in line
        )
        assert int(re.search(r"communication (\d+)%", step_line).group(1)) > 0, step_line
    expected = reference(config, tmp_path / "reference", 2)
    assert_bit_for_bit(expected, last_weights(root / "checkpoints" / "last.ckpt"))


@pytest.mark.slow  # four launches of 4 ranks on 2 cores: about 3 minutes
def test_two_replicas_of_two_shards_equal_the_reference_and_full_sharding_and_ddp_within_1e_5(tmp_path: Path) -> None:
    """The parity rows at 4 ranks, 1 epoch (8 AdamW steps of 4 x 16): hybrid 2 x 2 against the reference on
    the same mesh (bit for bit), full sharding 1 x 4 and DDP (within 1e-5 of the largest weight: the
    gradients are summed in another order)."""
    hybrid_config = gpt_config(tmp_path / "hybrid.yaml", 2, max_epochs=1, devices=4)
    first_line = fit(hybrid_config, tmp_path / "hybrid").splitlines()[0]
    assert "world size 4 = 1 node(s) x 4 process(es), sharded as 2 replicas x 2 shards," in first_line
    hybrid = last_weights(tmp_path / "hybrid" / "checkpoints" / "last.ckpt")
    assert_bit_for_bit(reference(hybrid_config, tmp_path / "reference", 4), hybrid)
    full_config = gpt_config(tmp_path / "full.yaml", None, max_epochs=1, devices=4)
    fit(full_config, tmp_path / "full")
    ddp = fit(full_config, tmp_path / "ddp", "--trainer.strategy=ddp")
    assert "sharded as" not in ddp.splitlines()[0]
    for other in ("full", "ddp"):
        difference, detail = relative_difference(last_weights(tmp_path / other / "checkpoints" / "last.ckpt"), hybrid)
        print(f"hybrid 2 x 2 vs {other}: {difference:.2e} of the largest weight")
        assert difference <= TOLERANCE, (other, detail)


@pytest.mark.slow  # five launches of 2 and 4 ranks on 2 cores: about 4 minutes
def test_hybrid_on_4_ranks_resumes_on_2_as_full_sharding_and_full_on_2_resumes_as_hybrid_on_4(tmp_path: Path) -> None:
    """SGD (as P9c: Adam amplifies another summation order's rounding where gradients are tiny), 2 epochs.
    2 x 2 on 4 ranks stopped mid-epoch and resumed on 2 ranks of one node (`node`: 1 x 2), and 1 x 2 on 2
    ranks stopped and resumed as 2 x 2 on 4: each keeps its global batch and sample order and ends within
    1e-5 of its uninterrupted run, saying both what the ranks and what the shards do."""
    cases = [  # (config, resumed run, stopped at, resumed with, what the resume says, what the comparison names)
        (
            gpt_config(tmp_path / "hybrid.yaml", 2, optimizer=SGD, max_epochs=2, devices=4), "shrunk", 6,
            ["--trainer.devices=2", "--trainer.strategy.init_args.shard_group_size=node"],
            ["resuming a 4-rank run on 2 ranks: global batch 64 kept",
             "written by 2 replicas x 2 shards and this run is 1 replica x 2 shards"],
            "2 x 2 on 4 ranks resumed as 1 x 2 on 2",
        ),
        (
            gpt_config(tmp_path / "full.yaml", None, optimizer=SGD, max_epochs=2, devices=2), "grown", 12,
            ["--trainer.devices=4", "--trainer.strategy.init_args.shard_group_size=2"],
            ["resuming a 2-rank run on 4 ranks: global batch 32 kept",
             "written by 1 replica x 2 shards and this run is 2 replicas x 2 shards"],
            "1 x 2 on 2 ranks resumed as 2 x 2 on 4",
        ),
    ]  # fmt: skip
    for config, resumed, max_steps, overrides, said, what in cases:
        fit(config, tmp_path / config.stem)
        fit(config, tmp_path / resumed, f"--trainer.max_steps={max_steps}")
        output = fit(config, tmp_path / resumed, *overrides, "--ckpt_path=last")
        for line in said:
            assert line in output, output[-3000:]
        assert_within_tolerance(tmp_path / config.stem, tmp_path / resumed, what)


def assert_within_tolerance(uninterrupted: Path, resumed: Path, what: str) -> None:
    expected = last_weights(uninterrupted / "checkpoints" / "last.ckpt")
    difference, detail = relative_difference(expected, last_weights(resumed / "checkpoints" / "last.ckpt"))
    print(f"{what}: {difference:.2e} of the largest weight")
    assert difference <= TOLERANCE, detail
