"""`strategy: diloco`: DiLoCo (Douillard et al., arXiv 2311.08105), data parallel training that talks
only every `sync_every` optimizer steps, for ranks behind a slow link (docs/diloco.md).

    trainer:
      strategy:
        class_path: app.parallel.diloco.DiLoCoStrategy
        init_args: {sync_every: 10, outer_lr: 0.7, outer_momentum: 0.9, fragments: 1, outer_dtype: float32}

(`strategy: diloco`, or `--trainer.strategy diloco --trainer.strategy.init_args.sync_every 10`.)
Every rank trains its own replica with the config's optimizer (the inner steps: no collective, no
DDP wrapper, the data sharded by the same DistributedSampler as under `ddp`). After every H-th inner
step (H = `sync_every`) each rank computes the outer gradient, the parameters at the last outer step
(the anchor) minus its own, all-reduces its mean (in `outer_dtype`), and the outer optimizer (SGD,
Nesterov momentum by default, the paper's lr 0.7 and momentum 0.9) steps the anchor; every replica
then continues from the new anchor. Buffers (BatchNorm statistics) are rank 0's after every outer
step, as DDP's `broadcast_buffers` makes them before every forward.

Streaming DiLoCo (arXiv 2501.18512), `fragments: F`: the model's blocks (its `nn.ModuleList` layers,
or else its layers with parameters) are cut into F fragments of as many blocks each
(app/parallel/fragments.py; F must divide their number, and H); fragment f has its outer step at
inner steps where `step % H == (f + 1) * H / F % H`, so every fragment syncs every H steps and some fragment every
H / F steps, each all-reduce 1/F of the model. The sync runs in line, not overlapped with compute.

Written here, not taken from torchft: torchft's `DiLoCo` needs its `Manager`, a lighthouse server and
its own process groups for fault tolerance, and keeps the outer state where Lightning's checkpoint does
not see it; this is the algorithm alone, about 200 lines on `torch.distributed`, with its state in
ddp-app's checkpoint (the `diloco` part, app/checkpoints/state.py).

Exact resume: between two outer steps every rank's parameters and inner optimizer state differ, so a
checkpoint keeps every rank's (gathered on rank 0, as the random state is), the anchor, the outer
momentum (per parameter name, so a resume may change `fragments`) and the inner step count. A resume on
the same number of ranks restores each rank's own; on another number every rank continues from the
mean of the saved replicas with rank 0's inner optimizer state (`_restore`).
"""

from __future__ import annotations

import importlib
import inspect
import sys
import time
from datetime import timedelta
from typing import Any, Literal

import lightning as L
import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning_utilities.core.apply_func import apply_to_collection
from torch import nn

from app.checkpoints import state as checkpoint_state
from app.checkpoints.io import gather_per_rank
from app.errors import InvalidConfigError
from app.parallel.fragments import blocks, fragment_indices, trainable

OuterDtype = Literal["float32", "bfloat16"]
OUTER_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
CLASS_PATH = "app.parallel.diloco.DiLoCoStrategy"


def check_settings(sync_every: Any, fragments: Any, outer_lr: Any, outer_momentum: Any, outer_dtype: Any) -> None:
    """Refuse, in one line naming the key, what DiLoCo cannot run (the config checks call it before any
    rank starts; the strategy again when it is built in Python)."""
    key = "trainer.strategy.init_args"
    meanings = {"sync_every": ("inner optimizer steps between outer steps", 10), "fragments": ("model parts", 1)}
    for name, value in (("sync_every", sync_every), ("fragments", fragments)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            meaning, example = meanings[name]
            raise InvalidConfigError(
                f"{key}.{name}={value!r}: it must be a whole number >= 1 ({meaning}). "
                f"Fix: e.g. --{key}.{name} {example}."
            )
    if sync_every % fragments:
        raise InvalidConfigError(
            f"{key}.fragments={fragments} does not divide {key}.sync_every={sync_every}: each fragment syncs every "
            f"sync_every steps, one every sync_every / fragments. Fix: a sync_every that is a multiple of {fragments}."
        )
    if not isinstance(outer_lr, (int, float)) or isinstance(outer_lr, bool) or outer_lr <= 0:
        raise InvalidConfigError(f"{key}.outer_lr={outer_lr!r}: it must be > 0. Fix: e.g. 0.7 (the paper's).")
    if not isinstance(outer_momentum, (int, float)) or not 0 <= outer_momentum < 1:
        raise InvalidConfigError(f"{key}.outer_momentum={outer_momentum!r}: it must be in [0, 1). Fix: e.g. 0.9.")
    if outer_dtype not in OUTER_DTYPES:
        raise InvalidConfigError(f"{key}.outer_dtype={outer_dtype!r}. Fix: one of {', '.join(OUTER_DTYPES)}.")


def checked_fragments(module: nn.Module, fragments: int) -> list[list[int]]:
    """`fragment_indices`, or the one line naming the key when `fragments` does not divide the blocks."""
    try:
        return fragment_indices(module, fragments)
    except ValueError:
        count = len(blocks(module))
        divisors = [d for d in range(1, count + 1) if count % d == 0] or [1]
        raise InvalidConfigError(
            f"trainer.strategy.init_args.fragments={fragments} does not divide the {count} blocks of "
            f"{type(module).__name__} (its nn.ModuleList layers, or else its layers with parameters: "
            f"docs/diloco.md). Fix: one of {', '.join(map(str, divisors))}."
        ) from None


def fragments_due(step: int, sync_every: int, fragments: int) -> list[int]:
    """The fragments whose outer step follows inner step `step` (counted from 1)."""
    every = sync_every // fragments
    return [f for f in range(fragments) if step % sync_every == ((f + 1) * every) % sync_every]


@torch.no_grad()
def broadcast_in_place(tensor: torch.Tensor) -> None:
    """Rank 0's values into `tensor` on every rank (through a contiguous copy where it is not: a
    channels_last weight, which gloo refuses)."""
    if tensor.is_contiguous():
        dist.broadcast(tensor, src=0)
        return
    copy = tensor.contiguous()
    dist.broadcast(copy, src=0)
    tensor.copy_(copy)


class DiLoCoStrategy(DDPStrategy):
    """Lightning's DDPStrategy without DDP's per-step gradient all-reduce: inner steps are local and an
    outer step every `sync_every` optimizer steps averages the replicas (module docstring).

    Args:
        sync_every: H, the inner optimizer steps between two outer steps (of each fragment).
        outer_lr: the outer SGD's learning rate (1 with no momentum: the replicas' mean, as is).
        outer_momentum: the outer SGD's momentum.
        outer_nesterov: Nesterov momentum (only with outer_momentum > 0).
        fragments: streaming DiLoCo's F: the model synced in F parts, one every H / F steps.
        outer_dtype: the dtype the outer gradients are all-reduced in (bfloat16: half the bytes).
        process_group_backend, timeout: as for Lightning's strategies.
    """

    def __init__(
        self,
        sync_every: int = 10,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        outer_nesterov: bool = True,
        fragments: int = 1,
        outer_dtype: OuterDtype = "float32",
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ) -> None:
        check_settings(sync_every, fragments, outer_lr, outer_momentum, outer_dtype)
        super().__init__(process_group_backend=process_group_backend, timeout=timeout)
        self.sync_every, self.fragments = sync_every, fragments
        self.outer_lr, self.outer_momentum, self.outer_nesterov = outer_lr, outer_momentum, outer_nesterov
        self.outer_dtype = outer_dtype
        self.inner_steps = 0  # optimizer steps since the run began (saved: the outer steps' schedule)
        self._names: list[str] = []
        self._parameters: list[nn.Parameter] = []
        self._anchors: list[torch.Tensor] = []  # float32, the parameters at the last outer step
        self._outer: list[torch.optim.SGD] = []  # one per fragment
        self._fragments: list[list[int]] = []  # each fragment's indices into _parameters
        # For app/run/step_timing.py (`ddp-app diagnose`): the seconds spent in the outer steps'
        # collectives since it last asked, and its `no_communication` ablation (each rank then applies
        # its own outer gradient: the step without any exchange).
        self.communication_s = 0.0
        self.communicate = True

    def configure_ddp(self) -> None:
        """No DDP wrapper (its backward would all-reduce every step): every replica starts from rank 0's
        weights and buffers, the anchor is taken, the outer optimizers built."""
        module = self.model
        assert isinstance(module, nn.Module)
        if self.world_size > 1:
            for tensor in module.state_dict().values():
                broadcast_in_place(tensor)
        named = trainable(module)
        self._fragments = checked_fragments(module, self.fragments)
        self._names = [name for name, _ in named]
        self._parameters = [parameter for _, parameter in named]
        self._anchors = [parameter.detach().float().clone() for parameter in self._parameters]
        nesterov = self.outer_nesterov and self.outer_momentum > 0
        self._outer = [
            torch.optim.SGD(
                [self._anchors[i] for i in part], lr=self.outer_lr, momentum=self.outer_momentum, nesterov=nesterov
            )
            for part in self._fragments
        ]
        self.inner_steps = 0

    def setup(self, trainer: L.Trainer) -> None:
        super().setup(trainer)
        if trainer.state.fn == TrainerFn.FITTING and not self._anchors:
            # DDPStrategy.setup calls configure_ddp when fitting (Lightning 2.6): without it the replicas
            # would train apart, never synced, and nothing would say so.
            raise RuntimeError("ddp-app bug: DDPStrategy.setup did not call configure_ddp; diloco has no anchor")

    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        """The inner step (the config's optimizer, local), then the outer steps due after it."""
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self._anchors:
            self.inner_steps += 1
            for fragment in fragments_due(self.inner_steps, self.sync_every, self.fragments):
                self.outer_step(fragment)
        return output

    @torch.no_grad()
    def outer_step(self, fragment: int) -> None:
        """Average the replicas' outer gradients of one fragment, step its anchor, restart from it.
        Every rank makes the same collectives in the same order (one all-reduce, then the buffers')."""
        part = self._fragments[fragment]
        anchors, parameters = [self._anchors[i] for i in part], [self._parameters[i] for i in part]
        flat = torch.cat([(a - p.float()).reshape(-1) for a, p in zip(anchors, parameters, strict=True)])
        flat = flat.to(OUTER_DTYPES[self.outer_dtype])
        exchanges = self.world_size > 1 and self.communicate
        if exchanges:
            started = time.perf_counter()
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
            flat.div_(self.world_size)
            self._waited(started, flat)
        offset = 0
        for anchor in anchors:
            anchor.grad = flat[offset : offset + anchor.numel()].view_as(anchor).float()
            offset += anchor.numel()
        self._outer[fragment].step()
        for anchor, parameter in zip(anchors, parameters, strict=True):
            anchor.grad = None
            parameter.copy_(anchor)
        buffers = list(self.model.buffers()) if exchanges else []
        if buffers:
            started = time.perf_counter()
            for buffer in buffers:
                broadcast_in_place(buffer)
            self._waited(started, buffers[-1])

    def _waited(self, started: float, result: torch.Tensor) -> None:
        """Count a collective's time (on a GPU waited for here, once per outer step: on the host's clock
        it would end when it is queued)."""
        if result.is_cuda:
            torch.cuda.current_stream().synchronize()
        self.communication_s += time.perf_counter() - started

    # ----- checkpoints: the `diloco` part (kept by `DiLoCoCheckpoint`, restored here) -----

    def checkpoint_part(self, trainer: L.Trainer) -> dict[str, Any]:
        """What a checkpoint keeps of DiLoCo; a collective (every rank's replica, gathered on rank 0)."""
        to_host = lambda tensor: tensor.detach().to("cpu", copy=True)  # noqa: E731
        replica = {
            "parameters": {name: to_host(p) for name, p in zip(self._names, self._parameters, strict=True)},
            "optimizers": apply_to_collection([o.state_dict() for o in trainer.optimizers], torch.Tensor, to_host),
        }
        momentum = {}
        for outer in self._outer:
            for anchor in outer.param_groups[0]["params"]:
                buffer = outer.state.get(anchor, {}).get("momentum_buffer")
                if buffer is not None:
                    momentum[self._names[self._index(anchor)]] = to_host(buffer)
        return {
            "inner_steps": self.inner_steps,
            "sync_every": self.sync_every,
            "anchor": {name: to_host(anchor) for name, anchor in zip(self._names, self._anchors, strict=True)},
            "outer_momentum": momentum,
            "per_rank": gather_per_rank(replica),
        }

    def _index(self, anchor: torch.Tensor) -> int:
        return next(i for i, own in enumerate(self._anchors) if own is anchor)

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        super().load_optimizer_state_dict(checkpoint)  # rank 0's inner state, on every rank
        saved = checkpoint_state.get(checkpoint, "diloco")
        if saved is not None and self._anchors:
            self._restore(saved)

    @torch.no_grad()
    def _restore(self, saved: dict[str, Any]) -> None:
        self.inner_steps = int(saved["inner_steps"])
        for name, anchor in zip(self._names, self._anchors, strict=True):
            anchor.copy_(saved["anchor"][name])
        for outer in self._outer:
            for anchor in outer.param_groups[0]["params"]:
                buffer = saved["outer_momentum"].get(self._names[self._index(anchor)])
                if buffer is not None:
                    outer.state[anchor]["momentum_buffer"] = buffer.to(anchor.device, copy=True)
        replicas = saved["per_rank"]
        if len(replicas) == self.world_size:  # each rank continues its own replica, exactly
            own = replicas[self.global_rank]
            for name, parameter in zip(self._names, self._parameters, strict=True):
                parameter.copy_(own["parameters"][name])
            for optimizer, state in zip(self.optimizers, own["optimizers"], strict=True):
                optimizer.load_state_dict(state)  # torch moves the state onto its parameters' device
            return
        # Another number of ranks: the replicas cannot be handed out one each. Every rank continues
        # from their mean (what the next outer all-reduce would average) with rank 0's inner state.
        for name, parameter in zip(self._names, self._parameters, strict=True):
            mean = torch.stack([replica["parameters"][name].double() for replica in replicas]).mean(0)
            parameter.copy_(mean)
        if self.global_rank == 0:
            print(
                f"ddp-app: diloco: the checkpoint holds {len(replicas)} replicas and this run has "
                f"{self.world_size} ranks: every rank continues from their mean, with rank 0's inner optimizer "
                f"state; the outer steps keep their schedule (inner step {self.inner_steps} now).",
                file=sys.stderr,
                flush=True,
            )


class DiLoCoCheckpoint(L.Callback):
    """Puts strategy diloco's state into every checkpoint (the `diloco` part), on every rank: the
    strategy has no hook in Lightning's checkpoint building, a callback has. app/run/build.py installs
    it for a plan whose strategy is diloco."""

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        strategy = trainer.strategy
        if isinstance(strategy, DiLoCoStrategy) and strategy._anchors:
            checkpoint_state.put(checkpoint, "diloco", strategy.checkpoint_part(trainer))


def check_config(config: Any) -> None:
    """strategy diloco's settings, and what it cannot honour, refused in one line before any rank starts
    (app/run/config_checks.py calls it for a plan whose strategy is diloco)."""
    trainer = config["trainer"]
    strategy = trainer.get("strategy")
    given = getattr(strategy, "init_args", None) or (strategy.get("init_args") if isinstance(strategy, dict) else None)
    parameters = inspect.signature(DiLoCoStrategy).parameters
    settings = {name: parameter.default for name, parameter in parameters.items()}
    for name in settings:
        value = given.get(name) if given is not None else None
        if value is not None:
            settings[name] = value
    names = ("sync_every", "fragments", "outer_lr", "outer_momentum", "outer_dtype")
    check_settings(*(settings[name] for name in names))
    method = (config.get("gradient_compression") or {}).get("method", "none")
    refused = [
        (method != "none", f"gradient_compression.method={method}", "there is no per-step DDP all-reduce to "
         "compress; outer_dtype: bfloat16 halves the outer step's bytes", "gradient_compression.method=none"),
        (bool(trainer.get("sync_batchnorm")), "trainer.sync_batchnorm=true", "SyncBatchNorm all-reduces in every "
         "forward, and inner steps make no collective", "--trainer.sync_batchnorm false"),
    ]  # fmt: skip
    for is_set, key, why, fix in refused:
        if is_set:
            raise InvalidConfigError(f"{key} does not combine with trainer.strategy diloco ({why}). Fix: {fix}.")
    if settings["fragments"] > 1:
        model = build_on_meta(config.get("model"))
        if model is not None:
            checked_fragments(model, settings["fragments"])


def build_on_meta(model: Any) -> nn.Module | None:
    """The config's model built on the meta device (no memory, no initialisation), for its blocks; None
    where it cannot be built so (the strategy checks again in every rank)."""
    class_path = getattr(model, "class_path", None) or (model.get("class_path") if isinstance(model, dict) else None)
    if not isinstance(class_path, str) or "." not in class_path:
        return None
    init_args = getattr(model, "init_args", None) or (model.get("init_args") if isinstance(model, dict) else None)
    arguments = init_args.as_dict() if hasattr(init_args, "as_dict") else dict(init_args or {})
    module_name, _, class_name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
        with torch.device("meta"):
            return cls(**arguments)
    except Exception:  # a model that needs more than its init_args (nested classes, data): checked in the ranks
        return None
