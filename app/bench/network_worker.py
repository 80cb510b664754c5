"""One rank of `python -m app.bench.network`, started inside its network namespace by the bench.

Both ranks start once and keep one gloo process group; they walk the same schedule (link speed,
compression setting, DDP bucket size, repeat), and for each item: cap their own side of the link
with tc, meet at a barrier, wrap a fresh copy of the config's network in a new
DistributedDataParallel with that bucket size, attach the compression hook, run its probe (auto)
and warm-up steps, then time `steps` training steps and count the bytes their interface sent.
A fresh DDP per item costs a parameter broadcast; a fresh launch per item would cost 10-15 s of
imports and rendezvous, which is why this is not one `ddp-app` run per setting. The 1-rank
baseline runs on rank 0 alone, in a process group of its own, while rank 1 waits at a barrier.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import itertools
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DistributedSampler

from app.bench.netns import Link, init_gloo, set_rate, tx_bytes
from app.cluster.threads import configure_cpu_threads
from app.parallel.compression import AUTO_CANDIDATES, AUTO_WARMUP_STEPS, CommunicationHook
from app.reference.config import Job, build_job
from app.reference.diloco import DEFAULTS as DILOCO_DEFAULTS
from app.reference.diloco import DiLoCo

WORLD_SIZE = 2


def shard_batches(job: Job, rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's training batches as the reference sampler deals them, stacked once to keep data loading out of the
    step."""
    sampler = DistributedSampler(
        job.train_dataset, num_replicas=WORLD_SIZE, rank=rank, shuffle=job.shuffle, seed=job.sampler_seed
    )
    indices = list(sampler)
    batches = []
    for start in range(0, len(indices) - job.batch_size + 1, job.batch_size):
        samples = [job.train_dataset[index] for index in indices[start : start + job.batch_size]]
        inputs = torch.stack([sample[0] for sample in samples])
        if job.channels_last:
            inputs = inputs.contiguous(memory_format=torch.channels_last)
        batches.append((inputs, torch.as_tensor([int(sample[1]) for sample in samples])))
    if not batches:
        raise ValueError(f"the training set has fewer than {job.batch_size} samples per rank: no full batch to time.")
    return batches


def probing(hook: CommunicationHook) -> bool:
    """auto has not decided yet: it is still trying its candidates, a few steps each."""
    return hook.method == "auto" and not hook.decision


def measure(
    job: Job,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    item: dict[str, Any],
    plan: dict[str, Any],
    rank: int,
    group: dist.ProcessGroup | None,
) -> dict[str, Any]:
    """Time one schedule item on this rank (None: in the default group): step time, bytes sent per
    step, auto's choice."""
    diloco = None
    timed_steps = plan["steps"]
    if item["method"] in ("diloco", "diloco_overlap"):  # no DDP: the replicas step alone, the outer loop syncs them
        model: torch.nn.Module = copy.deepcopy(job.net)
        settings = {**DILOCO_DEFAULTS, **plan["diloco"]}
        if item["method"] == "diloco":
            settings["overlap_steps"] = 0
        diloco = DiLoCo(model, WORLD_SIZE, settings)
        hook = CommunicationHook(method="none")
        every = int(settings["sync_every"])
        timed_steps = -(-timed_steps // every) * every  # whole periods: each holds exactly one outer step
    else:
        ddp_kwargs = {**job.ddp_kwargs, "bucket_cap_mb": item["bucket_cap_mb"]}
        model = DistributedDataParallel(copy.deepcopy(job.net), process_group=group, **ddp_kwargs)
        hook = CommunicationHook(method=item["method"], **plan["compression"])
        hook.attach(model)
    optimizer = job.optimizer(model.parameters())
    bf16 = job.precision == "bf16-mixed"
    batch_stream = itertools.cycle(batches)

    def step() -> None:
        inputs, targets = next(batch_stream)
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = job.criterion(model(inputs), targets)
        loss.backward()  # DDP exchanges the gradients here, through the hook
        optimizer.step()
        if diloco is not None:
            diloco.after_inner_step()

    probe_steps = 0
    # auto decides after (untimed + timed) steps per candidate; twice that means it never will.
    probe_bound = 2 * (len(AUTO_CANDIDATES) * (AUTO_WARMUP_STEPS + hook.probe_steps) + 1)
    while probing(hook):
        if probe_steps == probe_bound:
            raise RuntimeError(f"auto had not chosen a method after {probe_steps} steps (hook: {hook.method}).")
        step()
        probe_steps += 1
    for _ in range(plan["warmup_steps"]):
        step()
    interface = plan["interfaces"][rank]
    dist.barrier(group)
    sent_before, started = tx_bytes(interface), time.perf_counter()
    step_seconds = []
    for _ in range(timed_steps):
        step_started = time.perf_counter()
        step()
        step_seconds.append(time.perf_counter() - step_started)
    elapsed = time.perf_counter() - started
    sent = tx_bytes(interface) - sent_before
    if diloco is not None:  # an exchange still in flight (the next period's) completes untimed
        diloco.finish()
    dist.barrier(group)
    return {
        "step_ms": elapsed / timed_steps * 1e3,
        "step_median_ms": statistics.median(step_seconds) * 1e3,
        "bytes_per_step": sent / timed_steps,
        "chosen": hook.chosen,
        "decision": hook.decision,
        "probe_steps": probe_steps,
    }


def progress_line(record: dict[str, Any], total: int, repeats: int) -> str:
    link = Link(**record["link"])
    head = f"[{record['index'] + 1:>3}/{total}] {link.label:<11} repeat {record['repeat'] + 1}/{repeats}  "
    if record["world_size"] == 1:
        return head + f"1 rank (no communication): {record['step_ms']:.1f} ms/step"
    method = record["method"]
    if method == "auto":
        method = f"auto -> {record['chosen']} ({record['probe_steps']} probe steps)"
    return (
        head + f"{method}, bucket {record['bucket_cap_mb']:g} MB: {record['step_ms']:.1f} ms/step, "
        f"{record['bytes_per_step'] / 1e6:.3f} MB sent per step per rank"
    )


def combine(item: dict[str, Any], results: list[dict[str, Any] | None], batch_size: int) -> dict[str, Any]:
    """One record per schedule item: the slower rank's step time, the mean of the ranks' bytes sent (baseline: rank 0's
    only)."""
    measured = [result for result in results if result is not None]
    step_ms = max(result["step_ms"] for result in measured)
    return {
        **item,
        "step_ms": step_ms,
        "step_ms_per_rank": [result["step_ms"] for result in measured],
        "step_median_ms": max(result["step_median_ms"] for result in measured),
        "samples_per_s": item["world_size"] * batch_size / (step_ms / 1e3),
        "bytes_per_step": statistics.fmean(result["bytes_per_step"] for result in measured),
        "bytes_per_step_per_rank": [result["bytes_per_step"] for result in measured],
        "chosen": measured[0]["chosen"],
        "decision": measured[0]["decision"],
        "probe_steps": measured[0]["probe_steps"],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m app.bench.network_worker", description=__doc__)
    parser.add_argument("--plan", type=Path, required=True, help="written by python -m app.bench.network")
    parser.add_argument("--rank", type=int, required=True, choices=range(WORLD_SIZE))
    args = parser.parse_args(argv)
    plan = json.loads(args.plan.read_text())
    rank, interface = args.rank, plan["interfaces"][args.rank]
    configure_cpu_threads()
    init_gloo(plan, rank, WORLD_SIZE)
    limited, current_link = False, None
    try:
        # The 1-rank baseline's group; new_group is collective, so every rank creates it.
        rank_zero_alone = dist.new_group([0])
        job = build_job(plan["config"])
        batches = shard_batches(job, rank)
        records = Path(plan["records"])
        schedule = plan["schedule"]
        for item in schedule:
            if item["link"] != current_link:
                limited, current_link = set_rate(interface, Link(**item["link"]), limited), item["link"]
            dist.barrier()
            if item["world_size"] == 1:
                result = measure(job, batches, item, plan, rank, rank_zero_alone) if rank == 0 else None
                dist.barrier()  # rank 1 waits here meanwhile
            else:
                result = measure(job, batches, item, plan, rank, None)
            results: list[dict[str, Any] | None] = [None] * WORLD_SIZE
            dist.all_gather_object(results, result)
            if rank == 0:
                record = combine(item, results, job.batch_size)
                with records.open("a") as file:
                    file.write(json.dumps(record) + "\n")
                print(progress_line(record, len(schedule), plan["repeats"]), flush=True)
    finally:
        with contextlib.suppress(Exception):
            set_rate(interface, Link("unlimited", None), limited)
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
