"""Gradient compression for DDP's all-reduce, chosen in the config: `gradient_compression.method`.

On slow Ethernet the all-reduce can cost more than the step. PyTorch's DDP hooks send less: `fp16` / `bf16` halve the
bytes, PowerSGD sends a rank-r approximation of every matrix with error feedback. Lightning 2.6 registers a hook only on
CUDA (`DDPStrategy._register_ddp_hooks`) and never saves PowerSGD's state; here the hook works on any device
(`GradientCompression`, on every run) and PowerSGD's state is checkpointed per rank, weights_only-loadable, for
bit-exact resume.

Methods:
- `none`: DDP's own all-reduce (no hook is registered).
- `fp16`, `bf16`: PyTorch's `fp16_compress_hook` / `bf16_compress_hook`.
- `powersgd`: PyTorch's `powerSGD_hook` (per-layer, `powersgd_rank`, after `start_iter` plain steps).
- `auto`: tries none, bf16 and powersgd for a few steps each at the start of training, keeps the fastest (the most exact
  one when they are within `AUTO_TOLERANCE`), and says why in one line.

PowerSGD keeps state per DDP bucket, and buckets are rebuilt after the first step of every run, so checkpoints store it
per parameter name and `ParameterMemory` moves it into whatever buckets DDP has (a resume under another `bucket_cap_mb`
works too)."""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Mapping
from typing import Any

import lightning as L
import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
from torch.nn.parallel import DistributedDataParallel

from app.checkpoints import state as checkpoint_state
from app.checkpoints.io import gather_per_rank
from app.errors import InvalidConfigError
from app.private_apis import require

METHODS = ("none", "fp16", "bf16", "powersgd", "auto")
# auto's candidates, from the most to the least exact: a less exact one must be faster to be chosen.
AUTO_CANDIDATES = ("none", "bf16", "powersgd")
# auto keeps the most exact candidate whose step time is within this fraction of the fastest.
AUTO_TOLERANCE = 0.03
# Steps of each auto candidate that are not timed: the switch, PowerSGD's two plain all-reduces (`start_powerSGD_iter`
# must be >= 2) and its first compressed step, which allocates P and Q.
AUTO_WARMUP_STEPS = 3


def check_settings(method: str, powersgd_rank: int, start_iter: int, probe_steps: int) -> None:
    """Refuse values that PyTorch would reject inside every rank, or accept and ignore."""
    if method not in METHODS:
        raise InvalidConfigError(
            f"gradient_compression.method must be one of {', '.join(METHODS)}, got {method!r}. "
            "Fix: none (exact), bf16/fp16 (half the bytes), powersgd (low rank) or auto (measured)."
        )
    if powersgd_rank < 1:
        raise InvalidConfigError(f"gradient_compression.powersgd_rank must be >= 1, got {powersgd_rank}.")
    if start_iter < 2:
        # PowerSGDState raises for < 2 with error feedback or warm start: DDP rebuilds its buckets after the first step,
        # so the first two steps must be plain all-reduces.
        raise InvalidConfigError(
            f"gradient_compression.start_iter must be >= 2, got {start_iter}: DDP rebuilds its buckets after "
            "the first step, and PowerSGD must see the rebuilt ones. Fix: start_iter: 2 or more."
        )
    if probe_steps < 1:
        raise InvalidConfigError(f"gradient_compression.probe_steps must be >= 1, got {probe_steps}.")


def compressed_matrix(shape: torch.Size, rank: int, min_compression_rate: float) -> tuple[int, int, int] | None:
    """(rows, columns, rank) when `powerSGD_hook` compresses a gradient of this shape, else None: (rows + columns) x
    rank x min_compression_rate < rows x columns (`_should_compress`, checked by tests/test_compression.py)."""
    rows = shape[0] if len(shape) else 1
    columns = int(torch.Size(shape).numel()) // max(rows, 1)
    rank = min(rows, columns, rank)
    if (rows + columns) * rank * min_compression_rate < rows * columns:
        return rows, columns, rank
    return None


class ParameterMemory:
    """PowerSGD's per-bucket memories (error feedback, warm-started Q) kept by parameter name, to move between buckets
    and into checkpoints; the state is passed in on every call (`CommunicationHook` replaces it)."""

    def __init__(self) -> None:
        self.names: dict[int, str] = {}  # {id(parameter): name}
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.stashed: dict[str, dict[str, torch.Tensor]] = {"error": {}, "q": {}}
        self._bucket_names: dict[int, tuple[str, ...]] = {}  # PowerSGD's buckets: their parameters

    def match(self, state: powersgd.PowerSGDState, bucket: dist.GradBucket) -> None:
        """Give PowerSGD this bucket's state, moving it from the buckets of a previous bucketing."""
        index = bucket.index()
        names = tuple(self.names[id(parameter)] for parameter in bucket.parameters())
        if self._bucket_names.get(index) == names:
            return
        if any(not set(names).isdisjoint(previous) for previous in self._bucket_names.values()):
            self._stash_buckets(state)  # DDP rebuilt its buckets: everything goes per parameter first
        self.shapes.update({name: tuple(g.shape) for name, g in zip(names, bucket.gradients(), strict=True)})
        self._bucket_names[index] = names
        self._unstash_bucket(state, index, bucket)

    def restore(self, saved: dict[str, Any]) -> None:
        """A checkpoint's per-parameter tensors, moved into PowerSGD's buckets as DDP calls them."""
        self.stashed = {"error": dict(saved["error"]), "q": dict(saved["q"])}
        self.shapes.update({name: tuple(shape) for name, shape in saved["shapes"].items()})
        self._bucket_names.clear()

    def _layout(
        self, state: powersgd.PowerSGDState, names: tuple[str, ...]
    ) -> tuple[list[tuple[str, int, int]], list[tuple[str, int, int]], int]:
        """Each parameter's place in a bucket's flat buffer (name, start, length), in its flat Q memory (grouped by
        shape as `powerSGD_hook` does), and its P memory's length."""
        offsets, by_shape, start, p_length = [], {}, 0, 0
        for name in names:
            shape = torch.Size(self.shapes[name])
            offsets.append((name, start, shape.numel()))
            start += shape.numel()
            matrix = compressed_matrix(shape, state.matrix_approximation_rank, state.min_compression_rate)
            if matrix is not None:
                rows, columns, rank = matrix
                by_shape.setdefault((rows, columns), []).append((name, columns * rank))
                p_length += rows * rank
        q_offsets, start = [], 0
        for entries in by_shape.values():
            for name, length in entries:
                q_offsets.append((name, start, length))
                start += length
        return offsets, q_offsets, p_length

    def per_parameter(self, state: powersgd.PowerSGDState) -> dict[str, dict[str, torch.Tensor]]:
        """The error feedback and Q matrices per parameter name (copies; PowerSGD's dicts untouched)."""
        stashed = {
            kind: {name: t.detach().clone() for name, t in tensors.items()} for kind, tensors in self.stashed.items()
        }
        for index, names in self._bucket_names.items():
            offsets, q_offsets, _ = self._layout(state, names)
            for kind, memory, entries in (("error", state.error_dict, offsets), ("q", state.q_memory_dict, q_offsets)):
                if index in memory:
                    for name, start, length in entries:
                        stashed[kind][name] = memory[index][start : start + length].detach().clone()
        return stashed

    def _stash_buckets(self, state: powersgd.PowerSGDState) -> None:
        """PowerSGD's per-bucket tensors -> per parameter name; empties its dicts."""
        self.stashed = self.per_parameter(state)
        state.error_dict.clear()
        state.p_memory_dict.clear()
        state.q_memory_dict.clear()
        self._bucket_names.clear()

    def _unstash_bucket(self, state: powersgd.PowerSGDState, index: int, bucket: dist.GradBucket) -> None:
        """Build PowerSGD's tensors for this bucket from the per-parameter ones, where they exist."""
        offsets, q_offsets, p_length = self._layout(state, self._bucket_names[index])
        buffer = bucket.buffer()
        errors, qs = self.stashed["error"], self.stashed["q"]
        if any(name in errors for name, _, _ in offsets):
            error = torch.zeros(buffer.numel(), device=buffer.device, dtype=buffer.dtype)
            for name, start, length in offsets:
                if name in errors:
                    error[start : start + length] = errors.pop(name).to(buffer.device)
            state.error_dict[index] = error
        if q_offsets and all(name in qs for name, _, _ in q_offsets):
            state.q_memory_dict[index] = torch.cat([qs.pop(name).to(buffer.device) for name, _, _ in q_offsets])
            # Only its presence matters (warm start: no new random Q); P is recomputed every step.
            state.p_memory_dict[index] = torch.empty(p_length, device=buffer.device, dtype=buffer.dtype)


class CommunicationHook:
    """The DDP communication hook of one `gradient_compression` setting; `attach` registers it.

    Trainer-independent: the Lightning callback below and `python -m app.bench.network` use it.

    Args:
        method: none | fp16 | bf16 | powersgd | auto (see the module docstring).
        powersgd_rank: PowerSGD's matrix approximation rank (values sent per matrix: (rows + columns) x rank).
        start_iter: plain all-reduce steps before PowerSGD compresses (>= 2; PyTorch's default is 1000).
        warm_start: PowerSGD reuses last step's Q (better approximation, no new random Q per step;
            required for a bit-exact resume).
        error_feedback: PowerSGD adds what the last step's approximation missed to this step's gradients.
        probe_steps: auto: timed steps per candidate (after AUTO_WARMUP_STEPS untimed ones)."""

    def __init__(
        self,
        method: str = "none",
        powersgd_rank: int = 4,
        start_iter: int = 10,
        warm_start: bool = True,
        error_feedback: bool = True,
        probe_steps: int = 6,
    ) -> None:
        check_settings(method, powersgd_rank, start_iter, probe_steps)
        self.method = method
        self.powersgd_rank = powersgd_rank
        self.start_iter = start_iter
        self.warm_start = warm_start
        self.error_feedback = error_feedback
        self.probe_steps = probe_steps
        # The method in use; auto decides after its probe (`decision` then says why, in one line).
        self.chosen = method if method != "auto" else AUTO_CANDIDATES[0]
        self.decision = ""
        self.powersgd: powersgd.PowerSGDState | None = None
        self._group: Any = None
        self._on_gloo = False
        self._agree_group: Any = None
        self._memory = ParameterMemory()
        self._pending_state: dict[str, Any] | None = None
        # auto's probe: per candidate the times between the ends of consecutive backward passes.
        self._probe_index = 0
        self._probe_times: dict[str, list[float]] = {}
        self._steps_of_candidate = 0
        self._last_step_end: float | None = None

    # -- registration -----------------------------------------------------------------------

    def attach(self, model: DistributedDataParallel, names: Mapping[int, str] | None = None) -> None:
        """Register on `model` (before its first backward). `names`: {id(parameter): name} for the checkpointed state
        (default: the wrapped module's own parameter names)."""
        self._group = model.process_group
        # gloo runs future callbacks on its 2 worker threads, where powerSGD_hook's block on the next all-reduce: two
        # buckets in flight hang the first compressed step (torch 2.14). So on gloo each bucket's PowerSGD completes
        # before backward goes on (same numbers, less overlap).
        self._on_gloo = dist.get_backend(self._group) == "gloo"
        own_names = {id(parameter): name for name, parameter in model.module.named_parameters()}
        self._memory.names = dict(names) if names is not None else own_names
        if self.method == "auto":
            # The ranks agree on the probe's times on a CPU group of their own, not among DDP's in-flight all-reduces
            # (on GPUs the default group is NCCL).
            self._agree_group = dist.new_group(backend="gloo")
        if self.method in ("powersgd", "auto") and self.powersgd is None:
            self.powersgd = self._new_powersgd_state(self.start_iter if self.method == "powersgd" else 2)
        if self._pending_state is not None:
            self._apply_state(self._pending_state)
            self._pending_state = None
        if self.method != "none":
            model.register_comm_hook(self, communication_hook)

    def _new_powersgd_state(self, start_iter: int) -> powersgd.PowerSGDState:
        state = powersgd.PowerSGDState(
            process_group=self._group,
            matrix_approximation_rank=self.powersgd_rank,
            start_powerSGD_iter=start_iter,
            use_error_feedback=self.error_feedback,
            warm_start=self.warm_start,
        )
        # Private layout: the per-bucket memories checkpointed per parameter (ParameterMemory).
        for name in ("error_dict", "q_memory_dict"):
            require(state, name, "torch", "checkpointing PowerSGD's state")
        return state

    # -- the hook -----------------------------------------------------------------------------

    def communicate(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """Called by DDP for every bucket of every synchronised backward pass."""
        if self.method == "auto" and not self.decision and bucket.is_last():
            self._probe_step()
        method = self.chosen
        if method == "powersgd":
            self._memory.match(self.powersgd, bucket)
            future = powersgd.powerSGD_hook(self.powersgd, bucket)
            if self._on_gloo:
                future.wait()  # see `attach`
            return future
        if method == "bf16":
            return default_hooks.bf16_compress_hook(self._group, bucket)
        if method == "fp16":
            return default_hooks.fp16_compress_hook(self._group, bucket)
        return default_hooks.allreduce_hook(self._group, bucket)

    def _probe_step(self) -> None:
        """auto: time this step (end of backward to end of backward), move on or decide."""
        now = time.perf_counter()
        if self._last_step_end is not None:
            self._steps_of_candidate += 1
            if self._steps_of_candidate > AUTO_WARMUP_STEPS:
                self._probe_times.setdefault(self.chosen, []).append(now - self._last_step_end)
        self._last_step_end = now
        if len(self._probe_times.get(self.chosen, [])) < self.probe_steps:
            return
        self._probe_index += 1
        self._steps_of_candidate = 0
        if self._probe_index < len(AUTO_CANDIDATES):
            self.chosen = AUTO_CANDIDATES[self._probe_index]
            return
        medians = torch.tensor([statistics.median(self._probe_times[name]) for name in AUTO_CANDIDATES])
        dist.all_reduce(medians, op=dist.ReduceOp.MAX, group=self._agree_group)  # the slowest rank sets the pace
        self._decide(dict(zip(AUTO_CANDIDATES, medians.tolist(), strict=True)))

    def _decide(self, step_seconds: dict[str, float]) -> None:
        fastest = min(step_seconds.values())
        self.chosen = next(name for name in AUTO_CANDIDATES if step_seconds[name] <= fastest * (1 + AUTO_TOLERANCE))
        if self.chosen != "powersgd":
            self.powersgd = None  # its state belongs to steps that are over
        label = {"powersgd": f"powersgd (rank {self.powersgd_rank})"}
        others = ", ".join(
            f"{label.get(name, name)} {seconds * 1e3:.1f} ms"
            for name, seconds in step_seconds.items()
            if name != self.chosen
        )
        self.decision = (
            f"gradient_compression auto: chose {label.get(self.chosen, self.chosen)}: median step "
            f"{step_seconds[self.chosen] * 1e3:.1f} ms vs {others} ({self.probe_steps} timed steps each, slowest rank)"
        )
        if dist.get_rank() == 0:
            print(f"ddp-app: {self.decision}", file=sys.stderr, flush=True)

    # -- checkpoint state -----------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """This rank's state, in types `torch.load(weights_only=True)` accepts."""
        state: dict[str, Any] = {"method": self.method, "chosen": self.chosen, "decision": self.decision}
        if self.powersgd is not None and self.chosen == "powersgd":
            per_parameter = self._memory.per_parameter(self.powersgd)
            kind, keys, position, has_gauss, cached_gaussian = self.powersgd.rng.get_state()
            state["powersgd"] = {
                "iter": self.powersgd.iter,
                "start_iter": self.powersgd.start_powerSGD_iter,
                "rng": [kind, keys.tolist(), int(position), int(has_gauss), float(cached_gaussian)],
                "error": {name: t.cpu() for name, t in per_parameter["error"].items()},
                "q": {name: t.cpu() for name, t in per_parameter["q"].items()},
                "shapes": {name: list(shape) for name, shape in self._memory.shapes.items()},
                "numel_before": self.powersgd.total_numel_before_compression,
                "numel_after": self.powersgd.total_numel_after_compression,
            }
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a rank's state; before `attach` it waits for it."""
        if self._memory.names:
            self._apply_state(state)
        else:
            self._pending_state = state

    def _apply_state(self, state: dict[str, Any]) -> None:
        if state.get("method") != self.method:
            return  # another setting than the checkpoint's: start its state fresh (the caller says so)
        if self.method == "auto" and not state["decision"]:
            return  # saved during auto's probe: probe again from the start
        self.chosen, self.decision = state["chosen"], state["decision"]
        saved = state.get("powersgd")
        if saved is None:
            return
        self.powersgd = self._new_powersgd_state(saved["start_iter"])
        self.powersgd.iter = saved["iter"]
        kind, keys, position, has_gauss, cached_gaussian = saved["rng"]
        self.powersgd.rng.set_state((kind, np.array(keys, dtype=np.uint32), position, has_gauss, cached_gaussian))
        self.powersgd.total_numel_before_compression = saved["numel_before"]
        self.powersgd.total_numel_after_compression = saved["numel_after"]
        self._memory.restore(saved)


def communication_hook(state, bucket):  # type: ignore[no-untyped-def]
    """What DDP calls with (state, bucket). No annotations on purpose: DDP compares them with `dist.GradBucket` and
    `Future[Tensor]`, and postponed annotations are strings that fail it."""
    return state.communicate(bucket)


class GradientCompression(L.Callback):
    """The `gradient_compression:` config key: registers `CommunicationHook` on Lightning's DDP model.

    On any device (Lightning 2.6 registers `ddp_comm_hook` on CUDA only), with its state, every rank's, in the
    checkpoint. Its settings are `CommunicationHook`'s (the parser reads them there)."""

    def __init__(self, **settings: Any) -> None:
        # The hook checks the values; it is registered at train start, once there is a DDP model.
        self.hook = CommunicationHook(**settings)
        self._attached = False
        self._saved: dict[str, Any] | None = None

    @property
    def method(self) -> str:
        return self.hook.method

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.method == "none" or self._attached:
            return
        model = trainer.strategy.model
        if not isinstance(model, DistributedDataParallel):
            if trainer.is_global_zero:
                print(
                    f"ddp-app: gradient_compression.method={self.method} has no effect: this run has no DDP "
                    f"all-reduce (strategy {type(trainer.strategy).__name__}, world size {trainer.world_size}).",
                    file=sys.stderr,
                    flush=True,
                )
            return
        state = self._state_for_this_rank(trainer)
        if state is not None:
            self.hook.load_state_dict(state)
        self.hook.attach(model, {id(parameter): name for name, parameter in pl_module.named_parameters()})
        self._attached = True

    def _state_for_this_rank(self, trainer: L.Trainer) -> dict[str, Any] | None:
        saved, self._saved = self._saved, None
        if saved is None:
            return None
        problem = None
        if saved["method"] != self.method:
            problem = f"it was saved with gradient_compression.method={saved['method']}, this run uses {self.method}"
        elif len(saved["per_rank"]) != trainer.world_size:
            problem = (
                f"it holds {len(saved['per_rank'])} ranks' error feedback, this run has {trainer.world_size} ranks"
            )
        if problem is not None:
            if trainer.is_global_zero:
                print(f"ddp-app: gradient compression starts with fresh state: {problem}.", file=sys.stderr, flush=True)
            return None
        return saved["per_rank"][trainer.global_rank]

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        if not self._attached:
            return
        # Every rank builds the checkpoint (rank 0 writes it), so a collective is safe here; the error feedback differs
        # per rank, so every rank's state is kept (gathered on rank 0 only).
        states = gather_per_rank(self.hook.state_dict())
        checkpoint_state.put(checkpoint, "gradient_compression", {"method": self.method, "per_rank": states})

    def on_load_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        self._saved = checkpoint_state.get(checkpoint, "gradient_compression")
