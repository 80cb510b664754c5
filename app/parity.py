"""`python -m app.parity --config configs/digits.yaml [--world-size 2] [--epochs 3]`

Trains one config with Lightning DDP and with the plain-PyTorch reference and checks, for SGD and
for Adam, that they agree:

  P1  Lightning DDP == reference DDP at the same world size: every parameter and buffer bit for bit.
  P2a DDP over N ranks == one process accumulating the N ranks' micro-batches with loss / N (bit for bit).
  P2b DDP over N ranks ~= one process with the N-fold batch (max |diff| <= 1e-6: summation order differs).
  P3  validation and test accuracy are the same number at world size 1 and N, and equal a plain
      single-process evaluation of the same weights (no padded, double-counted samples).
  P4  interoperability, both ways. The reference's snapshot after the last epoch, converted into a
      Lightning checkpoint (`reference_to_lightning_checkpoint`: weights, optimizer and scheduler
      state), continued one more epoch by Lightning == the reference continuing from the same
      snapshot, bit for bit (for Adam only, or the first optimizer without it: two launches more).
      And `python -m app.export` writes a bare state_dict that a plain nn.Module loads with
      weights_only=True: the same predictions as the Lightning checkpoint.
  P5  launchers: ddp-app's own launcher == ddp-app under torchrun, and the reference under
      mp.spawn == the reference under torchrun (P1 compares the two trainers; P5 only launchers).
  P6  gradient accumulation: Lightning DDP with trainer.accumulate_grad_batches=k == the reference
      with the same k, bit for bit; k leaves the epoch a short last group, which steps too.
  P7  gradient compression: Lightning DDP with gradient_compression.method fp16, bf16 and powersgd
      == the reference registering the same PyTorch hook, bit for bit (for the interop optimizer,
      as P4: six launches), and each differs from P1's uncompressed weights (the hook ran).
  P8  elastic resume: Lightning stopped mid-epoch at N ranks and resumed on N + 1 (the global batch
      split unevenly, each rank's loss weighted) vs the reference's uninterrupted N-rank run, within
      1e-5 of the largest weight (fp32 summation order); and the reference's snapshot continued on
      N + 1 ranks by Lightning and by the reference (which splits and weights the same way), bit for
      bit (for the interop optimizer: four launches).

For a config with `strategy: fsdp` (app/parallel/fsdp.py) it runs these rows instead, against the plain-PyTorch
FSDP2 reference (app/reference/fsdp.py):

  P9a  Lightning FSDP2 == the plain-PyTorch FSDP2 reference (app/reference/fsdp.py) at N ranks, fp32:
       every weight bit for bit (the same shard units, data order, optimizer and collectives).
  P9b  FSDP2 ~= DDP: the same config trained by ddp-app with `strategy: ddp`, within 1e-5 of the
       model's largest weight: reduce-scatter and all-reduce may sum the ranks' gradients in another
       order (at 2 ranks on gloo they agree bit for bit: a + b is b + a).
  P9c  elastic: Lightning FSDP2 with SGD stopped by a max_steps budget mid-epoch on N ranks and
       resumed on N + 1 (DCP reshards weights and optimizer state, app/resume/elastic.py keeps the sample
       order and the global batch) == the uninterrupted N-rank run within 1e-5 of the largest weight.
  P9d  hybrid sharding (`shard_group_size`: N/2 ranks per group, 1 at N = 2, so 2 replicas): Lightning
       == the plain-PyTorch reference on the same 2-D mesh, bit for bit.
  P9e  hybrid ~= full sharding: P9d's weights against P9a's, within 1e-5 of the largest weight (the
       gradients are summed within each group, then between groups; at 2 ranks a + b, bit for bit).

For a config with `strategy: diloco` (app/parallel/diloco.py) it runs these rows instead, against the
reference's DiLoCo (app/reference/diloco.py):

  P10a Lightning DiLoCo == the reference's DiLoCo with the config's settings, every weight bit for bit.
  P10b DiLoCo with sync_every 1, inner SGD and an outer SGD of lr 1 without momentum ~= DDP with SGD,
       within 1e-6 of the largest weight (the mean is of lr x gradient, rounded, not of the gradient).

Prints a table, writes it as JSON, exits 1 if any check fails.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import yaml
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

from app.checkpoints import state as checkpoint_state
from app.checkpoints.io import load_net_weights, net_state_dict, safe_load
from app.checkpoints.sharded import META_NAME, is_sharded_checkpoint, load_full_tensors
from app.cluster.exit_codes import BAD_INPUT_EXIT_CODE
from app.cluster.launch import env_without_launcher
from app.cluster.threads import configure_cpu_threads
from app.errors import UserFacingError
from app.parallel.strategy import DILOCO_CLASS_PATH, FSDP_CLASS_PATH, StrategyKind, mesh_layout, resolve_strategy
from app.reference.config import Job, build_job, instantiate, load_config

OPTIMIZERS: dict[str, dict[str, Any]] = {
    "sgd": {"class_path": "torch.optim.SGD", "init_args": {"lr": 0.05, "momentum": 0.9}},
    "adam": {"class_path": "torch.optim.Adam", "init_args": {"lr": 0.002}},
}


@dataclass
class Check:
    name: str
    optimizer: str
    compared: str
    max_abs_diff: float
    tolerance: float
    passed: bool
    detail: str = ""


def compare_states(
    expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor], tolerance: float
) -> tuple[float, str]:
    """(max |difference| over all tensors, a note naming the first tensor that differs, or "")."""
    if expected.keys() != actual.keys():
        missing = sorted(set(expected) ^ set(actual))
        return float("inf"), f"different tensor names, first: {missing[0]}"
    worst, first = 0.0, ""
    for name, tensor in expected.items():
        other = actual[name]
        if tensor.shape != other.shape:
            return float("inf"), f"{name}: shape {tuple(tensor.shape)} vs {tuple(other.shape)}"
        diff = (tensor.double() - other.double()).abs().max().item() if tensor.numel() else 0.0
        exact = torch.equal(tensor, other)
        if not first and (diff > tolerance or (tolerance == 0 and not exact)):
            first = f"first difference in {name}: max |diff| {diff:.3e}"
        worst = max(worst, diff)
    return worst, first


def state_check(
    name: str, optimizer: str, compared: str, expected: dict, actual: dict, tolerance: float = 0.0
) -> Check:
    diff, detail = compare_states(expected, actual, tolerance)
    return Check(name, optimizer, compared, diff, tolerance, not detail, detail)


def python_env() -> dict[str, str]:
    """The child processes' environment: no launcher variables inherited from the caller."""
    env = env_without_launcher(os.environ)
    env["OMP_NUM_THREADS"] = env.get("OMP_NUM_THREADS", "1")
    # P8 resumes on one rank more than the run started with, which may exceed the cores here.
    env["DDP_APP_ALLOW_OVERSUBSCRIBE"] = "1"
    return env


def run_command(args: list[str], log: Path, timeout: float = 600) -> None:
    """Run one training/eval command; its output goes to a log file that a failure points at."""
    with log.open("w") as output:
        result = subprocess.run(
            args, stdout=output, stderr=subprocess.STDOUT, env=python_env(), timeout=timeout, check=False
        )
    if result.returncode != 0:
        tail = "".join(log.read_text().splitlines(keepends=True)[-15:])
        raise RuntimeError(f"command failed ({result.returncode}): {' '.join(args)}\nlog {log}:\n{tail}")


def lightning_fit(
    config: Path, root: Path, launcher: str, world_size: int, extra_args: list[str] | None = None
) -> dict[str, torch.Tensor]:
    app_args = ["-m", "app", "fit", "--config", str(config), f"--trainer.default_root_dir={root}"]
    app_args += extra_args or []
    if launcher == "torchrun":
        args = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world_size}"]
        args += app_args
    else:
        args = [sys.executable, *app_args]
    run_command(args, root.with_suffix(".log"))
    (last,) = root.rglob("last.ckpt")
    return last_weights(last)


def reference_fit(
    config: Path, out: Path, launcher: str, world_size: int, extra_args: list[str] | None = None
) -> dict[str, torch.Tensor]:
    """Train with the reference; a snapshot.pt already in `out` is resumed from, as the tutorial does."""
    ref_args = ["-m", "app.reference", "--config", str(config), "--out", str(out), "--save-every", "1"]
    ref_args += extra_args or []
    if launcher == "torchrun":
        args = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world_size}"]
        args += ref_args
    else:
        args = [sys.executable, *ref_args, "--world-size", str(world_size)]
    out.mkdir(parents=True, exist_ok=True)
    run_command(args, out.with_suffix(".log"))
    return safe_load(out / "final.pt")


def reference_to_lightning_checkpoint(
    snapshot: dict[str, Any], module: nn.Module, lightning_checkpoint: dict[str, Any]
) -> dict[str, Any]:
    """A Lightning checkpoint that continues the reference's run: its weights, optimizer and scheduler.

    `snapshot` is the reference's `snapshot.pt`; `module` the LightningModule that loads it. Only the loop counters and
    ddp-app's data position come from `lightning_checkpoint` (Lightning's own checkpoint of the same epoch, P1's
    last.ckpt). Neither side restores RNG state: bit-for-bit continuation needs a model without dropout."""
    epochs_run = int(snapshot["EPOCHS_RUN"])
    if int(lightning_checkpoint["epoch"]) + 1 != epochs_run:
        raise ValueError(
            f"the reference snapshot ends epoch {epochs_run} but the Lightning checkpoint whose loop counters "
            f"it borrows ends epoch {int(lightning_checkpoint['epoch']) + 1}; use checkpoints of the same epoch."
        )
    state_dict = {f"net.{key}": value for key, value in snapshot["MODEL_STATE"].items()}
    if state_dict.keys() != module.state_dict().keys():
        missing = sorted(set(state_dict) ^ set(module.state_dict()))
        raise ValueError(f"the reference's weights do not fit {type(module).__name__}: first mismatch {missing[0]}")
    scheduler_state = snapshot.get("SCHEDULER_STATE") or {}
    # Optimizer state is keyed by parameter index. The module holds nothing but `net` (checked above), so its parameters
    # are the network's in the same order: the indices carry over.
    return checkpoint_state.lightning_checkpoint(
        state_dict,
        [snapshot["OPTIMIZER_STATE"]],
        [scheduler_state] if scheduler_state else [],
        counters_of=lightning_checkpoint,
    )


def single_process_fit(config: dict[str, Any], world_size: int, mode: str) -> dict[str, torch.Tensor]:
    """One process that sees, per step, exactly the micro-batches the N ranks would see.

    mode "accumulate": backward on each rank's micro-batch with loss / N, then one step. mode "global-batch": one
    forward/backward over the N micro-batches concatenated."""
    configure_cpu_threads()
    job = build_job(config)
    net, criterion = job.net, job.criterion
    optimizer = job.optimizer(net.parameters())
    scheduler = job.scheduler(optimizer)
    samplers = [
        DistributedSampler(job.train_dataset, world_size, rank, shuffle=job.shuffle, seed=job.sampler_seed)
        for rank in range(world_size)
    ]
    loaders = [
        DataLoader(job.train_dataset, batch_size=job.batch_size, sampler=sampler, generator=torch.Generator())
        for sampler in samplers
    ]
    for epoch in range(int(config["trainer"]["max_epochs"])):
        for sampler in samplers:
            sampler.set_epoch(epoch)
        for micro_batches in zip(*loaders, strict=True):
            optimizer.zero_grad()
            if mode == "accumulate":
                for inputs, targets in micro_batches:
                    (criterion(net(inputs), targets) / world_size).backward()
            else:
                inputs = torch.cat([batch[0] for batch in micro_batches])
                targets = torch.cat([batch[1] for batch in micro_batches])
                criterion(net(inputs), targets).backward()
            optimizer.step()
        if scheduler is not None:
            scheduler.step()
    return {key: value.detach().clone() for key, value in net.state_dict().items()}


def lightning_eval(config: Path, ckpt: Path, devices: int, out: Path) -> dict[str, float]:
    """Lightning `validate` then `test` of one checkpoint at a world size, in one launch."""
    args = [
        sys.executable,
        "-m",
        "app.parity",
        "eval-worker",
        "--config",
        str(config),
        "--ckpt",
        str(ckpt),
        "--devices",
        str(devices),
        "--json",
        str(out),
    ]
    run_command(args, out.with_suffix(".log"))
    return json.loads(out.read_text())


def eval_worker(config: str, ckpt: str, devices: int, out: str) -> None:
    """Runs on every rank (Lightning re-runs this command line for ranks >= 1); rank 0 writes."""
    from app.cli import DDPAppCLI

    cli = DDPAppCLI(
        args=[
            "--config",
            config,
            f"--trainer.devices={devices}",
            "--trainer.logger=false",
            f"--trainer.default_root_dir={Path(out).parent / 'eval_root'}",
        ],
        run=False,
    )
    validated = cli.trainer.validate(cli.model, datamodule=cli.datamodule, ckpt_path=ckpt, verbose=False)
    tested = cli.trainer.test(cli.model, datamodule=cli.datamodule, ckpt_path=ckpt, verbose=False)
    if cli.trainer.global_rank == 0:
        Path(out).write_text(json.dumps({**validated[0], **tested[0]}))
    # Lightning leaves the process group up; a gloo thread alive at interpreter exit can abort it.
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def plain_accuracy(net: torch.nn.Module, dataset, batch_size: int = 256) -> float:
    """Accuracy over every sample exactly once, in one process, as torchmetrics' float32 division."""
    correct = total = 0
    net.eval()
    with torch.no_grad():
        for inputs, targets in DataLoader(dataset, batch_size=batch_size):
            correct += int((net(inputs).argmax(dim=1) == targets).sum())
            total += len(targets)
    return (torch.tensor(correct, dtype=torch.float32) / torch.tensor(total, dtype=torch.float32)).item()


def predictions(net: torch.nn.Module, dataset) -> torch.Tensor:
    net.eval()
    with torch.no_grad():
        return torch.cat([net(inputs) for inputs, _ in DataLoader(dataset, batch_size=256)])


def accumulation_with_tail(batches_per_epoch: int) -> int:
    """The smallest k >= 2 that does not divide the epoch: its last group is short (Lightning steps it)."""
    steps = 2
    while batches_per_epoch % steps == 0:
        steps += 1
    return steps


def batches_per_epoch(job: Job, world_size: int) -> int:
    """Micro-batches one rank sees per epoch, as its DistributedSampler and DataLoader give them."""
    sampler = DistributedSampler(job.train_dataset, world_size, 0, shuffle=job.shuffle, seed=job.sampler_seed)
    return len(DataLoader(job.train_dataset, batch_size=job.batch_size, sampler=sampler))


def variant_config(base: dict[str, Any], optimizer: str, epochs: int, world_size: int, path: Path) -> dict:
    """The base config with this optimizer, epochs and world size: one file drives every run."""
    config = copy.deepcopy(base)
    current = config.get("optimizer") or {}
    wanted = OPTIMIZERS[optimizer]
    config["optimizer"] = current if current.get("class_path") == wanted["class_path"] else wanted
    trainer = config.setdefault("trainer", {})
    trainer.update(max_epochs=epochs, devices=world_size, enable_progress_bar=False, accelerator="cpu")
    # P1-P5 step after every batch (P2's single process does); P6 adds accumulation on its own, P7 compression (P2's
    # single process has no all-reduce to compress).
    trainer.pop("accumulate_grad_batches", None)
    config.pop("gradient_compression", None)
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return config


# What run_parity runs for each optimizer, in order (`step_seconds` in parity.json sums each over them).
STEPS = [
    "config",
    "lightning fit",
    "reference mp.spawn",
    "P2 single process",
    "P3 eval",
    "P4 interop, export",
    "P5 torchrun",
    "P6 accumulation",
    "P7 compression",
]
# Processes started per optimizer, each a launch of ddp-app or the reference (or app.export): Lightning and reference
# (P1), two evaluations (P3), the export (P4), both under torchrun (P5) and both accumulating (P6). For the interop
# optimizer also: P4's continuation and P8's elastic resume and continuation (two each), and P7's Lightning and
# reference per compression method.
LAUNCHES_PER_OPTIMIZER = 9
# The measured figure (docs/parity.md): the command's 30 launches on configs/digits.yaml, 2 ranks, 3 epochs, took 267 s
# on an idle 2-core VM, about 9 s each (mostly starting Python, torch and the ranks); tests/parity/test_parity.py has
# seen up to 560 s on a busy one.
SECONDS_PER_LAUNCH = 9


def launches(optimizers: list[str]) -> int:
    """How many processes (each 1 to world size + 1 ranks) run_parity launches for `optimizers`."""
    return LAUNCHES_PER_OPTIMIZER * len(optimizers) + 6 + 2 * len(COMPRESSION_CHECKED)


def interop_optimizer_of(optimizers: list[str]) -> str:
    """The optimizer P4's continuation, P7 and P8 run for: Adam's (the conversion moves every optimizer's state the same
    way, and Adam has the most of it), or the first without it."""
    return "adam" if "adam" in optimizers else optimizers[0]


def stage_plan(optimizers: list[str]) -> list[str]:
    """Every stage `run_parity` announces, in order: made before the run, so that each line can say how many there are
    ([3/19]); `Progress` refuses a stage out of this order."""
    interop_optimizer = interop_optimizer_of(optimizers)
    stages = []
    for optimizer in optimizers:
        stages += [f"{optimizer}: {what}" for what in ("lightning fit", "reference", "single process", "evaluation")]
        if optimizer == interop_optimizer:
            stages += [f"{optimizer}: reference -> Lightning", f"{optimizer}: elastic resume"]
        stages += [f"{optimizer}: {what}" for what in ("export", "torchrun", "accumulation")]
        if optimizer == interop_optimizer:
            stages += [f"{optimizer}: compression {method}" for method in COMPRESSION_CHECKED]
    return stages


def fsdp_stage_plan(world_size: int) -> list[str]:
    """Every stage `fsdp_parity` announces, in order (P9a's two trainings, P9b's, P9c's, P9d's two)."""
    return [
        "fsdp: Lightning FSDP2",
        "fsdp: the plain-PyTorch FSDP2 reference",
        "fsdp: Lightning DDP",
        f"fsdp: SGD, stopped on {world_size} ranks, resumed on {world_size + 1}",
        f"fsdp: Lightning hybrid sharding, shard_group_size {hybrid_group_size(world_size)}",
        f"fsdp: the reference's hybrid sharding, shard_group_size {hybrid_group_size(world_size)}",
    ]


def hybrid_group_size(world_size: int) -> int:
    """P9d's shard groups: two replicas of N/2 ranks (of 1 rank at N = 2; at odd N, N replicas of 1)."""
    return world_size // 2 if world_size % 2 == 0 else 1


def start_line(config_path: Path, world_size: int, epochs: int, optimizers: list[str]) -> str:
    """What `python -m app.parity` says before it starts: what it runs and roughly for how long."""
    count = launches(optimizers)
    minutes = count * SECONDS_PER_LAUNCH / 60
    return (
        f"app.parity: {config_path} with Lightning and with the reference, for {' and '.join(optimizers)}: "
        f"{len(stage_plan(optimizers))} stages, {count} launches of {world_size}-{world_size + 1} ranks "
        f"({epochs} epochs each); about {minutes:.1f} min ({SECONDS_PER_LAUNCH} s a launch on an idle 2-core "
        "machine with configs/digits.yaml), up to twice that on a busy one or longer for a bigger config."
    )


class Progress:
    """One line per stage as it starts, numbered 1 to N over the planned stages (`stage_plan`), so a log shows where a
    run of several minutes is; and the seconds per step of STEPS (summed over the optimizers: where the time goes). A
    step is a unit of accounting, not a stage: some steps announce no stage ("config"), others several (P7's compression
    methods)."""

    def __init__(self, stages: list[str]) -> None:
        self.stages = stages
        self.announced = 0
        self.seconds = dict.fromkeys(STEPS, 0.0)
        self.started = self.clock = time.perf_counter()

    def stage(self, what: str) -> None:
        planned = self.stages[self.announced] if self.announced < len(self.stages) else None
        if what != planned:  # a bug here: the plan and the run have drifted apart, and N would lie
            raise AssertionError(f"app.parity: stage {what!r} is not the next planned one ({planned!r})")
        self.announced += 1
        elapsed = time.perf_counter() - self.started
        print(f"app.parity: [{self.announced}/{len(self.stages)}] {what} ({elapsed:.0f} s so far)", flush=True)

    def step_done(self, step: str) -> None:
        now = time.perf_counter()
        self.seconds[step] += now - self.clock
        self.clock = now

    def finish(self) -> None:
        """Every planned stage ran: a plan with a stage the run skips would count to N - 1 of N."""
        if self.announced != len(self.stages):
            planned = len(self.stages)
            raise AssertionError(f"app.parity: ran {self.announced} of {planned} planned stages: {self.stages}")


def run_parity(
    config_path: Path, world_size: int, epochs: int, out_dir: Path, optimizers: list[str]
) -> tuple[list[Check], dict[str, float]]:
    base = load_config(config_path)
    checks: list[Check] = []
    # P4's continuation is two more launches (about 15 s here); it runs for one optimizer only.
    interop_optimizer = interop_optimizer_of(optimizers)
    progress = Progress(stage_plan(optimizers))
    step_done = progress.step_done

    for optimizer in optimizers:
        work = out_dir / optimizer
        work.mkdir(parents=True, exist_ok=True)
        variant_path = work / "config.yaml"
        config = variant_config(base, optimizer, epochs, world_size, variant_path)
        step_done("config")

        progress.stage(f"{optimizer}: lightning fit")
        lightning = lightning_fit(variant_path, work / "lightning", "ddp-app", world_size)
        step_done("lightning fit")
        progress.stage(f"{optimizer}: reference")
        reference = reference_fit(variant_path, work / "reference", "mp.spawn", world_size)
        checks.append(
            state_check("P1", optimizer, f"Lightning DDP vs reference DDP, {world_size} ranks", reference, lightning)
        )
        step_done("reference mp.spawn")

        progress.stage(f"{optimizer}: single process")
        accumulated = single_process_fit(config, world_size, "accumulate")
        checks.append(
            state_check(
                "P2a",
                optimizer,
                f"DDP x{world_size} vs 1 process accumulating loss/{world_size}",
                lightning,
                accumulated,
            )
        )
        global_batch = single_process_fit(config, world_size, "global-batch")
        checks.append(
            state_check(
                "P2b",
                optimizer,
                f"DDP x{world_size} vs 1 process, {world_size}-fold batch",
                lightning,
                global_batch,
                1e-6,
            )
        )
        step_done("P2 single process")

        progress.stage(f"{optimizer}: evaluation")
        (last,) = (work / "lightning").rglob("last.ckpt")
        at_one = lightning_eval(variant_path, last, 1, work / "eval_1.json")
        at_n = lightning_eval(variant_path, last, world_size, work / f"eval_{world_size}.json")
        job = build_job(config)
        load_net_weights(job.net, lightning, str(last))
        truth = {"val_acc": plain_accuracy(job.net, job.val_dataset)}
        datamodule = instantiate(config["data"])
        datamodule.setup("test")
        truth["test_acc"] = plain_accuracy(job.net, datamodule.test_dataset)
        for metric, value in truth.items():
            diff = max(abs(at_one[metric] - value), abs(at_n[metric] - value))
            detail = (
                "" if diff == 0 else f"1 rank {at_one[metric]!r}, {world_size} ranks {at_n[metric]!r}, plain {value!r}"
            )
            checks.append(
                Check(
                    "P3",
                    optimizer,
                    f"{metric} at 1 and {world_size} ranks vs plain eval ({value:.5f})",
                    diff,
                    0.0,
                    diff == 0,
                    detail,
                )
            )
        step_done("P3 eval")

        if optimizer == interop_optimizer:
            progress.stage(f"{optimizer}: reference -> Lightning")
            checks.append(
                reference_continued_by_lightning(variant_path, work, optimizer, world_size, epochs, config, last)
            )
            progress.stage(f"{optimizer}: elastic resume")
            checks.append(elastic_check(variant_path, work, optimizer, world_size, job, reference))
            checks.append(
                reference_continued_by_lightning(
                    variant_path, work, optimizer, world_size, epochs, config, last, on_ranks=world_size + 1
                )
            )
        progress.stage(f"{optimizer}: export")
        exported = work / "model.pt"
        run_command(
            [sys.executable, "-m", "app.export", "--ckpt", str(last), "--out", str(exported)], work / "export.log"
        )
        plain_net = build_job(config).net
        plain_net.load_state_dict(torch.load(exported, weights_only=True))
        lightning_net = build_job(config).net
        lightning_net.load_state_dict(lightning)
        checks.append(
            state_check(
                "P4",
                optimizer,
                "exported model.pt (weights_only) vs Lightning ckpt: predictions",
                {"logits": predictions(lightning_net, job.val_dataset)},
                {"logits": predictions(plain_net, job.val_dataset)},
            )
        )
        step_done("P4 interop, export")

        progress.stage(f"{optimizer}: torchrun")
        lightning_torchrun = lightning_fit(variant_path, work / "lightning_torchrun", "torchrun", world_size)
        reference_torchrun = reference_fit(variant_path, work / "reference_torchrun", "torchrun", world_size)
        checks.append(
            state_check("P5", optimizer, "ddp-app launcher vs ddp-app under torchrun", lightning, lightning_torchrun)
        )
        checks.append(state_check("P5", optimizer, "reference: mp.spawn vs torchrun", reference, reference_torchrun))
        step_done("P5 torchrun")

        progress.stage(f"{optimizer}: accumulation")
        batches = batches_per_epoch(job, world_size)
        micro_batches = accumulation_with_tail(batches)
        accumulate_path = work / "config_accumulate.yaml"
        accumulate_config = copy.deepcopy(config)
        accumulate_config["trainer"]["accumulate_grad_batches"] = micro_batches
        accumulate_path.write_text(yaml.safe_dump(accumulate_config, sort_keys=False))
        lightning_accumulated = lightning_fit(accumulate_path, work / "lightning_accumulate", "ddp-app", world_size)
        reference_accumulated = reference_fit(accumulate_path, work / "reference_accumulate", "mp.spawn", world_size)
        check = state_check(
            "P6",
            optimizer,
            f"Lightning vs reference, accumulating {micro_batches} of {batches} batches/epoch",
            reference_accumulated,
            lightning_accumulated,
        )
        # Equal weights prove nothing if neither side accumulated: they must differ from P1's run.
        if all(torch.equal(lightning[key], lightning_accumulated[key]) for key in lightning):
            check.passed, check.detail = False, "the weights equal the run without accumulation: k had no effect"
        checks.append(check)
        step_done("P6 accumulation")

        if optimizer == interop_optimizer:
            for method in COMPRESSION_CHECKED:
                progress.stage(f"{optimizer}: compression {method}")
                checks.append(compression_check(config, method, work, optimizer, world_size, lightning))
        step_done("P7 compression")
    progress.finish()
    return checks, {step: round(value, 1) for step, value in progress.seconds.items()}


# P7's settings: PowerSGD compresses from step 5 on at rank 2 (digits' 256x64 and 10x256 matrices are both compressed),
# so most of a short run's steps go through it.
COMPRESSION_CHECKED = {
    "fp16": {"method": "fp16"},
    "bf16": {"method": "bf16"},
    "powersgd": {"method": "powersgd", "powersgd_rank": 2, "start_iter": 5},
}


def compression_check(
    config: dict[str, Any], method: str, work: Path, optimizer: str, world_size: int, uncompressed: dict
) -> Check:
    """P7: Lightning and the reference with the same communication hook end with the same weights."""
    compressed_config = copy.deepcopy(config)
    compressed_config["gradient_compression"] = COMPRESSION_CHECKED[method]
    path = work / f"config_{method}.yaml"
    path.write_text(yaml.safe_dump(compressed_config, sort_keys=False))
    lightning = lightning_fit(path, work / f"lightning_{method}", "ddp-app", world_size)
    reference = reference_fit(path, work / f"reference_{method}", "mp.spawn", world_size)
    check = state_check("P7", optimizer, f"Lightning vs reference, gradient_compression {method}", reference, lightning)
    if all(torch.equal(uncompressed[key], lightning[key]) for key in uncompressed):
        check.passed, check.detail = False, f"the weights equal the uncompressed run's: {method} had no effect"
    return check


def reference_continued_by_lightning(
    config_path: Path,
    work: Path,
    optimizer: str,
    world_size: int,
    epochs: int,
    config: dict[str, Any],
    last: Path,
    on_ranks: int | None = None,
) -> Check:
    """P4: the reference's last snapshot, one more epoch by Lightning and by the reference itself. P8 (`on_ranks`): the
    same on another number of ranks, where both continue the run elastically."""
    ranks = on_ranks or world_size
    name = "" if on_ranks is None else f"_on_{ranks}"
    snapshot_path = work / "reference" / "snapshot.pt"
    converted = work / f"reference_epoch{epochs}.ckpt"
    snapshot = safe_load(snapshot_path)
    module = instantiate(config["model"])
    torch.save(reference_to_lightning_checkpoint(snapshot, module, safe_load(last)), converted)
    continued = work / f"reference_continued{name}"
    continued.mkdir(parents=True, exist_ok=True)
    shutil.copy(snapshot_path, continued / "snapshot.pt")
    more_epochs = [f"--trainer.max_epochs={epochs + 1}", "--ckpt_path", str(converted), f"--trainer.devices={ranks}"]
    lightning = lightning_fit(config_path, work / f"lightning_continued{name}", "ddp-app", ranks, more_epochs)
    # torchrun, not mp.spawn: it starts the reference in about half the time here, and P5 shows the launcher does not
    # change a bit. On other ranks than the config's devices, mp.spawn --world-size.
    launcher = "torchrun" if on_ranks is None else "mp.spawn"
    reference = reference_fit(config_path, continued, launcher, ranks, ["--epochs", str(epochs + 1)])
    where = f" on {ranks} ranks" if on_ranks is not None else ""
    check = state_check(
        "P4" if on_ranks is None else "P8",
        optimizer,
        f"reference snapshot, epoch {epochs} +1{where}: Lightning from .ckpt vs reference",
        reference,
        lightning,
    )
    # Equal weights prove nothing if neither side trained on: they must differ from the snapshot's.
    if all(torch.equal(value, lightning[key]) for key, value in snapshot["MODEL_STATE"].items()):
        check.passed, check.detail = False, "the continued weights equal the snapshot's: nothing was trained"
    return check


# P8's tolerance: relative to the largest weight. Per-rank batches of different sizes sum the gradient in another order
# than the uninterrupted run, so equality holds up to fp32 rounding.
ELASTIC_TOLERANCE = 1e-5


def elastic_check(config_path: Path, work: Path, optimizer: str, world_size: int, job: Job, reference: dict) -> Check:
    """P8: Lightning stopped mid-epoch at `world_size` ranks and resumed on `world_size + 1` vs the reference's
    uninterrupted `world_size`-rank run (same global batch, same sample order)."""
    config = load_config(config_path)
    total = batches_per_epoch(job, world_size) * int(config["trainer"]["max_epochs"])
    root = work / "lightning_elastic"
    lightning_fit(config_path, root, "ddp-app", world_size, [f"--trainer.max_steps={total // 2 + 1}"])
    resumed = world_size + 1
    lightning = lightning_fit(
        config_path, root, "ddp-app", resumed, [f"--trainer.devices={resumed}", "--ckpt_path=last"]
    )
    scale = max(float(tensor.abs().max()) for tensor in reference.values() if tensor.is_floating_point())
    return state_check(
        "P8",
        optimizer,
        f"reference {world_size} ranks vs Lightning stopped at {world_size}, resumed on {resumed}",
        reference,
        lightning,
        ELASTIC_TOLERANCE * scale,
    )


# strategy: fsdp (P9a-e)

DDP_STRATEGY = {"class_path": "lightning.pytorch.strategies.DDPStrategy"}
RELATIVE_TOLERANCE = 1e-5  # of the model's largest weight, as P8 (app/parity.py ELASTIC_TOLERANCE)
ELASTIC_OPTIMIZER = {"class_path": "torch.optim.SGD", "init_args": {"lr": 0.5}}


def is_fsdp_config(config: dict[str, Any]) -> bool:
    """Whether the config trains with ddp-app's FSDP2 strategy (by class path or by name)."""
    return resolve_strategy((config.get("trainer") or {}).get("strategy")).is_sharded


def last_weights(last: Path) -> dict[str, torch.Tensor]:
    """The bare network's weights in a Lightning checkpoint, sharded (joined here) or whole."""
    if is_sharded_checkpoint(last):
        return {key.removeprefix("net."): value for key, value in load_full_tensors(last).items()}
    return net_state_dict(safe_load(last))


def relative_difference(expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor]) -> tuple[float, str]:
    """(the largest |difference| over the model's largest |weight|, as P8 measures; the first tensor beyond the
    tolerance, or "")."""
    if expected.keys() != actual.keys():
        return float("inf"), f"different tensor names, first: {sorted(set(expected) ^ set(actual))[0]}"
    scale = max(float(tensor.abs().max()) for tensor in expected.values()) or 1.0
    worst, first = 0.0, ""
    for name, tensor in expected.items():
        difference = float((actual[name].double() - tensor.double()).abs().max()) / scale
        if difference > RELATIVE_TOLERANCE and not first:
            first = f"{name}: {difference:.3e} of the largest weight"
        worst = max(worst, difference)
    return worst, first


def write_variant(config: dict[str, Any], path: Path, strategy: dict[str, Any] | None = None) -> Path:
    variant = yaml.safe_load(yaml.safe_dump(config))
    if strategy is not None:
        variant["trainer"]["strategy"] = strategy
    path.write_text(yaml.safe_dump(variant))
    return path


def fsdp_parity(config_path: Path, world_size: int, epochs: int, out_dir: Path) -> list[Any]:
    """P9a-e for an FSDP2 config; the `Check`s of app.parity."""
    config = yaml.safe_load(config_path.read_text())
    config.setdefault("trainer", {}).update({"devices": world_size, "max_epochs": epochs})
    out_dir.mkdir(parents=True, exist_ok=True)
    fsdp_config = write_variant(config, out_dir / "fsdp.yaml")
    ddp_config = write_variant(config, out_dir / "ddp.yaml", DDP_STRATEGY)
    optimizer = str(config["optimizer"]["class_path"]).rpartition(".")[2].lower()[:5]  # the table's column

    progress = Progress(fsdp_stage_plan(world_size))
    progress.stage("fsdp: Lightning FSDP2")
    lightning = lightning_fit(fsdp_config, out_dir / "lightning", "ddp-app", world_size)
    progress.stage("fsdp: the plain-PyTorch FSDP2 reference")
    reference_out = out_dir / "reference"
    reference_command = [sys.executable, "-m", "app.reference.fsdp", "--config", str(fsdp_config)]
    reference_command += ["--out", str(reference_out), "--world-size", str(world_size), "--save-every", "0"]
    run_command(reference_command, out_dir / "reference.log")
    reference = torch.load(reference_out / "final.pt", map_location="cpu", weights_only=True)
    compared = f"Lightning FSDP2 vs reference FSDP2, {world_size} ranks"
    checks = [state_check("P9a", optimizer, compared, reference, lightning)]

    progress.stage("fsdp: Lightning DDP")
    ddp = lightning_fit(ddp_config, out_dir / "ddp", "ddp-app", world_size)
    difference, detail = relative_difference(ddp, lightning)
    compared = f"FSDP2 vs DDP, {world_size} ranks"
    checks.append(Check("P9b", optimizer, compared, difference, RELATIVE_TOLERANCE, not detail, detail))

    # P9c trains with SGD: Adam divides each update by the root of the gradient's running square, so the rounding of
    # another summation order grows where gradients are tiny (on this config, 2 ranks resumed on 3: 1.2e-5 of the
    # largest weight under FSDP2, 9.8e-6 under DDP; docs/fsdp.md).
    progress.stage(f"fsdp: SGD, stopped on {world_size} ranks, resumed on {world_size + 1}")
    sgd_config = write_variant({**config, "optimizer": ELASTIC_OPTIMIZER}, out_dir / "fsdp-sgd.yaml")
    uninterrupted = lightning_fit(sgd_config, out_dir / "sgd", "ddp-app", world_size)
    steps = safe_load(out_dir / "sgd" / "checkpoints" / "last.ckpt" / META_NAME)["global_step"]
    elastic = out_dir / "elastic"
    lightning_fit(sgd_config, elastic, "ddp-app", world_size, [f"--trainer.max_steps={max(1, steps // 2 - 1)}"])
    resumed = lightning_fit(
        sgd_config, elastic, "ddp-app", world_size + 1, [f"--trainer.devices={world_size + 1}", "--ckpt_path=last"]
    )
    difference, detail = relative_difference(uninterrupted, resumed)
    compared = f"FSDP2 stopped on {world_size} ranks, resumed on {world_size + 1}, vs uninterrupted"
    checks.append(Check("P9c", "sgd", compared, difference, RELATIVE_TOLERANCE, not detail, detail))

    size = hybrid_group_size(world_size)
    strategy = {**config["trainer"]["strategy"]} if isinstance(config["trainer"].get("strategy"), dict) else {}
    strategy = {"class_path": FSDP_CLASS_PATH, **strategy}
    strategy["init_args"] = {**(strategy.get("init_args") or {}), "shard_group_size": size}
    hybrid_config = write_variant(config, out_dir / "hybrid.yaml", strategy)
    progress.stage(f"fsdp: Lightning hybrid sharding, shard_group_size {size}")
    hybrid = lightning_fit(hybrid_config, out_dir / "hybrid", "ddp-app", world_size)
    progress.stage(f"fsdp: the reference's hybrid sharding, shard_group_size {size}")
    hybrid_out = out_dir / "reference-hybrid"
    hybrid_command = [sys.executable, "-m", "app.reference.fsdp", "--config", str(hybrid_config)]
    hybrid_command += ["--out", str(hybrid_out), "--world-size", str(world_size), "--save-every", "0"]
    run_command(hybrid_command, out_dir / "reference-hybrid.log")
    reference_hybrid = torch.load(hybrid_out / "final.pt", map_location="cpu", weights_only=True)
    layout = mesh_layout(size, world_size, world_size).describe()
    checks.append(state_check("P9d", optimizer, f"hybrid {layout}: Lightning vs reference", reference_hybrid, hybrid))
    difference, detail = relative_difference(lightning, hybrid)
    compared = f"hybrid {layout} vs full sharding, {world_size} ranks"
    checks.append(Check("P9e", optimizer, compared, difference, RELATIVE_TOLERANCE, not detail, detail))
    progress.finish()
    return checks


# P10b's DiLoCo that is DDP with SGD: an outer step after every inner step, applied at face value.
DILOCO_AS_DDP = {"sync_every": 1, "outer_lr": 1.0, "outer_momentum": 0.0, "fragments": 1}
DILOCO_TOLERANCE = 1e-6  # of the model's largest weight: P10b's rounding (docs/parity.md)


def is_diloco_config(config: dict[str, Any]) -> bool:
    return resolve_strategy((config.get("trainer") or {}).get("strategy")).kind is StrategyKind.DILOCO


def diloco_parity(config_path: Path, world_size: int, epochs: int, out_dir: Path) -> list[Check]:
    """P10a-b for a `strategy: diloco` config (app/parallel/diloco.py): four launches."""
    config = yaml.safe_load(config_path.read_text())
    config.setdefault("trainer", {}).update({"devices": world_size, "max_epochs": epochs, "accelerator": "cpu"})
    out_dir.mkdir(parents=True, exist_ok=True)
    strategy = config["trainer"]["strategy"]
    own = {} if isinstance(strategy, str) else dict(strategy.get("init_args") or {})
    diloco = {"class_path": DILOCO_CLASS_PATH, "init_args": own}
    optimizer = str(config["optimizer"]["class_path"]).rpartition(".")[2].lower()[:5]
    checks = []
    progress = Progress(["diloco: Lightning", "diloco: reference", "diloco as DDP: Lightning", "DDP: reference"])
    own_config = write_variant(config, out_dir / "diloco.yaml", diloco)
    progress.stage("diloco: Lightning")
    lightning = lightning_fit(own_config, out_dir / "lightning", "ddp-app", world_size)
    progress.stage("diloco: reference")
    reference = reference_fit(own_config, out_dir / "reference", "mp.spawn", world_size)
    settings = ", ".join(f"{key} {value}" for key, value in own.items()) or "defaults"
    compared = f"Lightning DiLoCo vs reference DiLoCo ({settings}), {world_size} ranks"
    checks.append(state_check("P10a", optimizer, compared, reference, lightning))
    # P10b: with an outer step after every inner SGD step, outer lr 1 and no momentum, every replica ends
    # each step at anchor - mean(anchor - replica): DDP's step, but the mean is taken of the parameter
    # changes (lr x gradient, each rounded) instead of the gradients.
    sgd = {**config, "optimizer": OPTIMIZERS["sgd"]}
    as_ddp_strategy = {"class_path": DILOCO_CLASS_PATH, "init_args": DILOCO_AS_DDP}
    as_ddp = write_variant(sgd, out_dir / "diloco-as-ddp.yaml", as_ddp_strategy)
    progress.stage("diloco as DDP: Lightning")
    lightning = lightning_fit(as_ddp, out_dir / "lightning-as-ddp", "ddp-app", world_size)
    progress.stage("DDP: reference")
    ddp = reference_fit(write_variant(sgd, out_dir / "ddp.yaml", DDP_STRATEGY), out_dir / "ddp", "mp.spawn", world_size)
    difference, detail = relative_difference(ddp, lightning)
    compared = f"DiLoCo (H 1, outer SGD lr 1, no momentum) vs DDP, SGD, {world_size} ranks"
    checks.append(Check("P10b", "sgd", compared, difference, DILOCO_TOLERANCE, difference <= DILOCO_TOLERANCE, detail))
    progress.finish()
    return checks


def print_table(checks: list[Check]) -> None:
    header = f"{'check':<5} {'optim':<5} {'compared':<66} {'max |diff|':>11} {'tolerance':>9}  result"
    print(header)
    print("-" * len(header))
    for check in checks:
        result = "PASS" if check.passed else "FAIL"
        print(
            f"{check.name:<5} {check.optimizer:<5} {check.compared:<66} "
            f"{check.max_abs_diff:>11.3e} {check.tolerance:>9.0e}  {result}"
        )
        if check.detail and not check.passed:
            print(f"      {check.detail}")


def fresh_out_suggestion(out: Path) -> Path:
    """The first of `<out>-2`, `<out>-3`, ... that does not exist or is empty: a directory to name in the fix."""
    number = 2
    while (candidate := out.with_name(f"{out.name}-{number}")).exists() and any(candidate.iterdir()):
        number += 1
    return candidate


def check_fresh_out(out: Path) -> None:
    """Refuse, before the first launch, an `--out` that already holds files: ddp-app refuses to fit over a run (it would
    stop at the first fit), and the previous run's files are the user's."""
    if not out.exists():
        return
    if not out.is_dir():
        raise UserFacingError(f"--out {out} is a file, not a directory. Fix: --out a new directory.")
    held = sorted(entry.name for entry in out.iterdir())
    if held:
        shown = ", ".join(held[:4]) + (", ..." if len(held) > 4 else "")
        raise UserFacingError(
            f"{out} already holds a parity run ({shown}); each run trains fresh in its own directory and "
            f"writes over no earlier run. Fix: --out {fresh_out_suggestion(out)} (a new directory), or remove {out}."
        )


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["eval-worker"]:
        worker = argparse.ArgumentParser(prog="python -m app.parity eval-worker")
        for flag in ("--config", "--ckpt", "--json"):
            worker.add_argument(flag, required=True)
        worker.add_argument("--devices", type=int, required=True)
        args = worker.parse_args(argv[1:])
        eval_worker(args.config, args.ckpt, args.devices, args.json)
        return
    parser = argparse.ArgumentParser(
        prog="python -m app.parity", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", required=True, type=Path, help="the ddp-app config to train both ways")
    parser.add_argument("--world-size", type=int, default=2, help="ranks of the DDP runs (default: 2)")
    parser.add_argument("--epochs", type=int, default=3, help="epochs of each run (default: 3)")
    parser.add_argument("--optimizers", default="sgd,adam", help="comma-separated subset of: sgd, adam")
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("runs/parity"),
        help="a new or empty directory for every run's files and parity.json (default: runs/parity); one that "
        "holds an earlier parity run is refused: give each run its own",
    )
    parser.add_argument("--json", type=Path, default=None, help="default: <out>/parity.json")
    args = parser.parse_args(argv)
    optimizers = [name.strip() for name in args.optimizers.split(",") if name.strip()]
    unknown = [name for name in optimizers if name not in OPTIMIZERS]
    if unknown or not optimizers:
        parser.error(f"unknown optimizer(s) {unknown}; choose from {sorted(OPTIMIZERS)}")
    if not args.config.is_file():
        parser.error(f"config {args.config} does not exist")
    try:
        check_fresh_out(args.out)
    except UserFacingError as error:
        print(f"app.parity: error: {error}", file=sys.stderr)
        raise SystemExit(BAD_INPUT_EXIT_CODE) from None
    started = time.perf_counter()
    if is_diloco_config(load_config(args.config)):  # strategy diloco: its own rows (P10a-b)
        print(f"parity (diloco): {args.config}, {args.world_size} ranks, {args.epochs} epochs: P10a-b", flush=True)
        checks, step_seconds = diloco_parity(args.config, args.world_size, args.epochs, args.out), {}
    elif is_fsdp_config(load_config(args.config)):  # strategy fsdp: its own rows (P9a-e, below)
        print(f"parity (fsdp): {args.config}, {args.world_size} ranks, {args.epochs} epochs: P9a-e", flush=True)
        checks, step_seconds = fsdp_parity(args.config, args.world_size, args.epochs, args.out), {}
    else:
        print(start_line(args.config, args.world_size, args.epochs, optimizers), flush=True)
        checks, step_seconds = run_parity(args.config, args.world_size, args.epochs, args.out, optimizers)
    print_table(checks)
    json_path = args.json or args.out / "parity.json"
    json_path.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "config": str(args.config),
        "world_size": args.world_size,
        "epochs": args.epochs,
        "seconds": round(time.perf_counter() - started, 1),
        "step_seconds": step_seconds,
        "passed": all(c.passed for c in checks),
        "checks": [asdict(check) for check in checks],
    }
    json_path.write_text(json.dumps(report, indent=2))
    print(f"\n{sum(c.passed for c in checks)}/{len(checks)} checks passed in {report['seconds']} s; JSON: {json_path}")
    raise SystemExit(0 if report["passed"] else 1)


if __name__ == "__main__":
    main()
