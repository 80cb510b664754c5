"""`python -m app.bench.bare --config X`: the framework-free limit for `python -m app.bench`.

The config's network, loss, optimizer, precision, channels_last and per-rank batch, trained in a
plain loop on one device with the whole training split already there: no DataLoader, no DDP
wrapper, no process group, no framework, no host read per step. Each epoch visits a seeded
permutation of the split in batches cut on the device, as many steps as one rank of the config
runs. `compile: true` in the config compiles the network here too. What the two real sides reach
as a fraction of this loop's throughput is what their data path and framework leave of the GPU.

A split with random augmentation is read once (its augmentation frozen at one draw): this is a
speed limit, not a training run.
"""

from __future__ import annotations

import argparse
import contextlib
from pathlib import Path

import torch
from torch.utils.data import default_collate

from app.bench.recorder import StepRecorder
from app.cluster.threads import configure_cpu_threads
from app.data.on_device import materialize
from app.errors import InvalidConfigError
from app.reference.config import build_job, load_config


def device_of(config: dict) -> torch.device:
    accelerator = str((config.get("trainer") or {}).get("accelerator", "auto"))
    use_cuda = accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available())
    return torch.device("cuda", 0) if use_cuda else torch.device("cpu")


def split_tensors(dataset: torch.utils.data.Dataset) -> tuple[torch.Tensor, ...]:
    try:
        return materialize(dataset, "train")
    except InvalidConfigError:  # random augmentation: frozen at one draw, fine for a speed limit
        return tuple(default_collate([dataset[index] for index in range(len(dataset))]))


def train(config: dict, epochs: int, recorder: StepRecorder | None) -> None:
    configure_cpu_threads()
    device = device_of(config)
    job = build_job(config)  # seeds, then the network and datasets as the other sides build them
    inputs, targets = (tensor.to(device) for tensor in split_tensors(job.train_dataset)[:2])
    if job.channels_last:
        inputs = inputs.contiguous(memory_format=torch.channels_last)
    net = job.net.to(device)
    if config.get("compile"):
        net.compile()
    optimizer = job.optimizer(net.parameters())
    scheduler = job.scheduler(optimizer)
    autocast = (
        torch.autocast(device.type, dtype=torch.bfloat16) if job.precision == "bf16-mixed" else contextlib.nullcontext()
    )
    generator = torch.Generator().manual_seed(job.sampler_seed)
    world_size = int((config.get("trainer") or {}).get("devices", 1) or 1)
    steps_per_epoch = -(-len(inputs) // (world_size * job.batch_size))  # as one rank of the config
    net.train()
    for epoch in range(epochs):
        order = torch.randperm(len(inputs), generator=generator).to(device)
        for step in range(steps_per_epoch):
            if recorder is not None:
                recorder.step_start(epoch)
            rows = order[step * job.batch_size : (step + 1) * job.batch_size]
            with autocast:
                loss = job.criterion(net(inputs.index_select(0, rows)), targets.index_select(0, rows))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if recorder is not None:
                recorder.step_end()
        if scheduler is not None:
            scheduler.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # an epoch's steps end when the GPU has run them
    if recorder is not None:
        recorder.finish(device)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m app.bench.bare", description=__doc__)
    parser.add_argument("--config", required=True, type=Path)
    parser.add_argument("--epochs", type=int, default=None, help="default: the config's trainer.max_epochs")
    args = parser.parse_args(argv)
    config = load_config(args.config)
    epochs = args.epochs or int((config.get("trainer") or {}).get("max_epochs") or 1)
    train(config, epochs, StepRecorder.from_env("bare", 0, 1))


if __name__ == "__main__":
    main()
