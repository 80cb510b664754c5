"""A replica group's side of fault tolerance: torchft's Manager inside a Lightning fit.

One `GroupRuntime` per process of a group, owned by the `fault_tolerance` callback
(app/parallel/fault_tolerance.py): each process has its own torchft Manager (replica id: the group;
rank and world size: its rank within the group and the group's size, as torchft's own examples do).
The Manager of the group's rank 0 talks to the lighthouse for the whole group, and process r of a
group all-reduces with process r of every other group (torchft's process group of "group rank r").
In a group of several processes, Lightning's DDP first averages the gradients within the group
(its own process group, MASTER_PORT), and the groups then average those across groups. Per optimizer
step:

1. The quorum of the step was formed at the end of the previous one (`on_train_batch_end`), or for
   the first when `fit` loads the group's own checkpoint (`join_for_state`) or before `fit` (`join`),
   synchronously (`use_async_quorum=False`): a group that needs the state of a peer receives it
   there, before it computes anything on stale weights.
2. During backward, the gradients are summed over the groups in the quorum through torchft's gloo
   process group in buckets, as DDP does (app/parallel/ft_buckets.py), and divided by their number:
   a step with a group missing averages over the groups present. `after_backward` (the callback's
   `on_after_backward`) waits for the last buckets.
3. `should_commit` (`commit_or_drop`, the callback's `on_before_optimizer_step`, before gradient
   clipping) then says whether the step may be applied: with fewer than `min_replicas` groups,
   or after an error in the all-reduce (a peer died in it), every parameter's gradient is dropped,
   so the optimizer leaves the weights and its state as they were (the step is counted by Lightning,
   its batch is consumed, and the story says `committed: false`).

What a peer sends is the Lightning checkpoint it would save at this point of its run (model,
optimizer, schedulers, loops, ddp-app's data position and random state: `dump_checkpoint`), through
torchft's HTTP checkpoint transport; nothing is read from disk. A group that receives it resumes from
it as from `--ckpt_path` (in place of its own file's contents, or written to /dev/shm before `fit`),
so the exact-resume machinery (app/resume/exact.py) restores its data position and random state
as it does for last.ckpt. Each group reads its own shard of the data (its index among the groups,
app/data/rank_loaders.py), at the same step as the others, so a rejoining group continues in its own
shard at the peers' step: the batches it would have read while it was dead are never read.

Torchft's step counter is kept equal to Lightning's global step (minus one after a step this group
did not commit): the lighthouse sends the state of the group that is furthest ahead to any group
behind it, so a group that committed a step that another dropped is the one the other heals from.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.distributed.tensor import DTensor

from app.checkpoints.io import atomic_torch_save, safe_load
from app.checkpoints.local_shards import LOCAL_SHARDS_KEY, has_shards, to_local_shards
from app.checkpoints.sharded import META_NAME, is_sharded_checkpoint
from app.parallel.fault_tolerance import (
    START_VARIABLE,
    STORE_PORT_VARIABLE,
    STORY_VARIABLE,
    FaultTolerance,
    FaultTolerancePlan,
)
from app.parallel.ft_buckets import GradientBuckets
from app.parallel.ft_shards import load_local_shards
from app.private_apis import require


class GroupRuntime:
    """torchft's Manager for this group's process, and the per-step record of what it did."""

    def __init__(self, settings: FaultTolerance, plan: FaultTolerancePlan, env: Any = None) -> None:
        env = os.environ if env is None else env
        assert plan.group is not None
        self.settings, self.plan, self.group = settings, plan, plan.group
        self.group_rank = int(env.get("LOCAL_RANK", "0"))  # this process's rank within its group
        self.trainer: L.Trainer | None = None
        self.running = False
        self.resume_path: str | None = None
        self.received: dict[str, Any] | None = None
        self.healed_path: str | None = None
        self.committed = True
        self.buckets: GradientBuckets | None = None  # the gradient all-reduce, made when training starts
        self.replicas = 0
        self.quorum_id: Any = None
        self.quorum_step = -1  # the global step of the last quorum: one per optimizer step
        self.counts = {"quorum changes": 0, "steps not applied": 0, "states sent": 0}
        # The last step's: its quorum (before it), the wait for its all-reduce after backward, its commit
        # decision (milliseconds), and its buckets: [started during backward, in all].
        self.times: dict[str, Any] = {}
        story_dir = env.get(STORY_VARIABLE)
        self.story = None
        if story_dir and self.group_rank == 0:  # the group's rank 0 keeps the group's record
            Path(story_dir).mkdir(parents=True, exist_ok=True)
            self.story = open(Path(story_dir) / f"group_{self.group}.jsonl", "a", buffering=1)  # noqa: SIM115
        self.store, self.manager = make_manager(settings, plan, env)
        self.manager.register_state_dict_fn("ddp_app", self._load, self._state)
        self.start_directory = env.get(START_VARIABLE)

    # ----- before fit -----

    def join(self, trainer: L.Trainer, resume_path: str | None) -> str | None:
        """The first quorum, before `fit` (a group with no checkpoint file of its own to load). Returns the path of
        the state a peer sent (in /dev/shm) if this group is behind the others, for `fit` to resume from; None if it
        starts as it is."""
        received = self.join_for_state(trainer, resume_path)
        if received is None:
            return None
        shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(trainer.default_root_dir)
        path = shm / f"ddp-app-ft-group{self.group}-{os.getpid()}.ckpt"
        atomic_torch_save(received, path)
        self.healed_path = str(path)
        return self.healed_path

    def join_for_state(self, trainer: L.Trainer, resume_path: str | None) -> dict[str, Any] | None:
        """The first quorum: the state a peer sent if this group is behind the others, else None. A restarted group
        calls it when `fit` loads its own checkpoint (app/run/build.py, `supply_at_load`): by then its Trainer, model
        and DataModule are set up, so the groups that wait for it in their next all-reduce wait only for the
        transfer and its first step, not for its setup."""
        self.trainer, self.resume_path = trainer, resume_path
        connector = require(trainer, "_checkpoint_connector", "lightning", "the state a replica group sends a peer")
        require(connector, "dump_checkpoint", "lightning", "the state a replica group sends a peer")
        step = _global_step_of(resume_path) if resume_path else 0
        self.manager.load_state_dict({"step": step, "batches_committed": 0})
        if self.start_directory:
            wait_for_every_process(Path(self.start_directory), self.plan, self.group, self.group_rank,
                                   self.settings.quorum_timeout_s)  # fmt: skip
        self._quorum(step)
        received, self.received = self.received, None
        if received is not None:
            healed_step = int(received.get("global_step", 0))
            self._say(f"rejoins at step {healed_step} with the state of a peer (received live, not read from disk)")
        return received

    def _state(self) -> dict[str, Any]:
        """What this group sends to a group that heals: its checkpoint at this point of the run."""
        assert self.trainer is not None
        if self.running:
            self.counts["states sent"] += 1
            if self.story:  # what it sent, for the record: the receiver's start line says what it got
                self._write({"sent": self.trainer.global_step, "digest": weights_digest(self.trainer.lightning_module)})
            # Private (docs/private_apis.md): the dict `trainer.save_checkpoint` writes, without writing it.
            checkpoint = self.trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
            # Sharded within the group (strategy fsdp): this process's shards, for the process of the same rank.
            return to_local_shards(checkpoint) if has_shards(checkpoint) else checkpoint
        if self.resume_path:  # not training yet: the checkpoint it is about to resume from
            return safe_load(self.resume_path)
        raise RuntimeError("ddp-app: fault tolerance: asked for its state before it has any")

    def _load(self, state: dict[str, Any]) -> None:
        """The state a peer sent: kept for `fit` before it starts; applied at once during it."""
        if not self.running:
            self.received = state
            return
        # During fit: a peer at the same step committed a step this group dropped. Same data position
        # and step, other weights: the weights, optimizer and schedulers are taken.
        assert self.trainer is not None
        if state.get("global_step") != self.trainer.global_step:
            end_to_heal(self._say, self.story, self.trainer.global_step, state.get("global_step"))
        take_weights(self.trainer, state)
        self._say(f"took the weights of a peer at step {state.get('global_step')}")

    # ----- during fit -----

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.trainer, self.running = trainer, True
        if self.buckets is not None:
            self.buckets.remove()
        # Private (docs/private_apis.md): Lightning's decision whether a backward ends in an optimizer step.
        should_accumulate = require(trainer.fit_loop, "_should_accumulate", "lightning", "fault tolerance's all-reduce")
        # In a group of several processes Lightning's DDP averages the gradients within the group during backward and
        # puts them in `.grad` only at its end: the buckets go across groups after backward, not overlapped with it.
        overlap = self.plan.group_size == 1
        # Under DDP within a group every process holds the group's whole gradient: each sends its slice across groups.
        sharded = any(isinstance(param, DTensor) for param in pl_module.parameters())
        split = self.plan.group_size > 1 and not sharded
        self.buckets = GradientBuckets(self.manager, pl_module, should_accumulate, overlap=overlap, split=split)
        self.quorum_step = trainer.global_step  # `join` formed this step's quorum
        if self.healed_path is not None:  # restored by fit: the copy in memory is no longer needed
            Path(self.healed_path).unlink(missing_ok=True)
            self.healed_path = None
        pids = _group_pids()  # every rank of the group takes part
        if self.story:
            self._record(trainer.global_step, start=pl_module, pids=pids)

    def after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """The gradients averaged over the groups in the quorum, if this backward ends in an optimizer
        step: most buckets were sent during backward (app/parallel/ft_buckets.py); the rest here."""
        assert self.buckets is not None
        started = time.perf_counter()
        if self.buckets.after_backward():
            self.times["allreduce_ms"] = _ms(time.perf_counter() - started)  # what backward did not hide
            self.times["buckets"] = [self.buckets.started_in_backward, len(self.buckets.order)]
            self.times["sent_bytes"] = self.buckets.sent_bytes  # across the groups, by this process

    def commit_or_drop(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        """Before the optimizer step (and gradient clipping): whether the step may be applied; if not,
        its gradients are dropped."""
        assert self.buckets is not None
        started = time.perf_counter()
        self.committed = self.manager.should_commit()
        self.times["commit_ms"] = _ms(time.perf_counter() - started)
        if not self.committed:
            # Not retried within the step: a shrink-only re-quorum (`start_quorum(allow_heal=False,
            # shrink_only=True)`, torchft 0.2.0) was tried for issue 57 and let the survivor whose all-reduce
            # failed first form a quorum of one while the other still waited in its own failing all-reduce
            # (min_replicas 1): they trained apart, then timed out. Dropping the step keeps them together.
            self.counts["steps not applied"] += 1
            self._say(
                f"step {trainer.global_step + 1} not applied: a group failed during it, or fewer than "
                f"min_replicas={self.plan.min_replicas} groups took part (its gradients are dropped; the weights "
                "stay as they were)"
            )
            self.buckets.drop()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.buckets is not None:
            self.buckets.next_batch()
        pl_module.log("ft_replicas", float(self.replicas), on_step=True, on_epoch=False, batch_size=1)
        if trainer.global_step == self.quorum_step:
            return  # a micro-batch of gradient accumulation: the optimizer step (and a save point) is still ahead
        self.quorum_step = trainer.global_step
        if self.story:
            self._record(trainer.global_step)
        # The next step's quorum, here: a peer that heals from this group gets the state a save at this
        # point would write, the point every resume of ddp-app starts from.
        self._quorum(trainer.global_step - (0 if self.committed else 1))

    def _quorum(self, step: int) -> None:
        self.manager.load_state_dict({"step": step, "batches_committed": self.manager.batches_committed()})
        started = time.perf_counter()
        self.manager.start_quorum()  # synchronous: returns with the quorum, and a pending heal applied
        self.times["quorum_ms"] = _ms(time.perf_counter() - started)
        replicas, quorum_id = self.manager.num_participants(), self.manager._quorum_id
        if self.quorum_id is not None and quorum_id != self.quorum_id:  # a group left, came back or was replaced
            self.counts["quorum changes"] += 1
            self._say(f"quorum changed at step {step}: {replicas} of {self.plan.groups} groups (was {self.replicas})")
        self.replicas, self.quorum_id = replicas, quorum_id

    def _record(self, step: int, start: L.LightningModule | None = None, pids: list[int] | None = None) -> None:
        """One JSON line per step (and one when training starts, with the group's processes, rank 0's
        first, and its weights' digest): the step done, when, with how many groups, and whether it was applied."""
        entry: dict[str, Any] = {"step": step, "time": time.time(), "replicas": self.replicas}
        entry.update(committed=self.committed, **self.times)
        if start is not None:
            entry.update(start=True, pid=os.getpid(), pids=pids, digest=weights_digest(start))
        self._write(entry)

    def _write(self, entry: dict[str, Any]) -> None:
        assert self.story is not None
        self.story.write(json.dumps(entry) + "\n")

    def _say(self, line: str) -> None:
        if self.group_rank:  # the group's rank 0 speaks for the group
            return
        print(f"ddp-app: fault tolerance: group {self.group} {line}", file=sys.stderr, flush=True)

    def shutdown(self) -> None:
        if self.running:  # the group's part of the run's story, in one line
            self._say("ended: " + ", ".join(f"{count} {what}" for what, count in self.counts.items()))
        self.running = False
        if self.buckets is not None:
            self.buckets.remove()
            self.buckets = None
        self.manager.shutdown(wait=False)
        if self.story:
            self.story.close()
            self.story = None


# app/cluster/exit_codes.py PEER_LOST_EXIT_CODE (not imported: app.cluster imports app.parallel), which the
# launcher restarts a group for (tests/fault/test_torchft.py checks that the two agree).
RESTART_TO_HEAL_EXIT_CODE = 4


def wait_for_every_process(
    directory: Path, plan: FaultTolerancePlan, group: int, group_rank: int, timeout_s: float
) -> None:
    """At the run's start: until every group's processes have their Manager up (heartbeating to the lighthouse), so
    that the first quorum has every group. A group that does not come within the quorum timeout is left out; it
    heals from the others when it comes."""
    (directory / f"group_{group}.{group_rank}").touch()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if sum(1 for _ in directory.glob("group_*")) >= plan.groups * plan.group_size:
            return
        time.sleep(0.02)


def end_to_heal(say: Any, story: Any, step: int, peer_step: Any) -> None:
    """End a group whose peers are a whole step ahead during `fit`.

    Seen in tests/fault/test_torchft.py's kill test, about 1 run in 9: this group's all-reduce with the killed group
    took longer to fail than join_timeout_s, so the others formed the next quorum and took a step without it. Their
    data position and loops are not this group's, and Lightning cannot move them mid-fit: the group ends, its launcher
    starts it again with `--ckpt_path last`, and it heals from a peer before `fit` (`join`), as any restarted group."""
    say(f"is at step {step}, its peers at step {peer_step}: it restarts and heals from them before training again")
    if story:
        story.flush()
    sys.stdout.flush()
    os._exit(RESTART_TO_HEAL_EXIT_CODE)


def make_manager(settings: FaultTolerance, plan: FaultTolerancePlan, env: Any) -> tuple[Any, Any]:
    """This group's TCPStore (started before its Manager, which connects to it as a client) and torchft Manager."""
    from torch.distributed import TCPStore
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo

    timeout = timedelta(seconds=settings.timeout_s)
    host, port = env.get("MASTER_ADDR", "127.0.0.1"), int(env.get(STORE_PORT_VARIABLE) or env["MASTER_PORT"])
    group_rank = int(env.get("LOCAL_RANK", "0"))
    # The group's rank 0 serves it; the Manager of every rank connects to it. ddp-app's launcher held STORE_PORT for the
    # group and its rank 0 serves it since it started (app/cluster/rendezvous.py); a group started otherwise binds it.
    store = None
    if group_rank == 0 and STORE_PORT_VARIABLE not in env:
        store = TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=timeout)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout),
        load_state_dict=None,
        state_dict=None,
        min_replica_size=plan.min_replicas,
        use_async_quorum=False,  # a group that heals loads the peer's state before it computes anything
        timeout=timeout,
        quorum_timeout=timedelta(seconds=settings.quorum_timeout_s),
        connect_timeout=timeout,
        rank=group_rank,
        world_size=plan.group_size,
        store_addr=host,
        store_port=port,
        lighthouse_addr=plan.lighthouse,
        replica_id=f"ddp_app_group_{plan.group}",  # torchft reads the group's index from its trailing digits
        init_sync=False,  # every group starts from the same seed, so from the same weights
    )
    # Private (docs/private_apis.md), checked once here, before training relies on it.
    require(manager, "_quorum_id", "torchft", "the line that says the quorum of replica groups changed")
    return store, manager


def take_weights(trainer: L.Trainer, state: dict[str, Any]) -> None:
    """The weights, optimizer and scheduler states a peer sent, put in place during `fit`."""
    if state.get(LOCAL_SHARDS_KEY):  # sharded within the group: this process's shards
        load_local_shards(trainer.strategy.model, trainer.optimizers, state)
    else:
        trainer.lightning_module.load_state_dict(state["state_dict"])
        for optimizer, saved in zip(trainer.optimizers, state["optimizer_states"], strict=True):
            optimizer.load_state_dict(saved)
    for config, saved in zip(trainer.lr_scheduler_configs, state.get("lr_schedulers", []), strict=False):
        config.scheduler.load_state_dict(saved)


def _group_pids() -> list[int]:
    """The process ids of this group's processes, in rank order (a collective in a group of several)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [os.getpid()]
    pids: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(pids, os.getpid())
    return [int(pid) for pid in pids]


def weights_digest(module: torch.nn.Module) -> str:
    """A SHA-256 of the module's parameters, in order: equal digests, equal weights (sharded: this process's shards,
    which the process of the same rank in another group holds too)."""
    digest = hashlib.sha256()
    for param in module.parameters():
        local = param.to_local() if isinstance(param, DTensor) else param
        digest.update(local.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _ms(seconds: float) -> float:
    return round(1000 * seconds, 3)


def _global_step_of(path: str) -> int:
    """The global step a checkpoint resumes at (memory-mapped: the tensors are not read)."""
    if is_sharded_checkpoint(path):  # strategy fsdp: the step is in its meta file, beside the shards
        path = str(Path(path) / META_NAME)
    try:
        checkpoint = torch.load(path, map_location="cpu", mmap=True, weights_only=False)
    except Exception:  # a sharded directory or another format: Lightning reports it when it loads
        return 0
    return int(checkpoint.get("global_step", 0)) if isinstance(checkpoint, dict) else 0
