"""The `gpu` tier: the guarantees on a CUDA device. Left out of the default run and of CI (no GPU
there); on a machine with one: `python -m pytest -m gpu -p no:cacheprovider -s` (`-s` shows the
benchmark's table).

- fit, validate and predict through `ddp-app` on CUDA, and the reference trainer on CUDA with its
  `map_location` load;
- no host synchronisation in a steady-state training step (`torch.cuda.set_sync_debug_mode`), the
  GPU counterpart of tests/test_host_reads.py;
- Lightning against the reference on CUDA: fp32 bit for bit with deterministic algorithms,
  bf16-mixed within the stated tolerance; `data.on_device` bit for bit with the DataLoader;
- a short benchmark whose figures it prints (with the framework-free row).
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from app.cli import DDPAppCLI
from tests.helpers.host_reads import PerTrainingBatch
from tests.helpers.run import REPO, clean_env, ddp_app, run

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DIGITS = str(REPO / "configs" / "digits.yaml")
ON_GPU = ["--trainer.accelerator=gpu", "--trainer.devices=1"]
# bf16-mixed: Lightning's autocast region (the training step) and the reference's (the forward and
# the loss) differ, and bf16 rounds at 8 bits of mantissa: after an epoch of the digits job the
# weights agree to this, absolute.
BF16_TOLERANCE = 2e-2


def lightning_weights(root: Path) -> dict[str, torch.Tensor]:
    checkpoint = torch.load(root / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    state = checkpoint["state_dict"]
    return {name.removeprefix("net."): value for name, value in state.items() if name.startswith("net.")}


def reference_weights(out: Path) -> dict[str, torch.Tensor]:
    return torch.load(out / "final.pt", map_location="cpu", weights_only=True)


def test_fit_validate_predict_on_cuda(tmp_path: Path) -> None:
    common = ["--config", DIGITS, *ON_GPU, f"--trainer.default_root_dir={tmp_path}"]
    fitted = ddp_app("fit", *common, "--trainer.max_epochs=2", timeout=300)
    assert fitted.returncode == 0, fitted.stderr[-3000:]
    last = tmp_path / "checkpoints" / "last.ckpt"
    for subcommand in ("validate", "predict"):
        result = ddp_app(subcommand, *common, f"--ckpt_path={last}", timeout=300)
        assert result.returncode == 0, (subcommand, result.stderr[-3000:])
    predictions = torch.load(tmp_path / "predictions.pt", weights_only=True)
    assert len(predictions["indices"]) == len(predictions["predictions"]) > 0


def test_the_reference_trains_on_cuda_and_resumes_its_snapshot_with_map_location(tmp_path: Path) -> None:
    args = [sys.executable, "-m", "app.reference", "--config", DIGITS, "--world-size", "1", "--out", str(tmp_path)]
    first = run([*args, "--epochs", "1"], timeout=300, env=clean_env())
    assert first.returncode == 0, first.stderr[-3000:]
    resumed = run([*args, "--epochs", "2"], timeout=300, env=clean_env())  # loads snapshot.pt onto cuda:0
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "Resuming" in resumed.stdout + resumed.stderr
    assert all(torch.isfinite(value).all() for value in reference_weights(tmp_path).values())


class SyncRecorder(PerTrainingBatch):
    """Host synchronisations CUDA reports (`set_sync_debug_mode("warn")`), per training batch."""

    # What `set_sync_debug_mode("warn")` says (c10/cuda/CUDAFunctions.cpp). Only this: autograd's
    # "AccumulateGrad node's stream does not match" warning (first step on the H100, 2026-11-26,
    # before app/cluster/ddp_stream.py) also says "synchronization" but reports no host wait.
    SYNC_WARNING = "called a synchronizing CUDA operation"
    STREAM_MISMATCH = "AccumulateGrad node's stream does not match"

    def __init__(self) -> None:
        super().__init__()
        self.stream_mismatches: list[str] = []

    def record(self, message: Any, *args: Any, **kwargs: Any) -> None:  # as warnings.showwarning
        if self.STREAM_MISMATCH in str(message):
            self.stream_mismatches.append(str(message)[:300])
        if self.batch is not None and self.SYNC_WARNING in str(message):
            self.found[self.batch].append(str(message)[:300])


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_a_steady_state_training_step_does_not_synchronise_with_the_host(tmp_path: Path, precision: str) -> None:
    log_every = 10
    cli = DDPAppCLI(
        args=[
            "--config", DIGITS, *ON_GPU, f"--trainer.default_root_dir={tmp_path}", "--trainer.max_epochs=2",
            f"--trainer.precision={precision}", f"--trainer.log_every_n_steps={log_every}",
            "--last_checkpoint.check_interval_s=3600",
        ],
        run=False,
    )  # fmt: skip
    recorder = SyncRecorder()
    cli.trainer.callbacks.insert(0, recorder)
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():  # restores showwarning on exit
            warnings.simplefilter("always")
            warnings.showwarning = recorder.record
            cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    batches = cli.trainer.num_training_batches
    steady = recorder.steady_state(batches, log_every)
    assert len(recorder.global_steps) == 2 * batches
    assert not steady, f"{len(steady)} steady-state steps synchronised, e.g. {next(iter(steady.items()))}"
    # DDP built on the training stream (app/cluster/ddp_stream.py): no gradient crosses streams.
    assert not recorder.stream_mismatches, recorder.stream_mismatches[0]


def test_a_tensor_split_in_host_memory_comes_in_pinned_batches_equal_to_the_dataloaders() -> None:
    from torch.utils.data import DataLoader, SequentialSampler, TensorDataset

    from app.data.on_device import TensorBatchLoader

    dataset = TensorDataset(torch.randn(10, 3, 4, 4), torch.arange(10))
    loader = TensorBatchLoader(dataset.tensors, SequentialSampler(dataset), batch_size=4, pin_memory=True)
    reference = DataLoader(dataset, batch_size=4, pin_memory=True)
    for ours, theirs in zip(loader, reference, strict=True):
        assert all(tensor.is_pinned() for tensor in ours)  # so Lightning's non_blocking copy is asynchronous
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))


def test_a_background_save_copies_device_tensors_into_pinned_buffers_it_reuses() -> None:
    from app.checkpoints.staging import HostStaging

    weights = torch.randn(256, 256, device="cuda")
    staging = HostStaging()
    staging.begin()
    first = staging.copy(weights)
    staging.finish()
    weights.mul_(2.0)
    staging.begin()
    second = staging.copy(weights)
    staging.finish()  # the non-blocking copy is complete here
    assert second.device.type == "cpu" and second.is_pinned() and second.data_ptr() == first.data_ptr()
    assert torch.equal(second, weights.cpu())


def test_a_background_save_stages_a_cuda_dtensor_shard_on_the_host_and_dcp_writes_it(tmp_path: Path) -> None:
    """strategy fsdp's background save on a GPU: HostStaging copies a DTensor's CUDA shard into a pinned
    host buffer and rebuilds the DTensor around it (the mesh stays CUDA's), and DCP writes that, as
    it wrote DCP's own stager's copies; the shard read back equals the device's at the save."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from app.checkpoints.sharded import load_full_tensors
    from app.checkpoints.staging import HostStaging

    dist.init_process_group("cuda:nccl,cpu:gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cuda", (1,))
        weight = distribute_tensor(torch.randn(64, 32, device="cuda"), mesh, [Shard(0)])
        staging = HostStaging()
        staging.begin()
        staged = staging.copy(weight)
        staging.finish()
        local = staged.to_local()
        assert local.device.type == "cpu" and local.is_pinned() and staged.device_mesh.device_type == "cuda"
        expected = weight.to_local().cpu()
        weight.to_local().mul_(2.0)  # the next steps change the device's shard, not the copy
        dcp.save({"state_dict": {"w": staged}}, checkpoint_id=tmp_path / "shards")
    finally:
        dist.destroy_process_group()
    assert torch.equal(load_full_tensors(tmp_path / "shards")["w"], expected)


def fit_lightning(root: Path, *overrides: str) -> dict[str, torch.Tensor]:
    result = ddp_app(
        "fit", "--config", DIGITS, *ON_GPU, f"--trainer.default_root_dir={root}", "--trainer.max_epochs=1",
        "--optimizer=torch.optim.SGD", "--optimizer.init_args.lr=0.05", "--lr_scheduler=null", *overrides,
        timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return lightning_weights(root)


def fit_reference(tmp_path: Path, precision: str) -> dict[str, torch.Tensor]:
    config = yaml.safe_load(Path(DIGITS).read_text())
    config["trainer"].update(accelerator="gpu", devices=1, precision=precision)
    config["optimizer"] = {"class_path": "torch.optim.SGD", "init_args": {"lr": 0.05}}
    config.pop("lr_scheduler", None)
    path = tmp_path / f"reference-{precision}.yaml"
    path.write_text(yaml.safe_dump(config))
    out = tmp_path / f"reference-{precision}"
    result = run(
        [sys.executable, "-m", "app.reference", "--config", str(path), "--world-size", "1", "--epochs", "1",
         "--out", str(out)],
        timeout=300, env=clean_env(),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return reference_weights(out)


def test_lightning_equals_the_reference_on_cuda_fp32_bit_for_bit(tmp_path: Path) -> None:
    lightning = fit_lightning(tmp_path / "lightning")
    reference = fit_reference(tmp_path, "32-true")
    assert lightning.keys() == reference.keys()
    for name in reference:
        assert torch.equal(lightning[name], reference[name]), (name, (lightning[name] - reference[name]).abs().max())


def test_lightning_and_the_reference_agree_under_bf16_mixed_within_the_tolerance(tmp_path: Path) -> None:
    lightning = fit_lightning(tmp_path / "lightning", "--trainer.precision=bf16-mixed")
    reference = fit_reference(tmp_path, "bf16-mixed")
    worst = max((lightning[name] - reference[name]).abs().max().item() for name in reference)
    print(f"bf16-mixed, Lightning vs reference after one epoch: max |diff| {worst:.3g}")
    assert worst <= BF16_TOLERANCE, worst


def test_a_split_on_the_gpu_trains_the_same_weights_as_the_dataloader(tmp_path: Path) -> None:
    loaded = fit_lightning(tmp_path / "loader")
    resident = fit_lightning(tmp_path / "device", "--data.init_args.on_device=true")
    for name in loaded:
        assert torch.equal(loaded[name], resident[name]), name


def test_a_short_gpu_benchmark_prints_its_figures(tmp_path: Path) -> None:
    report_path = tmp_path / "bench.json"
    result = run(
        [sys.executable, "-m", "app.bench", "--config", "configs/bench_resnet18.yaml", "--accelerator", "gpu",
         "--world-sizes", "1", "--repeats", "1", "--epochs", "2", "--no-warmup", "--out", str(tmp_path / "runs"),
         "--json", str(report_path)],
        timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    print(result.stdout)
    figures = json.loads(report_path.read_text())["by_world_size"]["1"]
    assert figures["bare"]["samples_per_s"]["median"] > 0
    assert figures["lightning"]["cuda_max_allocated_mb_max_rank"]["median"] > 0
