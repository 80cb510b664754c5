"""A plain PyTorch DDP trainer, written the way the PyTorch DDP tutorials write one.

    python -m app.reference --config configs/digits.yaml                  # mp.spawn, world size = trainer.devices
    torchrun --nproc_per_node=2 -m app.reference --config configs/digits.yaml
    srun --ntasks-per-node=2 python -m app.reference --config configs/digits.yaml

It trains the same modules and datasets as the Lightning side, from the same YAML, for `python -m app.parity`. No
Lightning; instrumentation comes in as `make_hooks` (`app.bench.reference`).
"""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powerSGD
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from app.cluster.ddp_buffers import without_single_rank_broadcast
from app.cluster.preflight import detect_launch, resolve_devices
from app.cluster.slurm_env import master_address_and_port
from app.cluster.threads import configure_cpu_threads
from app.data.datasets import default_num_workers
from app.data.on_device import TensorBatchLoader, in_memory_tensors
from app.data.samplers import ElasticLayout, ResumableDistributedSampler
from app.data.worker_fork import fork_workers_safely
from app.reference.config import Job, build_job, load_config, prepare_data
from app.reference.diloco import DiLoCo


class StepHooks(Protocol):
    """What the trainer calls around every training step, and once at the end (e.g. a step timer)."""

    def step_start(self, epoch: int) -> None: ...

    def step_end(self) -> None: ...

    def finish(self, device: torch.device) -> None: ...


# Called in every rank with (rank, world size); returns that rank's hooks, or None for none. mp.spawn pickles it: pass a
# module-level function (or a functools.partial of one).
MakeHooks = Callable[[int, int], StepHooks | None]


@contextlib.contextmanager
def spawn_rendezvous() -> Iterator[None]:
    """Where the ranks mp.spawn starts meet: a TCPStore this process serves on a port the kernel picks, to which every
    rank connects as a client (TORCHELASTIC_USE_AGENT_STORE="True" at MASTER_ADDR:MASTER_PORT, as under torchrun). The
    tutorials' fixed port, or a free port left for rank 0 to bind seconds later, is a race another job can win
    (app/cluster/rendezvous.py). A MASTER_PORT already set is used as it is."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if os.environ.get("MASTER_PORT"):
        yield
        return
    store = dist.TCPStore(os.environ["MASTER_ADDR"], 0, is_master=True, wait_for_workers=False)
    os.environ["MASTER_PORT"], os.environ["TORCHELASTIC_USE_AGENT_STORE"] = str(store.port), "True"
    try:
        yield
    finally:
        del os.environ["MASTER_PORT"], os.environ["TORCHELASTIC_USE_AGENT_STORE"]


def setup(rank: int, world_size: int, local_rank: int, timeout_s: float) -> torch.device:
    """Join the process group (MASTER_ADDR/MASTER_PORT come from the environment) and pick a device."""
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device, backend = torch.device("cuda", local_rank), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s))
    return device


def cleanup() -> None:
    dist.destroy_process_group()


def register_compression(model: DDP, compression: dict[str, Any]) -> None:
    """gradient_compression: PyTorch's DDP communication hooks, registered as its docs show."""
    method = compression["method"]
    if method == "fp16":
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif method == "bf16":
        model.register_comm_hook(None, default_hooks.bf16_compress_hook)
    elif method == "powersgd":
        state = powerSGD.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=compression["powersgd_rank"],
            start_powerSGD_iter=compression["start_iter"],
            use_error_feedback=compression["error_feedback"],
            warm_start=compression["warm_start"],
        )
        on_gloo = dist.get_backend() == "gloo"

        def powersgd_hook(state: powerSGD.PowerSGDState, bucket):  # noqa: ANN202 (DDP checks annotations)
            future = powerSGD.powerSGD_hook(state, bucket)
            if on_gloo:
                # gloo runs the hook's callbacks on its 2 worker threads, where they wait for the next all-reduce: with
                # several buckets in flight that deadlocks (see app/parallel/compression.py).
                future.wait()
            return future

        model.register_comm_hook(state, powersgd_hook)


class Trainer:
    """The tutorial's Trainer: DDP-wrapped model, sharded loader, rank-0 snapshots."""

    def __init__(
        self,
        job: Job,
        rank: int,
        world_size: int,
        device: torch.device,
        out_dir: Path,
        save_every: int,
        hooks: StepHooks | None = None,
    ) -> None:
        self.rank = rank
        self.hooks = hooks  # e.g. step timings for `python -m app.bench`; None in normal runs
        self.device = device
        self.out_dir = out_dir
        self.save_every = save_every
        self.criterion = job.criterion
        self.channels_last = job.channels_last
        self.bf16 = job.precision == "bf16-mixed"
        self.accumulation_steps = job.accumulation_steps  # micro-batches per optimizer step
        self.snapshot_path = out_dir / "snapshot.pt"
        # The world size and per-rank batch whose sample order this run follows: its own, or those of the run whose
        # snapshot it continues on another number of ranks (elastic, as ddp-app does).
        self.order = self._snapshot_order(world_size, job.batch_size)
        self.layout = None
        batch_size = job.batch_size
        if self.order[0] != world_size:
            self.layout = ElasticLayout(self.order[0], self.order[0] * self.order[1], world_size)
            batch_size = self.layout.rank_batch_size(rank)
            self.sampler: DistributedSampler = ResumableDistributedSampler(
                job.train_dataset, world_size, rank, job.shuffle, job.sampler_seed, batch_size, layout=self.layout
            )
            if rank == 0:
                sizes = "+".join(str(size) for size in self.layout.per_rank_sizes())
                print(f"Resuming a {self.order[0]}-rank run on {world_size} ranks: global micro-batch "
                      f"{self.layout.micro_batch} kept ({sizes}), sample order kept", flush=True)  # fmt: skip
        else:
            self.sampler = DistributedSampler(
                job.train_dataset, num_replicas=world_size, rank=rank, shuffle=job.shuffle, seed=job.sampler_seed
            )
        # Uneven shares of a global micro-batch: each rank's loss weighted so the all-reduced gradient is the mean over
        # it (app.resume.elastic.ElasticLayout.weight).
        length = len(job.train_dataset)
        self.loss_weights = (
            [self.layout.weight(length, block, rank) for block in range(self.layout.blocks(length))]
            if self.layout is not None
            else None
        )
        num_workers = job.num_workers
        if num_workers is None:  # sized to the machine, as the Lightning side does
            local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
            num_workers = default_num_workers(job.train_dataset, device.type == "cuda", local_ranks)
        # Pinned host memory lets the copies below run asynchronously (non_blocking) on a GPU.
        pin_memory = device.type == "cuda" if job.pin_memory is None else job.pin_memory
        split = in_memory_tensors(job.train_dataset)
        self.train_data: DataLoader | TensorBatchLoader
        if split is not None and num_workers == 0:
            # As the Lightning side: a split held as tensors is batched by indexing, not sample by sample
            # (app/data/on_device.py), the same rows in the same order as a DataLoader's.
            self.train_data = TensorBatchLoader(split.tensors, self.sampler, batch_size, pin_memory, split.rows)
        else:
            self.train_data = DataLoader(
                job.train_dataset,
                batch_size=batch_size,  # per process
                shuffle=False,  # the sampler shuffles
                sampler=self.sampler,
                num_workers=num_workers,
                pin_memory=pin_memory,
                persistent_workers=job.persistent_workers and num_workers > 0,
                # As the Lightning side: the per-epoch iterator seed comes from here, not from the global generator that
                # dropout draws from.
                generator=torch.Generator().manual_seed(job.sampler_seed),
            )
            # Its ranks run gloo too: a worker hung in the fork is forked again (CPython before 3.12).
            fork_workers_safely(self.train_data)
        model = job.net.to(device)
        self.net = model
        self.diloco: DiLoCo | None = None
        self.model: DDP | nn.Module
        if job.diloco is not None:
            # strategy: diloco: no DDP (its backward would all-reduce every step); the outer loop syncs.
            self.model = model
            self.diloco = DiLoCo(model, world_size, job.diloco)
        else:
            # One device per process: device_ids=[local index]; on CPU, DDP takes no device_ids.
            # ddp_kwargs: bucket_cap_mb, gradient_as_bucket_view, ... from the config's DDPStrategy.
            ddp_kwargs = without_single_rank_broadcast(job.ddp_kwargs, world_size)  # as the Lightning side
            self.model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None, **ddp_kwargs)
            register_compression(self.model, job.compression)
        self.optimizer = job.optimizer(self.model.parameters())
        self.scheduler = job.scheduler(self.optimizer)
        self.epochs_run = 0
        if self.snapshot_path.exists():
            self._load_snapshot()

    def _snapshot_order(self, world_size: int, batch_size: int) -> tuple[int, int]:
        if not self.snapshot_path.exists():
            return world_size, batch_size
        order = torch.load(self.snapshot_path, map_location="cpu", weights_only=True).get("ORDER")
        return (int(order["world_size"]), int(order["batch_size"])) if order else (world_size, batch_size)

    def _load_snapshot(self) -> None:
        # Snapshots are written from cuda:0 (or cpu); map them onto this rank's device.
        snapshot = torch.load(self.snapshot_path, map_location=self.device, weights_only=True)
        self.net.load_state_dict(snapshot["MODEL_STATE"])
        self.optimizer.load_state_dict(snapshot["OPTIMIZER_STATE"])
        if self.scheduler is not None:
            self.scheduler.load_state_dict(snapshot["SCHEDULER_STATE"])
        self.epochs_run = snapshot["EPOCHS_RUN"]
        if self.rank == 0:
            print(f"Resuming training from snapshot at epoch {self.epochs_run}")

    def _run_batch(self, source: torch.Tensor, targets: torch.Tensor, batch_index: int) -> float:
        """One micro-batch; every `accumulation_steps` of them (and the epoch's last) make one step."""
        steps = self.accumulation_steps
        # As Lightning: the last micro-batch of the epoch steps too, even if its group is short.
        should_step = (batch_index + 1) % steps == 0 or batch_index + 1 == len(self.train_data)
        if batch_index % steps == 0:  # the group's first micro-batch (where Lightning zeroes them too)
            self.optimizer.zero_grad()
        # Micro-batches that do not step skip the all-reduce: their gradients add up locally and the
        # step's backward all-reduces the sum. The forward pass must be inside no_sync() too: DDP
        # decides there whether the following backward all-reduces.
        with contextlib.nullcontext() if should_step or self.diloco else self.model.no_sync():
            # bf16-mixed: the forward pass (and loss) in bfloat16 where safe, as Lightning's precision plugin.
            with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16):
                loss = self.criterion(self.model(source), targets)
            weighted = loss if self.loss_weights is None else loss * self.loss_weights[batch_index]
            # loss / steps: the gradients summed over the group's micro-batches are their mean.
            (weighted / steps).backward()  # on a stepping micro-batch, DDP all-reduces (averages) here
        if should_step:
            self.optimizer.step()
            if self.diloco is not None:
                self.diloco.after_inner_step()
        return loss.item()

    def _run_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)  # a new shuffled order every epoch, the same on every rank
        losses = []
        for batch_index, (source, targets) in enumerate(self.train_data):
            source = source.to(self.device, non_blocking=True)
            if self.channels_last:  # on the device: a CPU-side reordering would be paid by the loading thread
                source = source.contiguous(memory_format=torch.channels_last)
            targets = targets.to(self.device, non_blocking=True)
            if self.hooks is not None:
                self.hooks.step_start(epoch)
            losses.append(self._run_batch(source, targets, batch_index))
            if self.hooks is not None:
                self.hooks.step_end()
        if self.scheduler is not None:
            self.scheduler.step()
        if self.rank == 0:
            print(f"[rank {self.rank}] epoch {epoch} | steps {len(losses)} | last loss {losses[-1]:.4f}", flush=True)

    def _save_snapshot(self, epoch: int) -> None:
        """Rank 0 writes; everyone waits at the barrier; then every rank reads it back."""
        if self.rank == 0:
            snapshot = {
                "MODEL_STATE": self.net.state_dict(),
                "OPTIMIZER_STATE": self.optimizer.state_dict(),
                "SCHEDULER_STATE": self.scheduler.state_dict() if self.scheduler is not None else {},
                "EPOCHS_RUN": epoch + 1,
                "ORDER": {"world_size": self.order[0], "batch_size": self.order[1]},
            }
            temporary = self.snapshot_path.with_suffix(".tmp")
            torch.save(snapshot, temporary)
            os.replace(temporary, self.snapshot_path)  # never a half-written snapshot
        dist.barrier()
        if self.diloco is not None:  # the replicas differ between outer steps: each keeps its own
            return
        loaded = torch.load(self.snapshot_path, map_location=self.device, weights_only=True)
        self.net.load_state_dict(loaded["MODEL_STATE"])

    def train(self, max_epochs: int) -> None:
        for epoch in range(self.epochs_run, max_epochs):
            self._run_epoch(epoch)
            if self.save_every and (epoch + 1) % self.save_every == 0:
                self._save_snapshot(epoch)
        if self.diloco is not None:  # an outer all-reduce still in flight is waited for, not abandoned
            self.diloco.finish()
        if self.rank == 0:
            torch.save(self.net.state_dict(), self.out_dir / "final.pt")


def train_worker(rank: int, world_size: int, local_rank: int, options: dict[str, Any]) -> None:
    """One rank's whole life: set up, build, train, tear down."""
    configure_cpu_threads()
    device = setup(rank, world_size, local_rank, options["timeout_s"])
    try:
        if local_rank == 0:
            prepare_data(options["config"])  # downloads, once per node
        dist.barrier()
        job = build_job(options["config"])
        if job.deterministic:  # as Trainer(deterministic=...) does for the same config
            torch.use_deterministic_algorithms(True, warn_only=job.deterministic == "warn")
        make_hooks = options.get("make_hooks")
        hooks = make_hooks(rank, world_size) if make_hooks is not None else None
        trainer = Trainer(job, rank, world_size, device, Path(options["out_dir"]), options["save_every"], hooks)
        trainer.train(options["max_epochs"])
        if hooks is not None:
            hooks.finish(device)
        # gloo runs a communication hook's callbacks (PowerSGD's) on its worker threads, and they hold the process
        # group. Waiting here lets those threads release them while this thread still holds the group; if a gloo thread
        # drops the last reference, the group's destructor joins that thread itself and the process aborts at exit
        # ("Resource deadlock avoided").
        dist.barrier()
    finally:
        cleanup()


def spawn_entry(local_rank: int, world_size: int, options: dict[str, Any]) -> None:
    """mp.spawn passes the process index first; on one machine it is both rank and local rank."""
    train_worker(local_rank, world_size, local_rank, options)


def launch(options: dict[str, Any], devices: int, num_nodes: int) -> str:
    """Start training with whichever launcher started us; returns its name."""
    # Who started this process, checked against devices x num_nodes: the one answer ddp-app uses too.
    launched = detect_launch(os.environ, devices, num_nodes)
    if launched.launcher == "srun":
        # srun: one task per rank; the rendezvous is on the job's first node.
        address, port = master_address_and_port()
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = address, str(port)
    if launched.launcher in ("torchrun", "srun"):
        # torchrun set RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT for us (env://).
        train_worker(launched.global_rank, launched.world_size, launched.local_rank, options)
        return launched.launcher
    with spawn_rendezvous():
        mp.spawn(spawn_entry, args=(launched.world_size, options), nprocs=launched.world_size, join=True)
    return "mp.spawn"


def run(
    config_path: str | Path,
    out_dir: str | Path,
    world_size: int | None = None,
    max_epochs: int | None = None,
    save_every: int = 0,
    timeout_s: float = 300.0,
    make_hooks: MakeHooks | None = None,
) -> str:
    config = load_config(config_path)
    trainer_config = config.get("trainer") or {}
    if world_size is None:
        devices = trainer_config.get("devices", 1)
        world_size = resolve_devices(devices, trainer_config.get("accelerator", "auto")) or 1
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    options = {
        "config": config,
        "out_dir": str(out),
        "max_epochs": max_epochs if max_epochs is not None else int(trainer_config.get("max_epochs", 1)),
        "save_every": save_every,
        "timeout_s": timeout_s,
        "make_hooks": make_hooks,
    }
    return launch(options, world_size, int(trainer_config.get("num_nodes") or 1))
