"""strategy fsdp in one process: what becomes a shard unit, what is refused before any rank starts,
and sharded checkpoints that are published atomically and never run code when read."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from lightning.pytorch import Trainer
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from app.checkpoints.io import CheckpointError, atomic_torch_save
from app.checkpoints.sharded import (
    META_NAME,
    SafeFileSystemReader,
    is_checkpoint,
    is_sharded_checkpoint,
    load_full_tensors,
    new_shards_directory,
    publish,
    remove_unpublished,
)
from app.cli import parse_config
from app.errors import UserFacingError
from app.models.gpt import GPTLanguageModel
from app.parallel.fsdp import FSDP2Strategy
from app.parallel.strategy import resolve_strategy
from app.run.config_checks import check_fsdp_combinations
from app.run.plan import expand_strategy_names
from tests.helpers.run import ddp_app

GPT = ["fit", "--config", "configs/gpt_fsdp.yaml"]


def one_rank_strategy(tmp_path: Path, **arguments: object) -> FSDP2Strategy:
    """An FSDP2Strategy over a real one-rank gloo group in this process (tests/conftest.py ends it)."""
    strategy = FSDP2Strategy(**arguments)
    Trainer(accelerator="cpu", devices=1, strategy=strategy, logger=False, default_root_dir=tmp_path)
    strategy.setup_environment()
    return strategy


def test_by_default_every_module_list_element_is_a_unit_and_so_is_each_child_with_parameters(tmp_path: Path) -> None:
    model = GPTLanguageModel(n_layers=2)
    units = one_rank_strategy(tmp_path).shard(model)
    assert units == ["net.blocks.0", "net.blocks.1", "net"]
    assert all(isinstance(parameter, DTensor) for parameter in model.parameters())


def test_shard_modules_names_the_unit_classes_and_a_name_that_matches_nothing_is_one_line(tmp_path: Path) -> None:
    strategy = one_rank_strategy(tmp_path, shard_modules=["CausalSelfAttention"])
    assert strategy.shard(GPTLanguageModel(n_layers=1)) == ["net.blocks.0.attn", "net"]
    with pytest.raises(UserFacingError, match=r"shard_modules=\['TransformerBlock'\]: GPTLanguageModel has no"):
        FSDP2Strategy(shard_modules=["TransformerBlock"]).shard(GPTLanguageModel())


def test_param_dtype_bfloat16_computes_in_bfloat16_and_keeps_the_sharded_weights_in_float32(tmp_path: Path) -> None:
    model = GPTLanguageModel(n_layers=1)
    one_rank_strategy(tmp_path, param_dtype="bfloat16", reduce_dtype="float32").shard(model)
    assert model.net(torch.zeros(2, 8, dtype=torch.long)).dtype == torch.bfloat16
    assert {parameter.dtype for parameter in model.parameters()} == {torch.float32}


def test_cpu_offload_keeps_the_shards_in_host_memory_and_trains_the_same(tmp_path: Path) -> None:
    """`cpu_offload: true` (FSDP2's CPUOffloadPolicy): shards and gradients on the CPU; on a CPU run the
    same loss and gradients as without (on a GPU it moves them off the device: untested here, no GPU)."""
    gradients = []
    for offload in (False, True):
        torch.manual_seed(0)
        model = GPTLanguageModel(n_layers=1)
        strategy = one_rank_strategy(tmp_path / str(offload), cpu_offload=offload)
        strategy.shard(model)
        tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
        model.net(tokens).float().pow(2).mean().backward()
        assert all(parameter.to_local().device.type == "cpu" for parameter in model.parameters())
        gradients.append([parameter.grad.to_local().clone() for parameter in model.parameters()])
        torch.distributed.destroy_process_group()
    assert all(torch.equal(a, b) for a, b in zip(*gradients, strict=True))


def test_a_dtype_fsdp_does_not_compute_in_is_refused_naming_the_key() -> None:
    with pytest.raises(UserFacingError, match=r"^trainer\.strategy\.init_args\.param_dtype=bf16 is not a dtype"):
        FSDP2Strategy(param_dtype="bf16")


class ManualOptimization(GPTLanguageModel):
    def __init__(self) -> None:
        super().__init__(n_layers=1)
        self.automatic_optimization = False

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_manual_optimization_is_refused_in_one_line_as_the_strategy_sets_up(tmp_path: Path) -> None:
    trainer = Trainer(
        accelerator="cpu", devices=1, strategy=FSDP2Strategy(), max_steps=1, logger=False, default_root_dir=tmp_path
    )
    tokens = torch.zeros(4, 8, dtype=torch.long)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens, tokens), batch_size=2)
    with pytest.raises(UserFacingError, match=r"^ManualOptimization uses manual optimization .* Fix: "):
        trainer.fit(ManualOptimization(), loader)


class ShardsItself(GPTLanguageModel):
    """A module with its own configure_model: the whole network one unit, its blocks not units."""

    def configure_model(self) -> None:
        fully_shard(self.net, mesh=self.device_mesh["data_parallel"])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_module_that_shards_itself_in_configure_model_is_left_as_it_sharded_itself(tmp_path: Path) -> None:
    trainer = Trainer(
        accelerator="cpu", devices=1, strategy=FSDP2Strategy(), max_steps=2, logger=False, default_root_dir=tmp_path
    )
    tokens = torch.randint(64, (8, 8), generator=torch.Generator().manual_seed(0))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens, tokens), batch_size=2)
    model = ShardsItself(n_layers=2)
    trainer.fit(model, loader)
    assert trainer.global_step == 2
    assert isinstance(model.net, FSDPModule) and not isinstance(model.net.blocks[0], FSDPModule)


def test_strategy_fsdp_is_ddp_apps_fsdp2_strategy() -> None:
    trainer_config = {"strategy": "fsdp"}
    expand_strategy_names(trainer_config)
    assert trainer_config["strategy"].class_path == "app.parallel.fsdp.FSDP2Strategy"


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("--gradient_compression.method=powersgd", "gradient_compression.method=powersgd"),
        ("--data.init_args.on_device=true", "data.init_args.on_device=true"),
        ("--compile=true", "compile=true"),
    ],
)
def test_what_does_not_combine_with_fsdp_is_refused_naming_the_key(override: str, key: str) -> None:
    config = parse_config([*GPT, override])
    with pytest.raises(UserFacingError, match=rf"^{key} does not combine with trainer.strategy fsdp \("):
        check_fsdp_combinations(config, resolve_strategy(config["trainer"]["strategy"]))


@pytest.mark.more_cases
def test_ddp_app_refuses_gradient_compression_with_fsdp_in_one_line_before_any_rank(tmp_path: Path) -> None:
    result = ddp_app(*GPT, f"--trainer.default_root_dir={tmp_path}", "--gradient_compression.method=powersgd")
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.startswith("ddp-app: error: gradient_compression.method=powersgd does not combine with")
    assert len(result.stderr.strip().splitlines()) == 1 and "launched" not in result.stdout


def write_sharded(directory: Path, weight: float) -> None:
    """A sharded checkpoint as one rank writes it (DCP shards and index, then meta.pt)."""
    with pytest.warns(UserWarning, match="torch.distributed is disabled"):
        dcp.save({"state_dict": {"w": torch.full((4, 2), weight)}}, checkpoint_id=directory)
    atomic_torch_save({"global_step": int(weight)}, directory / META_NAME)


def test_a_save_is_published_whole_and_an_interrupted_one_is_never_a_checkpoint(tmp_path: Path) -> None:
    last = tmp_path / "last.ckpt"
    first = new_shards_directory(last)
    write_sharded(first, 1.0)
    publish(first, last)
    assert last.is_symlink() and is_checkpoint(last) and load_full_tensors(last)["w"].eq(1.0).all()
    killed = new_shards_directory(last)  # a save killed after its shards, before DCP's index
    killed.mkdir()
    (killed / "__0_0.distcp").write_bytes(b"partial")
    assert is_sharded_checkpoint(last) and not is_sharded_checkpoint(killed)
    assert load_full_tensors(last)["w"].eq(1.0).all()  # the previous checkpoint, whole
    second = new_shards_directory(last)
    write_sharded(second, 2.0)
    publish(second, last)
    assert load_full_tensors(last)["w"].eq(2.0).all()
    assert sorted(path.name for path in tmp_path.iterdir()) == sorted(["last.ckpt", second.name])
    remove_unpublished(last)  # nothing left to remove
    assert is_sharded_checkpoint(last)


class RunsCode:
    def __reduce__(self) -> tuple[object, tuple[str]]:
        return os.mkdir, (str(Path(os.environ["DDP_APP_TEST_MARKER"])),)


def test_an_index_whose_unpickling_would_run_code_is_refused_without_running_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    marker = tmp_path / "code-ran"
    monkeypatch.setenv("DDP_APP_TEST_MARKER", str(marker))
    write_sharded(tmp_path / "ckpt", 1.0)
    (tmp_path / "ckpt" / ".metadata").write_bytes(pickle.dumps(RunsCode()))
    with pytest.raises(CheckpointError, match=r"refused to load .*\.metadata: posix\.mkdir is not part of"):
        SafeFileSystemReader(tmp_path / "ckpt").read_metadata()
    assert not marker.exists()


def sharded_gradients(tmp_path: Path, **arguments: object) -> tuple[dict[str, torch.Tensor], int]:
    """One step's gradients (this rank's shards) and how often the first block's MLP ran."""
    torch.manual_seed(0)
    model = GPTLanguageModel(n_layers=2)
    one_rank_strategy(tmp_path, **arguments).shard(model)
    calls = []
    model.net.blocks[0].mlp.register_forward_pre_hook(lambda *_: calls.append(1))
    tokens = torch.randint(64, (4, 16), generator=torch.Generator().manual_seed(1))
    model._loss((tokens, tokens.roll(-1, dims=1))).backward()
    return {name: parameter.grad.to_local() for name, parameter in model.named_parameters()}, len(calls)


def test_activation_checkpointing_keeps_the_parameter_names_and_the_gradients_bit_for_bit(tmp_path: Path) -> None:
    plain, plain_calls = sharded_gradients(tmp_path)
    torch.distributed.destroy_process_group()
    checkpointed, checkpointed_calls = sharded_gradients(tmp_path, activation_checkpointing=True)
    assert (plain_calls, checkpointed_calls) == (1, 2)  # the backward ran the block's forward again
    assert plain.keys() == checkpointed.keys()
    assert [name for name in plain if not torch.equal(plain[name], checkpointed[name])] == []
