"""A plain PyTorch FSDP2 trainer: the DDP reference's next step, for a model too large for DDP.

    python -m app.reference.fsdp --config configs/gpt_fsdp.yaml --out runs/reference_fsdp   # mp.spawn
    torchrun --nproc_per_node=2 -m app.reference.fsdp --config configs/gpt_fsdp.yaml --out runs/reference_fsdp

As PyTorch's FSDP2 tutorial: `fully_shard` each transformer block, then the whole network, over a 1-D mesh of every
rank; with `trainer.strategy.init_args.shard_group_size: N` a 2-D (replicas x N) mesh (HSDP). Snapshots go through DCP
(every rank its shards, resharded on another world size); the final weights are gathered into `final.pt` on rank 0.

It trains the same network, data order and optimizer as `strategy: fsdp` from the same YAML, so `python -m app.parity
--config configs/gpt_fsdp.yaml` compares them bit for bit. No Lightning. Supported: `app.models.gpt.GPTLanguageModel`'s
transformer on `SyntheticTokensDataModule`'s token walks, fp32, no gradient accumulation.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DistributedSampler

from app.cluster.threads import configure_cpu_threads
from app.data.datasets import LoaderSettings, markov_token_splits
from app.data.on_device import TensorBatchLoader, in_memory_tensors
from app.models.transformer import GPT
from app.reference.config import instantiate, load_config, seed_everything

MODEL = "GPTLanguageModel"
DATA = "SyntheticTokensDataModule"
# The model keys the reference reads from the config (GPTLanguageModel's, all of them given there).
MODEL_KEYS = ("vocab_size", "context", "d_model", "n_layers", "n_heads", "mlp_ratio")


def check_config(config: dict[str, Any]) -> None:
    """The reference trains what it was written for; anything else is one line, not a wrong result."""
    model, data = config["model"]["class_path"], config["data"]["class_path"]
    trainer = config.get("trainer") or {}
    if not model.endswith(MODEL) or not data.endswith(DATA):
        raise SystemExit(
            f"the FSDP2 reference trains {MODEL} on {DATA}, not {model} on {data}. Fix: a config like "
            "configs/gpt_fsdp.yaml."
        )
    missing = [key for key in MODEL_KEYS if key not in (config["model"].get("init_args") or {})]
    if missing:
        raise SystemExit(f"the FSDP2 reference reads every model key from the config; missing: {', '.join(missing)}.")
    strategy = trainer.get("strategy")
    init_args = (strategy.get("init_args") or {}) if isinstance(strategy, dict) else {}
    for key in ("param_dtype", "reduce_dtype"):
        if init_args.get(key):
            raise SystemExit(f"the FSDP2 reference trains in float32; the config sets trainer.strategy.{key}.")
    if int(trainer.get("accumulate_grad_batches") or 1) != 1 or str(trainer.get("precision", "32-true")) not in (
        "32",
        "32-true",
    ):
        raise SystemExit("the FSDP2 reference trains fp32 without gradient accumulation; the config asks otherwise.")


def shard(net: GPT, mesh: Any, reshard_after_forward: bool) -> None:
    """Each block its own unit, then the root for the rest: inner units must be sharded first."""
    for block in net.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(net, mesh=mesh, reshard_after_forward=reshard_after_forward)


def device_mesh(device: torch.device, world_size: int, init_args: dict[str, Any]) -> DeviceMesh:
    """Every rank in one dimension, or, with a `shard_group_size`, replicas x shards (consecutive ranks share a group;
    `node`: the ranks torchrun started on this node)."""
    size = init_args.get("shard_group_size") or world_size
    if size == "node":
        size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    if not isinstance(size, int) or size < 1 or world_size % size:
        raise SystemExit(f"trainer.strategy.init_args.shard_group_size={size!r} does not divide {world_size} ranks.")
    replicas = world_size // size
    if dist.get_rank() == 0:
        print(f"[rank 0] FSDP2 over {replicas} replica(s) x {size} shard(s)", flush=True)
    # An explicit device type: a mesh built for "cuda" while gloo runs on CPU failed (pytorch#132471).
    if replicas > 1:  # fully_shard replicates over the first dimension and shards over the second (HSDP)
        return init_device_mesh(device.type, (replicas, size), mesh_dim_names=("replicate", "shard"))
    return init_device_mesh(device.type, (world_size,), mesh_dim_names=("data_parallel",))


class Trainer:
    """Sharded model, sharded loader, DCP snapshots written by every rank."""

    def __init__(self, config: dict[str, Any], rank: int, world_size: int, device: torch.device, out: Path) -> None:
        self.rank, self.device, self.out = rank, device, out
        trainer = config.get("trainer") or {}
        strategy = trainer.get("strategy")
        init_args = (strategy.get("init_args") or {}) if isinstance(strategy, dict) else {}
        # Built in the order LightningCLI builds them (seed, model, then data): the same initial weights.
        seed_everything(int(config.get("seed_everything", 0)))
        self.net = GPT(**config["model"]["init_args"]).to(device)
        loader, dataset_args = LoaderSettings.split_off(config["data"].get("init_args") or {})
        train, _, _ = markov_token_splits(**dataset_args)
        shard(self.net, device_mesh(device, world_size, init_args), bool(init_args.get("reshard_after_forward", True)))
        self.optimizer = instantiate(config["optimizer"], self.net.parameters())  # on the shards
        self.sampler = DistributedSampler(train, num_replicas=world_size, rank=rank, shuffle=loader.shuffle,
                                          seed=loader.seed)  # fmt: skip
        split = in_memory_tensors(train)
        assert split is not None, "the token walks are a TensorDataset"
        # Batches by indexing the split's tensors, the same rows in the same order as a DataLoader's.
        self.train_data = TensorBatchLoader(split.tensors, self.sampler, loader.batch_size, False, split.rows)
        self.epochs_run = 0
        self.snapshot = out / "snapshot"
        if (self.snapshot / ".metadata").exists():
            self._load_snapshot()

    def _state(self) -> dict[str, Any]:
        return {
            "model": get_model_state_dict(self.net),
            "optimizer": get_optimizer_state_dict(self.net, self.optimizer),
        }

    def _load_snapshot(self) -> None:
        state = self._state()
        dcp.load(state, checkpoint_id=self.snapshot)  # every rank reads its part, resharded if needed
        set_model_state_dict(self.net, state["model"])
        set_optimizer_state_dict(self.net, self.optimizer, state["optimizer"])
        self.epochs_run = json.loads((self.out / "epochs_run.json").read_text())["epochs_run"]
        if self.rank == 0:
            print(f"Resuming training from snapshot at epoch {self.epochs_run}", flush=True)

    def _save_snapshot(self, epoch: int) -> None:
        dcp.save(self._state(), checkpoint_id=self.snapshot)  # every rank writes its shards
        if self.rank == 0:
            (self.out / "epochs_run.json").write_text(json.dumps({"epochs_run": epoch + 1}))
        dist.barrier()

    def _run_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)  # a new shuffled order every epoch, the same on every rank
        loss = torch.zeros(())
        for inputs, targets in self.train_data:
            inputs, targets = inputs.to(self.device), targets.to(self.device)
            self.optimizer.zero_grad()
            logits = self.net(inputs)  # each unit all-gathers its parameters for its forward
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))
            loss.backward()  # ... and reduce-scatters (averages) its gradients into the shards
            self.optimizer.step()  # each rank updates its own shards
        if self.rank == 0:
            print(f"[rank 0] epoch {epoch} | steps {len(self.train_data)} | last loss {loss.item():.4f}", flush=True)

    def train(self, max_epochs: int, save_every: int) -> None:
        for epoch in range(self.epochs_run, max_epochs):
            self._run_epoch(epoch)
            if save_every and (epoch + 1) % save_every == 0:
                self._save_snapshot(epoch)
        # The whole weights, gathered on every rank and kept on the CPU, written by rank 0.
        full = get_model_state_dict(self.net, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.rank == 0:
            torch.save(full, self.out / "final.pt")


def worker(rank: int, world_size: int, local_rank: int, options: dict[str, Any]) -> None:
    configure_cpu_threads()
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device, backend = torch.device("cuda", local_rank), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    timeout = datetime.timedelta(seconds=options["timeout_s"])
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout)
    try:
        config = options["config"]
        if (config.get("trainer") or {}).get("deterministic"):  # as Trainer(deterministic=True)
            torch.use_deterministic_algorithms(True)
        trainer = Trainer(config, rank, world_size, device, Path(options["out"]))
        trainer.train(options["max_epochs"], options["save_every"])
        dist.barrier()
    finally:
        dist.destroy_process_group()


def end_rank() -> NoReturn:
    """Exit a rank whose work is done and saved, without the interpreter's teardown.

    The device mesh keeps the gloo group alive until teardown, where releasing it can SIGABRT a finished rank
    ("terminate called without an active exception"), failing mp.spawn and torchrun; ddp-app's ranks end the same way
    (docs/fsdp.md, "Clean exit")."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn_entry(index: int, world_size: int, options: dict[str, Any]) -> None:
    worker(index, world_size, index, options)
    end_rank()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m app.reference.fsdp", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, required=True)
    parser.add_argument("--out", type=Path, default=Path("runs/reference_fsdp"))
    parser.add_argument("--world-size", type=int, default=None, help="mp.spawn's processes (default: trainer.devices)")
    parser.add_argument("--max-epochs", type=int, default=None, help="default: trainer.max_epochs")
    parser.add_argument("--save-every", type=int, default=1, help="a DCP snapshot every N epochs (0: none)")
    parser.add_argument("--timeout-s", type=float, default=300.0)
    args = parser.parse_args(argv)
    config = load_config(args.config)
    check_config(config)
    trainer = config.get("trainer") or {}
    args.out.mkdir(parents=True, exist_ok=True)
    options = {
        "config": config,
        "out": str(args.out),
        "max_epochs": args.max_epochs if args.max_epochs is not None else int(trainer.get("max_epochs", 1)),
        "save_every": args.save_every,
        "timeout_s": args.timeout_s,
    }
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun: one process per rank, env:// rendezvous
        worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"]), options)
        end_rank()
    from app.reference.train import spawn_rendezvous

    world_size = args.world_size or int(trainer.get("devices", 1))
    with spawn_rendezvous():
        mp.spawn(spawn_entry, args=(world_size, options), nprocs=world_size, join=True)


if __name__ == "__main__":
    main()
