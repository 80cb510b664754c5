"""What `ddp-app` puts on every Trainer to keep Lightning's per-step cost down, without losing features."""

from __future__ import annotations

import datetime
import json
import warnings
from pathlib import Path

import pytest
import torch
from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch.profilers import SimpleProfiler
from lightning.pytorch.strategies import DDPStrategy

from app.checkpoints.plugin import BackgroundCheckpointIO
from app.cli import DDPAppCLI, NoProfiler, SafeCheckpointIO
from app.run.callbacks import PredictionWriter
from tests.helpers.run import REPO

DIGITS = str(REPO / "configs" / "digits.yaml")


def build(tmp_path: Path, *overrides: str) -> DDPAppCLI:
    return DDPAppCLI(
        args=["--config", DIGITS, f"--trainer.default_root_dir={tmp_path}", "--trainer.devices=1", *overrides],
        run=False,
    )


def test_the_default_profiler_is_the_cheap_no_op_and_a_configured_one_is_kept(tmp_path: Path) -> None:
    assert type(build(tmp_path).trainer.profiler) is NoProfiler
    assert type(build(tmp_path, "--trainer.profiler=simple").trainer.profiler) is SimpleProfiler


def safe_io(trainer) -> CheckpointIO:
    """The safe (atomic) checkpoint I/O under the background writer that fits use by default."""
    io = trainer.strategy.checkpoint_io
    assert type(io) is BackgroundCheckpointIO, type(io)
    return io.checkpoint_io


def test_checkpoints_are_safe_by_default_and_with_a_configs_own_plugins(tmp_path: Path) -> None:
    assert type(safe_io(build(tmp_path).trainer)) is SafeCheckpointIO
    off = "--last_checkpoint.async_save=false"
    assert type(build(tmp_path, off).trainer.strategy.checkpoint_io) is SafeCheckpointIO
    own = "--trainer.plugins=lightning.fabric.plugins.environments.LightningEnvironment"
    trainer = build(tmp_path, own).trainer
    assert type(safe_io(trainer)) is SafeCheckpointIO
    assert type(trainer.strategy.cluster_environment).__name__ == "LightningEnvironment"
    custom = "--trainer.plugins=lightning.fabric.plugins.io.torch_io.TorchCheckpointIO"
    assert type(build(tmp_path, custom).trainer.strategy.checkpoint_io).__name__ == "TorchCheckpointIO"


@pytest.mark.parametrize("strategy", [None, "ddp", "auto", "ddp_find_unused_parameters_true"])
def test_collective_timeout_reaches_the_strategy_through_its_timeout_argument(tmp_path: Path, strategy: str) -> None:
    overrides = ["--trainer.devices=2", "--collective_timeout_s=123"]
    if strategy is not None:  # None: the config's DDPStrategy class_path
        overrides.append(f"--trainer.strategy={strategy}")
    trainer = build(tmp_path, *overrides).trainer
    assert isinstance(trainer.strategy, DDPStrategy)
    assert trainer.strategy._timeout == datetime.timedelta(seconds=123)  # no public getter
    if strategy == "ddp_find_unused_parameters_true":  # the name's own arguments are kept
        assert trainer.strategy._ddp_kwargs["find_unused_parameters"] is True


def test_fit_carries_no_prediction_writer(tmp_path: Path) -> None:
    # Lightning calls every hook of every callback at every step; the writer only matters for predict
    # (tests/test_subcommands.py checks that predict still writes predictions.pt).
    callbacks = build(tmp_path).trainer.callbacks
    assert not any(isinstance(callback, PredictionWriter) for callback in callbacks)


def test_train_accuracy_is_the_accuracy_over_every_training_sample(tmp_path: Path) -> None:
    # lr 1e-30: Adam's steps are below float32 resolution, so the weights stay fixed during the
    # epoch and the logged accuracy can be recomputed from the trained model.
    cli = build(
        tmp_path, "--trainer.max_epochs=1", "--trainer.enable_progress_bar=false", "--trainer.logger=false",
        "--optimizer.init_args.lr=1e-30",
    )  # fmt: skip
    before = [parameter.detach().clone() for parameter in cli.model.parameters()]
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert all(torch.equal(a, b) for a, b in zip(before, cli.model.parameters(), strict=True))
    inputs, targets = map(torch.stack, zip(*cli.datamodule.train_dataset, strict=True))
    with torch.no_grad():
        expected = (cli.model(inputs).argmax(dim=1) == targets).double().mean()
    assert int(cli.model._train_seen) == len(targets)
    assert torch.isclose(cli.trainer.callback_metrics["train_acc"].double(), expected)


def test_ddp_broadcasts_buffers_only_where_there_is_another_rank_to_reach() -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from app.cluster.ddp_buffers import without_single_rank_broadcast

    given = {"bucket_cap_mb": 1, "broadcast_buffers": True}
    assert without_single_rank_broadcast(given, 2) == given
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # and no deprecation warning for the switch it uses
            one_rank = DistributedDataParallel(net, **without_single_rank_broadcast(given, 1))
        assert not one_rank.will_sync_module_buffers()
        assert DistributedDataParallel(net).will_sync_module_buffers()  # DDP's default, kept on more ranks
        # And it changes no value: three training steps of a BatchNorm net, with and without it.
        trained = [train_three_steps(broadcast) for broadcast in (True, False)]
        assert trained[0].keys() == trained[1].keys()
        assert all(torch.equal(trained[0][name], trained[1][name]) for name in trained[0])
    finally:
        dist.destroy_process_group()


def train_three_steps(broadcast: bool) -> dict[str, torch.Tensor]:
    from torch.nn.parallel import DistributedDataParallel

    from app.cluster.ddp_buffers import without_single_rank_broadcast

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    kwargs = {} if broadcast else without_single_rank_broadcast({}, 1)
    model = DistributedDataParallel(net, **kwargs)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        inputs = torch.randn(16, 4, generator=torch.Generator().manual_seed(step))
        model(inputs).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return {name: value.detach().clone() for name, value in net.state_dict().items()}


@pytest.mark.distributed
def test_ranks_check_cuda_through_the_runtime_not_nvml_at_every_optimizer_step(tmp_path: Path) -> None:
    """Lightning's import sets PYTORCH_NVML_BASED_CUDA_CHECK=1 (for processes that fork afterwards);
    a rank unsets it, or each `Optimizer.step` on a CPU with torch's CUDA build reloads NVML (52 us)."""
    from app.cli.entry import NVML_BASED_CUDA_CHECK
    from tests.helpers.run import ddp_app

    record = tmp_path / "environment"
    result = ddp_app(
        "fit", "--config", DIGITS, "--trainer.devices=2", "--trainer.max_epochs=1", "--trainer.limit_train_batches=2",
        "--trainer.limit_val_batches=1", f"--trainer.default_root_dir={tmp_path}",
        "--trainer.callbacks+=tests.helpers.rank_environment.RecordEnvironment",
        f"--trainer.callbacks.dirpath={record}", f"--trainer.callbacks.names=[{NVML_BASED_CUDA_CHECK}]",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    seen = [json.loads((record / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert seen == [{NVML_BASED_CUDA_CHECK: None}] * 2
