"""`strategy: diloco`: DiLoCo (Douillard et al., arXiv 2311.08105), data parallel training that talks
only every `sync_every` optimizer steps, for ranks behind a slow link (docs/diloco.md).

    trainer:
      strategy:
        class_path: app.parallel.diloco.DiLoCoStrategy
        init_args: {sync_every: 10, outer_lr: 0.7, outer_momentum: 0.9, fragments: 1, outer_dtype: float32,
                    overlap_steps: 0}

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
H / F steps, each all-reduce 1/F of the model.

Overlap, `overlap_steps: T` (the paper's tau; 0 < T < H / F): a fragment's outer gradient is taken and its
all-reduce started (`async_op`) T inner steps before its outer step, and the inner steps go on meanwhile;
at the outer step the strategy waits for it (by then it has usually arrived), the outer optimizer steps
the anchor, and the fragment's parameters become the new anchor plus this replica's progress since the
send (`new = anchor + (now - sent)`: no inner step is lost and none counted twice, the next outer
gradient carries those T steps; docs/diloco.md says why this rule and not the paper's mix). T = 0 is the
in-line outer step, unchanged. At most one exchange is in flight (T < H / F).

Written here, not taken from torchft: torchft's `DiLoCo` needs its `Manager`, a lighthouse server and
its own process groups for fault tolerance, and keeps the outer state where Lightning's checkpoint does
not see it; this is the algorithm alone, about 200 lines on `torch.distributed`, with its state in
ddp-app's checkpoint (the `diloco` part, app/checkpoints/state.py).

Exact resume: between two outer steps every rank's parameters and inner optimizer state differ, so a
checkpoint keeps every rank's (gathered on rank 0, as the random state is), the anchor, the outer
momentum (per parameter name, so a resume may change `fragments`), the inner step count, and an
exchange in flight (waited for while the checkpoint is built: its averaged outer gradient, and each
rank's parameters when it was sent, so it is applied at its outer step after a resume as it would have
been). A resume on
the same number of ranks restores each rank's own; on another number every rank continues from the
mean of the saved replicas with rank 0's inner optimizer state (`_restore`).
"""

from __future__ import annotations

import importlib
import inspect
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
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


def check_settings(
    sync_every: Any, fragments: Any, outer_lr: Any, outer_momentum: Any, outer_dtype: Any, overlap_steps: Any = 0
) -> None:
    """Refuse, in one line naming the key, what DiLoCo cannot run (the config checks call it before any
    rank starts; the strategy again when it is built in Python)."""
    key = "trainer.strategy.init_args"
    meanings = {
        "sync_every": ("inner optimizer steps between outer steps", 10, 1),
        "fragments": ("model parts", 1, 1),
        "overlap_steps": ("inner steps an outer all-reduce overlaps; 0: none", 0, 0),
    }
    for name, value in (("sync_every", sync_every), ("fragments", fragments), ("overlap_steps", overlap_steps)):
        meaning, example, least = meanings[name]
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise InvalidConfigError(
                f"{key}.{name}={value!r}: it must be a whole number >= {least} ({meaning}). "
                f"Fix: e.g. --{key}.{name} {example}."
            )
    if sync_every % fragments:
        raise InvalidConfigError(
            f"{key}.fragments={fragments} does not divide {key}.sync_every={sync_every}: each fragment syncs every "
            f"sync_every steps, one every sync_every / fragments. Fix: a sync_every that is a multiple of {fragments}."
        )
    if overlap_steps >= sync_every // fragments:
        raise InvalidConfigError(
            f"{key}.overlap_steps={overlap_steps} is not below sync_every / fragments = {sync_every // fragments}: "
            "an exchange must arrive before the next one starts. "
            f"Fix: an overlap_steps from 0 to {sync_every // fragments - 1}."
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


@dataclass
class Exchange:
    """One fragment's outer gradient on its way: this rank's (`flat`, then the replicas' mean once
    `work` is waited for), and with overlap the fragment's parameters when it was sent (float32)."""

    fragment: int
    due: int  # the inner step after which it is applied
    flat: torch.Tensor
    sent: list[torch.Tensor] | None = None
    work: Any = None  # the all-reduce in flight (None: done, or never started)
    reduced: bool = False  # flat holds the mean over the ranks (False: no exchange, the rank's own)


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


class DiLoCoCheckpointing:
    """The `diloco` part of a checkpoint, for DiLoCoStrategy (which sets the attributes below): what it
    keeps (`checkpoint_part`, gathered by `DiLoCoCheckpoint`) and how a resume restores it, exactly on
    as many ranks, elastically on another number."""

    inner_steps: int
    sync_every: int
    fragments: int
    world_size: int
    global_rank: int
    optimizers: list[Any]
    _names: list[str]
    _parameters: list[nn.Parameter]
    _anchors: list[torch.Tensor]
    _outer: list[torch.optim.SGD]
    _fragments: list[list[int]]
    _pending: dict[int, Exchange]
    complete: Callable[[Exchange], None]  # waits for an exchange's all-reduce (DiLoCoStrategy)

    def checkpoint_part(self, trainer: L.Trainer) -> dict[str, Any]:
        """What a checkpoint keeps of DiLoCo; a collective (every rank's replica, gathered on rank 0)."""
        to_host = lambda tensor: tensor.detach().to("cpu", copy=True)  # noqa: E731
        replica = {
            "parameters": {name: to_host(p) for name, p in zip(self._names, self._parameters, strict=True)},
            "optimizers": apply_to_collection([o.state_dict() for o in trainer.optimizers], torch.Tensor, to_host),
            "sent": {},  # overlap: this rank's parameters when the exchange in flight was sent, by name
        }
        pending = []
        for fragment, exchange in sorted(self._pending.items()):
            self.complete(exchange)  # the same wait on every rank: its mean is saved, not the work
            pending.append({"fragment": fragment, "due": exchange.due, "flat": to_host(exchange.flat),
                            "reduced": exchange.reduced})  # fmt: skip
            names = [self._names[i] for i in self._fragments[fragment]]
            replica["sent"].update(zip(names, map(to_host, exchange.sent or []), strict=True))
        momentum, names_of = {}, self._anchor_names()
        for outer in self._outer:
            for anchor in outer.param_groups[0]["params"]:
                buffer = outer.state.get(anchor, {}).get("momentum_buffer")
                if buffer is not None:
                    momentum[names_of[id(anchor)]] = to_host(buffer)
        return {
            "inner_steps": self.inner_steps,
            "sync_every": self.sync_every,
            "anchor": {name: to_host(anchor) for name, anchor in zip(self._names, self._anchors, strict=True)},
            "outer_momentum": momentum,
            "fragments": self.fragments,
            "pending": pending,
            "per_rank": gather_per_rank(replica),
        }

    def _restore_pending(self, saved: dict[str, Any], sent: dict[str, torch.Tensor]) -> None:
        """The exchange that was in flight at the save, its mean arrived, applied at its outer step. Where
        the resume cuts the model otherwise (another `fragments` or `sync_every`) it is dropped: the
        replicas keep their progress and the next outer gradient, from the same anchor, carries it."""
        self._pending = {}
        schedule = (int(saved["sync_every"]), int(saved.get("fragments", self.fragments)))
        if schedule != (self.sync_every, self.fragments):
            return
        for entry in saved.get("pending", []):
            fragment = int(entry["fragment"])
            device = self._anchors[0].device
            names = [self._names[i] for i in self._fragments[fragment]]
            exchange = Exchange(fragment, int(entry["due"]), entry["flat"].to(device, copy=True))
            exchange.reduced = bool(entry["reduced"])
            if all(name in sent for name in names):
                exchange.sent = [sent[name].to(device, copy=True) for name in names]
            self._pending[fragment] = exchange

    def _anchor_names(self) -> dict[int, str]:
        """The parameter name of each outer optimizer's anchor, by the anchor's identity."""
        return dict(zip(map(id, self._anchors), self._names, strict=True))

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
        names_of = self._anchor_names()
        for outer in self._outer:
            for anchor in outer.param_groups[0]["params"]:
                buffer = saved["outer_momentum"].get(names_of[id(anchor)])
                if buffer is not None:
                    outer.state[anchor]["momentum_buffer"] = buffer.to(anchor.device, copy=True)
        replicas = saved["per_rank"]
        if len(replicas) == self.world_size:  # each rank continues its own replica, exactly
            own = replicas[self.global_rank]
            for name, parameter in zip(self._names, self._parameters, strict=True):
                parameter.copy_(own["parameters"][name])
            for optimizer, state in zip(self.optimizers, own["optimizers"], strict=True):
                optimizer.load_state_dict(state)  # torch moves the state onto its parameters' device
            self._restore_pending(saved, own.get("sent", {}))
            return
        # Another number of ranks: the replicas cannot be handed out one each. Every rank continues
        # from their mean (what the next outer all-reduce would average) with rank 0's inner state,
        # and an exchange in flight from the mean of the replicas' parameters when it was sent.
        mean = lambda key, name: torch.stack([replica[key][name].double() for replica in replicas]).mean(0)  # noqa: E731
        for name, parameter in zip(self._names, self._parameters, strict=True):
            parameter.copy_(mean("parameters", name))
        sent = {name: mean("sent", name).float() for name in replicas[0].get("sent", {})}
        self._restore_pending(saved, sent)
        if self.global_rank == 0:
            print(
                f"ddp-app: diloco: the checkpoint holds {len(replicas)} replicas and this run has "
                f"{self.world_size} ranks: every rank continues from their mean, with rank 0's inner optimizer "
                f"state; the outer steps keep their schedule (inner step {self.inner_steps} now).",
                file=sys.stderr,
                flush=True,
            )


class DiLoCoStrategy(DiLoCoCheckpointing, DDPStrategy):
    """Lightning's DDPStrategy without DDP's per-step gradient all-reduce: inner steps are local and an
    outer step every `sync_every` optimizer steps averages the replicas (module docstring).

    Args:
        sync_every: H, the inner optimizer steps between two outer steps (of each fragment).
        outer_lr: the outer SGD's learning rate (1 with no momentum: the replicas' mean, as is).
        outer_momentum: the outer SGD's momentum.
        outer_nesterov: Nesterov momentum (only with outer_momentum > 0).
        fragments: streaming DiLoCo's F: the model synced in F parts, one every H / F steps.
        outer_dtype: the dtype the outer gradients are all-reduced in (bfloat16: half the bytes).
        overlap_steps: the inner steps an outer all-reduce runs beside (started that many steps before its
            outer step; 0: in line). Below sync_every / fragments.
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
        overlap_steps: int = 0,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ) -> None:
        check_settings(sync_every, fragments, outer_lr, outer_momentum, outer_dtype, overlap_steps)
        super().__init__(process_group_backend=process_group_backend, timeout=timeout)
        self.sync_every, self.fragments = sync_every, fragments
        self.outer_lr, self.outer_momentum, self.outer_nesterov = outer_lr, outer_momentum, outer_nesterov
        self.outer_dtype, self.overlap_steps = outer_dtype, overlap_steps
        self.inner_steps = 0  # optimizer steps since the run began (saved: the outer steps' schedule)
        self._names: list[str] = []
        self._parameters: list[nn.Parameter] = []
        self._anchors: list[torch.Tensor] = []  # float32, the parameters at the last outer step
        self._outer: list[torch.optim.SGD] = []  # one per fragment
        self._fragments: list[list[int]] = []  # each fragment's indices into _parameters
        self._pending: dict[int, Exchange] = {}  # overlap: the exchange on its way, by fragment (saved)
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
        self._pending = {}

    def setup(self, trainer: L.Trainer) -> None:
        super().setup(trainer)
        if trainer.state.fn == TrainerFn.FITTING and not self._anchors:
            # DDPStrategy.setup calls configure_ddp when fitting (Lightning 2.6): without it the replicas
            # would train apart, never synced, and nothing would say so.
            raise RuntimeError("ddp-app bug: DDPStrategy.setup did not call configure_ddp; diloco has no anchor")

    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        """The inner step (the config's optimizer, local), then the outer steps due after it, then (with
        overlap) the exchanges that start now."""
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self._anchors:
            self.inner_steps += 1
            for fragment in fragments_due(self.inner_steps, self.sync_every, self.fragments):
                self.outer_step(fragment)
            if self.overlap_steps:
                for fragment in fragments_due(self.inner_steps + self.overlap_steps, self.sync_every, self.fragments):
                    self._pending[fragment] = self.send(fragment, self.inner_steps + self.overlap_steps)
        return output

    @torch.no_grad()
    def send(self, fragment: int, due: int) -> Exchange:
        """This rank's outer gradient of one fragment (anchor - replica, in outer_dtype), its all-reduce
        started; with overlap, a float32 copy of the fragment's parameters beside it."""
        part = self._fragments[fragment]
        anchors, parameters = [self._anchors[i] for i in part], [self._parameters[i] for i in part]
        flat = torch.cat([(a - p.float()).reshape(-1) for a, p in zip(anchors, parameters, strict=True)])
        exchange = Exchange(fragment, due, flat.to(OUTER_DTYPES[self.outer_dtype]))
        if self.overlap_steps:
            exchange.sent = [parameter.detach().float().clone() for parameter in parameters]
        if self.world_size > 1 and self.communicate:
            started = time.perf_counter()
            exchange.work = dist.all_reduce(exchange.flat, op=dist.ReduceOp.SUM, async_op=True)
            self.communication_s += time.perf_counter() - started
        return exchange

    def complete(self, exchange: Exchange) -> None:
        """Wait for the exchange's all-reduce (the time counted as communication) and average it."""
        if exchange.work is None:
            return
        started = time.perf_counter()
        exchange.work.wait()
        exchange.work, exchange.reduced = None, True
        exchange.flat.div_(self.world_size)
        self._waited(started, exchange.flat)

    @torch.no_grad()
    def outer_step(self, fragment: int) -> None:
        """Average the replicas' outer gradients of one fragment (sent now, or `overlap_steps` ago), step
        its anchor, restart from it (plus, with overlap, the progress since the send). Every rank makes
        the same collectives in the same order (one all-reduce, then the buffers')."""
        exchange = self._pending.pop(fragment, None) or self.send(fragment, self.inner_steps)
        self.complete(exchange)
        part = self._fragments[fragment]
        anchors, parameters = [self._anchors[i] for i in part], [self._parameters[i] for i in part]
        offset = 0
        for anchor in anchors:
            anchor.grad = exchange.flat[offset : offset + anchor.numel()].view_as(anchor).float()
            offset += anchor.numel()
        self._outer[fragment].step()
        sent = exchange.sent or [None] * len(anchors)
        for anchor, parameter, then in zip(anchors, parameters, sent, strict=True):
            anchor.grad = None
            parameter.copy_(anchor if then is None else anchor + (parameter.float() - then))
        buffers = list(self.model.buffers()) if exchange.reduced else []
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

    def teardown(self) -> None:
        """An exchange still on its way (the fit stopped inside an overlap) is waited for, not abandoned
        in the process group; its result stays, for a checkpoint taken after."""
        try:
            for exchange in self._pending.values():
                self.complete(exchange)
        except RuntimeError as error:  # a peer gone (the fit is failing already): the exchange is dropped
            print(f"ddp-app: diloco: the outer all-reduce in flight did not complete ({error})", file=sys.stderr)
            self._pending = {}
        super().teardown()


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
    names = ("sync_every", "fragments", "outer_lr", "outer_momentum", "outer_dtype", "overlap_steps")
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
