"""`python -m app.bench.floor [--config configs/digits.yaml] [--repeats 5] [--json F]`: Lightning's own cost per step.

The cost of Lightning's training loop itself on this machine: one process, one thread, no DDP, the same prebuilt
batches, the config's network, loss and optimizer. Each repeat runs, in turn:

  plain              the tutorials' loop: zero_grad, forward, loss, backward, optimizer step
  lightning          a bare `Trainer` (no logger, checkpointing, progress bar, model summary or
                     sanity check) fitting a module with only `training_step` and `configure_optimizers`
  + NoProfiler       the same with ddp-app's `NoProfiler` instead of Lightning's default "no profiler"
  + N callbacks      the same plus N callbacks that override no hook (every hook is called anyway)
  ddp-app            the Trainer and module `ddp-app fit --config ...` builds, on the same batches, with
                     the bare side's choices (`SAME_CHOICES_AS_BARE`; validation off)
  ddp-app as configured   the same with the config's own choices

and reports each side's time per step (median over epochs of the epoch's mean, first epoch left out) and each Lightning
side minus plain, paired within a repeat: median [min, max] over repeats. "lightning" is the floor under `python -m
app.bench`'s "lightning added"; "ddp-app's own cost" (ddp-app minus + NoProfiler) is what ddp-app adds per step.
last.ckpt's epoch-end save is outside the clock.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import io
import json
import logging
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch
import yaml
from torch.utils.data import DataLoader

from app.bench.report import bench_parser, spread
from app.cli import DDPAppCLI, NoProfiler
from app.cli.entry import allow_plain_cuda_availability_checks
from app.cluster.threads import configure_cpu_threads
from app.reference.config import instantiate

NOOP_CALLBACKS = 10


def config_parts(config: dict[str, Any], batches: int) -> tuple[torch.nn.Module, torch.nn.Module, dict, list]:
    """(network, loss, optimizer entry, training batches) from a ddp-app config whose model is one of app.models (its
    `net` and `criterion`) and whose data is one of app.data (its `train_dataset` and `batch_size`): the first `batches`
    batches of the training split, in order."""
    model = instantiate(config["model"])
    data = instantiate(config["data"])
    data.setup("fit")
    loader = DataLoader(data.train_dataset, batch_size=data.batch_size, shuffle=False, drop_last=True)
    batches_list = []
    for batch in loader:
        batches_list.append(batch)
        if len(batches_list) == batches:
            break
    return model.net, model.criterion, config["optimizer"], batches_list


@dataclasses.dataclass
class Batches:
    """The batches as one iterable with a length (Lightning reads a plain list as a list of loaders)."""

    batches: list

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Any:
        return iter(self.batches)


class BareModule(L.LightningModule):
    """What a user writes first: the step and the optimizer, nothing else."""

    def __init__(self, net: torch.nn.Module, criterion: torch.nn.Module, optimizer: dict) -> None:
        super().__init__()
        self.net = net
        self.criterion = criterion
        self.optimizer = optimizer

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        return self.criterion(self.net(inputs), targets)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return instantiate(self.optimizer, self.parameters())


class StepClock(L.Callback):
    """Each epoch's mean step time, from the first step's start to the epoch's end."""

    def __init__(self) -> None:
        self.epoch_ms: list[float] = []
        self._started = 0.0
        self._steps = 0

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._steps = 0

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._steps == 0:
            self._started = time.perf_counter()
        self._steps += 1

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.epoch_ms.append((time.perf_counter() - self._started) / self._steps * 1e3)


def plain_ms(
    net: torch.nn.Module, criterion: torch.nn.Module, optimizer: dict, batches: list, epochs: int
) -> list[float]:
    net = copy.deepcopy(net)
    opt = instantiate(optimizer, net.parameters())
    epoch_ms = []
    for _ in range(epochs):
        started = time.perf_counter()
        for inputs, targets in batches:
            opt.zero_grad()
            criterion(net(inputs), targets).backward()
            opt.step()
        epoch_ms.append((time.perf_counter() - started) / len(batches) * 1e3)
    return epoch_ms


def lightning_ms(
    net: torch.nn.Module, criterion: torch.nn.Module, optimizer: dict, batches: list, epochs: int, **options: Any
) -> list[float]:
    clock = StepClock()
    idle = [L.Callback() for _ in range(options.get("callbacks", 0))]
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_epochs=epochs, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        profiler=options.get("profiler"), callbacks=[clock, *idle],
    )  # fmt: skip
    trainer.fit(BareModule(copy.deepcopy(net), criterion, optimizer), train_dataloaders=Batches(batches))
    return clock.epoch_ms


# What a config chooses beside the model, priced by Lightning and PyTorch the same with or without ddp-app: the
# `ddp-app` side runs with the bare side's choices, so that its difference is what ddp-app itself adds; `ddp-app as
# configured` runs with the config's own.
SAME_CHOICES_AS_BARE = (
    "--trainer.strategy=auto",  # one device, no DDP wrapper (whose cost over one process is not ddp-app's)
    "--trainer.deterministic=false",
    "--lr_scheduler=null",
    "--trainer.callbacks=[]",  # the config's own callbacks (a ModelCheckpoint)
    "--trainer.log_every_n_steps=50",  # Lightning's default cadence
)


def ddp_app_ms(config: Path, batches: list, epochs: int, overrides: tuple[str, ...] = ()) -> list[float]:
    """The Trainer and module `ddp-app fit --config config` builds, fitted on `batches` in this process (validation and
    the sanity check off, as on the bare side; loggers, progress line and every callback of ddp-app's on)."""
    clock = StepClock()
    with tempfile.TemporaryDirectory() as root, contextlib.redirect_stdout(io.StringIO()):
        cli = DDPAppCLI(
            args=[
                "--config", str(config), "--trainer.devices=1", "--trainer.num_nodes=1",
                f"--trainer.max_epochs={epochs}", f"--trainer.default_root_dir={root}",
                "--trainer.limit_val_batches=0", "--trainer.num_sanity_val_steps=0",
                "--trainer.enable_model_summary=false", *overrides,
            ],
            run=False,
        )  # fmt: skip
        cli.trainer.callbacks.insert(0, clock)
        cli.trainer.fit(cli.model, train_dataloaders=Batches(batches))
    return clock.epoch_ms


SIDES = ("plain", "lightning", "+ NoProfiler", f"+ {NOOP_CALLBACKS} callbacks", "ddp-app", "ddp-app as configured")


def run_side(side: str, parts: tuple, epochs: int, config: Path) -> float:
    """The median over epochs (the first left out) of the epoch's mean step time, ms."""
    if side == "ddp-app":
        epoch_ms = ddp_app_ms(config, parts[3], epochs, SAME_CHOICES_AS_BARE)
    elif side == "ddp-app as configured":
        epoch_ms = ddp_app_ms(config, parts[3], epochs)
    elif side == "plain":
        epoch_ms = plain_ms(*parts, epochs)
    elif side == "lightning":
        epoch_ms = lightning_ms(*parts, epochs)
    elif side == "+ NoProfiler":
        epoch_ms = lightning_ms(*parts, epochs, profiler=NoProfiler())
    else:
        epoch_ms = lightning_ms(*parts, epochs, profiler=NoProfiler(), callbacks=NOOP_CALLBACKS)
    return statistics.median(epoch_ms[1:])


def main(argv: list[str] | None = None) -> None:
    parser = bench_parser(
        "python -m app.bench.floor", __doc__, "configs/digits.yaml", "model from app.models, data from app.data"
    )
    parser.add_argument("--batches", type=int, default=37, help="training batches per epoch")
    parser.add_argument("--epochs", type=int, default=8, help="epochs per side and repeat (the first is left out)")
    parser.add_argument("--repeats", type=int, default=5, help="rounds of all sides, the order rotating")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args(argv)
    configure_cpu_threads()
    allow_plain_cuda_availability_checks(os.environ)  # as every ddp-app rank does (app/cli/entry.py)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module="lightning")
    parts = config_parts(yaml.safe_load(args.config.read_text()), args.batches)
    ms: dict[str, list[float]] = {side: [] for side in SIDES}
    for repeat in range(args.repeats):
        order = SIDES[repeat % len(SIDES) :] + SIDES[: repeat % len(SIDES)]  # no side always runs first
        for side in order:
            ms[side].append(run_side(side, parts, args.epochs, args.config))
        done = ", ".join(f"{side} {ms[side][-1]:.3f}" for side in SIDES)
        print(f"repeat {repeat + 1}/{args.repeats}, ms/step: {done}", file=sys.stderr)
    added = {side: [ms[side][r] - ms["plain"][r] for r in range(args.repeats)] for side in SIDES[1:]}
    per_callback_us = [(ms[SIDES[3]][r] - ms["+ NoProfiler"][r]) / NOOP_CALLBACKS * 1e3 for r in range(args.repeats)]
    print(f"{args.config}: {len(parts[3])} batches of {len(parts[3][0][0])}, {args.repeats} repeats, 1 CPU thread")
    print(f"{'':<24}{'ms/step':>10}{'added ms (paired) median [min, max]':>40}")
    for side in SIDES:
        line = f"{side:<24}{statistics.median(ms[side]):>10.3f}"
        if side in added:
            s = spread(added[side])
            line += f"{s['median']:>+19.3f} [{s['min']:+.3f}, {s['max']:+.3f}]"
        print(line)
    s = spread(per_callback_us)
    print(f"one callback that overrides no hook: {s['median']:.1f} us per step [{s['min']:.1f}, {s['max']:.1f}]")
    own = spread([ms["ddp-app"][r] - ms["+ NoProfiler"][r] for r in range(args.repeats)])
    between = f"[{own['min']:+.3f}, {own['max']:+.3f}]"
    print(f"ddp-app's own cost over a bare Trainer (the same choices): {own['median']:+.3f} ms per step {between}")
    if args.json is not None:
        command = " ".join(["python -m app.bench.floor", *(argv if argv is not None else sys.argv[1:])])
        result = {
            "command": command,
            "torch": torch.__version__,
            "lightning": L.__version__,
            "ms_per_step": {side: spread(ms[side]) for side in SIDES},
            "added_ms_per_step": {side: spread(values) for side, values in added.items()},
            "noop_callback_us_per_step": s,
            "ddp_app_own_ms_per_step": own,
            "same_choices_as_bare": list(SAME_CHOICES_AS_BARE),
        }
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
