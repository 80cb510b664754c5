"""A 2-rank job (mp.spawn, gloo) that trains a bare MLP through `CommunicationHook` and checks that
its state moves exactly between DDP bucketings: the result is written for the test to read."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from app.parallel.compression import CommunicationHook

STEPS = 16
SPLIT = 7


def make_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 128), nn.ReLU(), nn.Linear(128, 10))


def train(model: nn.Module, rank: int, first: int, last: int) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # no momentum: no optimizer state to carry
    generator = torch.Generator().manual_seed(1000 + rank)
    for step in range(last):
        inputs, targets = torch.randn(32, 64, generator=generator), torch.randint(0, 10, (32,), generator=generator)
        if step >= first:
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(inputs), targets).backward()
            optimizer.step()


def wrapped(net: nn.Module, bucket_cap_mb: float, state: dict | None = None) -> tuple[nn.Module, CommunicationHook]:
    model = DistributedDataParallel(net, bucket_cap_mb=bucket_cap_mb)
    hook = CommunicationHook("powersgd", powersgd_rank=2, start_iter=3)
    if state is not None:
        hook.load_state_dict(state)
    hook.attach(model)
    return model, hook


def worker(rank: int, cap_before: float, cap_after: float, out: str) -> None:
    torch.set_num_threads(1)
    # A file store: no port to race for with other jobs on the machine.
    dist.init_process_group("gloo", init_method=f"file://{out}/store", rank=rank, world_size=2)
    try:
        net = make_net()
        model, _ = wrapped(net, cap_before)
        train(model, rank, 0, STEPS)
        uninterrupted = [parameter.detach().clone() for parameter in net.parameters()]

        net = make_net()
        model, hook = wrapped(net, cap_before)
        train(model, rank, 0, SPLIT)
        state, weights = hook.state_dict(), net.state_dict()
        net = make_net()
        net.load_state_dict(weights)
        model, resumed_hook = wrapped(net, cap_after, state)  # a restart: DDP's initial buckets again
        train(model, rank, SPLIT, STEPS)
        equal = all(torch.equal(a, b) for a, b in zip(uninterrupted, net.parameters(), strict=True))
        result = {"equal": equal, "iter": resumed_hook.powersgd.iter, "saved_errors": len(state["powersgd"]["error"])}
        torch.save(result, Path(out) / f"rank{rank}.pt")
        # While this thread still holds the group, let gloo's threads drop PowerSGD's callbacks (see
        # app/reference/train.py, train_worker): dropped last on a gloo thread, it aborts the process.
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    cap_before, cap_after, out = float(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
    mp.spawn(worker, args=(cap_before, cap_after, out), nprocs=2)
