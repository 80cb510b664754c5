"""Every YAML in configs/ parses and instantiates; each whose data is local trains one batch."""

from __future__ import annotations

from pathlib import Path

import pytest
from lightning.pytorch.cli import LightningCLI

from app.cli import DDPAppCLI
from tests.helpers.run import REPO

CONFIGS = sorted((REPO / "configs").glob("*.yaml"))
LOCAL_DATA = {"digits.yaml", "toy.yaml", "bench_cnn.yaml", "bench_resnet18.yaml"}


def build(config: Path, *overrides: str) -> LightningCLI:
    return DDPAppCLI(args=["--config", str(config), *overrides], run=False)


def test_configs_exist() -> None:
    names = {config.name for config in CONFIGS}
    assert {"digits.yaml", "toy.yaml", "mnist.yaml", "cifar10_resnet18.yaml", "bench_cnn.yaml"} <= names


@pytest.mark.parametrize("config", CONFIGS, ids=lambda path: path.name)
def test_config_instantiates(config: Path, tmp_path: Path, shipped_config_overrides: dict[str, list[str]]) -> None:
    cli = build(config, f"--trainer.default_root_dir={tmp_path}", *shipped_config_overrides.get(config.name, []))
    expected = (
        "FSDP2Strategy" if "fsdp" in config.name else "DDPStrategy"
    )  # app/parallel/fsdp.py for the sharded configs
    assert cli.trainer.strategy.__class__.__name__ == expected
    assert cli.model.net is not None
    assert cli.datamodule.batch_size >= 1


@pytest.mark.parametrize("config", [c for c in CONFIGS if c.name in LOCAL_DATA], ids=lambda path: path.name)
def test_config_trains_one_batch(config: Path, tmp_path: Path) -> None:
    cli = build(
        config,
        f"--trainer.default_root_dir={tmp_path}",
        "--trainer.fast_dev_run=1",
        "--trainer.devices=1",
        "--trainer.accelerator=cpu",
        "--trainer.enable_progress_bar=false",
    )
    before = {name: p.detach().clone() for name, p in cli.model.named_parameters()}
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert cli.trainer.global_step == 1
    changed = [name for name, p in cli.model.named_parameters() if not p.detach().equal(before[name])]
    assert changed, "one optimizer step changed no parameter"
