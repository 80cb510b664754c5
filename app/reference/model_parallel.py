"""DDP combined with model parallelism, as in the PyTorch tutorial's `demo_model_parallel`.

Each process holds a ToyMpNet whose two halves sit on two devices (GPUs 2r and 2r+1 for rank r;
both "cpu" without GPUs). DDP wraps it without `device_ids`, because the module spans devices.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from app.cluster.threads import configure_cpu_threads
from app.models.nets import ToyMpNet
from app.reference.config import accumulation_steps_of, build_job, load_config, seed_everything
from app.reference.train import cleanup, setup, spawn_rendezvous


def devices_for(rank: int) -> tuple[torch.device, torch.device]:
    if torch.cuda.device_count() >= 2 * (rank + 1):
        return torch.device("cuda", 2 * rank), torch.device("cuda", 2 * rank + 1)
    return torch.device("cpu"), torch.device("cpu")


def model_parallel_worker(rank: int, world_size: int, options: dict[str, Any]) -> None:
    configure_cpu_threads()
    setup(rank, world_size, rank, options["timeout_s"])
    try:
        job = build_job(options["config"])  # for the data, loss and optimizer of the config
        dev0, dev1 = devices_for(rank)
        seed_everything(int(options["config"].get("seed_everything", 0)))
        mp_model = ToyMpNet(dev0, dev1)
        ddp_mp_model = DDP(mp_model)  # no device_ids for a multi-device module
        optimizer = job.optimizer(ddp_mp_model.parameters())
        sampler = DistributedSampler(
            job.train_dataset, num_replicas=world_size, rank=rank, shuffle=job.shuffle, seed=job.sampler_seed
        )
        loader = DataLoader(job.train_dataset, batch_size=job.batch_size, sampler=sampler)
        for epoch in range(options["max_epochs"]):
            sampler.set_epoch(epoch)
            for inputs, labels in loader:
                optimizer.zero_grad()
                outputs = ddp_mp_model(inputs)  # outputs live on dev1
                job.criterion(outputs, labels.to(dev1)).backward()
                optimizer.step()
        if rank == 0:
            state = {name: tensor.cpu() for name, tensor in ddp_mp_model.module.state_dict().items()}
            torch.save(state, Path(options["out_dir"]) / "final.pt")
        dist.barrier()
    finally:
        cleanup()


def run_model_parallel(
    config_path: str | Path, out_dir: str | Path, world_size: int | None, max_epochs: int | None, timeout_s: float
) -> str:
    config = load_config(config_path)
    if config["model"]["class_path"].rpartition(".")[2] != "ToyRegressor":
        raise ValueError(
            "--model-parallel trains the tutorial's ToyMpModel: use a ToyRegressor config (configs/toy.yaml)."
        )
    if accumulation_steps_of(config.get("trainer") or {}) > 1:
        raise ValueError(
            "--model-parallel steps after every batch: it does not accumulate gradients. "
            "Fix: remove trainer.accumulate_grad_batches from the config for a --model-parallel run."
        )
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    options = {
        "config": config,
        "out_dir": str(out_dir),
        "max_epochs": max_epochs if max_epochs is not None else int(config["trainer"].get("max_epochs", 1)),
        "timeout_s": timeout_s,
    }
    with spawn_rendezvous():
        mp.spawn(model_parallel_worker, args=(world_size or 2, options), nprocs=world_size or 2, join=True)
    return "mp.spawn"
