"""How a run writes its checkpoints, decided once from plain values (`save_plan`), and the one place that chooses the
Trainer's checkpoint I/O (`SavePlan.plugins`).

    SYNC                   a save returns once the checkpoint is on disk (`last_checkpoint.async_save: false`)
    BACKGROUND             a save copies to host memory, the writer thread writes (app/checkpoints/plugin.py)
    BACKGROUND_OVERLAPPED  the same, the parameters and optimizer state copied during the next step
    PLUGIN                 the config's own CheckpointIO writes, before training goes on
    STRATEGY               a strategy that writes its own checkpoints (DeepSpeed, a user's)

Under fsdp every rank writes its shards (`ShardedCheckpointIO`), else rank 0 a file (`SafeCheckpointIO`). The caller
resolves the strategy."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO

from app.checkpoints.plugin import BackgroundCheckpointIO, SafeCheckpointIO
from app.checkpoints.sharded_io import ShardedCheckpointIO


class SaveMode(enum.Enum):
    SYNC = "sync"
    BACKGROUND = "background"
    BACKGROUND_OVERLAPPED = "background_overlapped"
    PLUGIN = "plugin"
    STRATEGY = "strategy"

    @property
    def in_background(self) -> bool:
        return self in (SaveMode.BACKGROUND, SaveMode.BACKGROUND_OVERLAPPED)


@dataclass(frozen=True)
class SavePlan:
    """This run's way of writing checkpoints: the mode, and what its line at fit's start names.

    `sharded`: every rank writes its shards (strategy fsdp); `strategy`: the strategy as the config wrote it (STRATEGY's
    line); `plugin`: the class name of the config's own CheckpointIO (PLUGIN's)."""

    mode: SaveMode
    sharded: bool = False
    strategy: str = ""
    plugin: str = ""

    @property
    def line(self) -> str:
        """What fit prints at its start after "ddp-app: checkpoints: " (tests read these words)."""
        if self.mode == SaveMode.SYNC:
            return "written before training goes on (last_checkpoint.async_save: false)"
        if self.mode == SaveMode.STRATEGY:
            return f"written before training goes on (strategy {self.strategy} writes its own checkpoints)"
        if self.mode == SaveMode.PLUGIN:
            return f"written before training goes on, by the config's checkpoint I/O plugin {self.plugin}"
        whose = "this rank's shards" if self.sharded else "the checkpoint"
        pause = f"a save pauses training for a copy of {whose} to host memory; last_checkpoint.async_save"
        if self.mode == SaveMode.BACKGROUND_OVERLAPPED:
            pause = (
                f"a save pauses training for a copy of {whose} less the parameters and optimizer state, which are "
                "copied during the next step, whose optimizer step waits for them; last_checkpoint.overlap_copy"
            )
        return f"written in the background{' by every rank' if self.sharded else ''} ({pause})"

    def plugins(self, plugins: list[Any], timeout: timedelta | None = None) -> list[Any]:
        """The Trainer's plugins, the config's own list with this plan's checkpoint I/O, the one place it is chosen:
        under fsdp `ShardedCheckpointIO` (in place of any other: every rank writes its shards); otherwise the config's
        own CheckpointIO, else `SafeCheckpointIO`. Wrapped in `BackgroundCheckpointIO` where saves are written in the
        background. `timeout`: of the sharded checkpoints' process group (`collective_timeout_s`)."""
        overlapped = self.mode == SaveMode.BACKGROUND_OVERLAPPED
        if self.sharded:
            sharded: CheckpointIO = ShardedCheckpointIO(timeout)
            if self.mode.in_background:
                sharded = BackgroundCheckpointIO(sharded, overlapped)
            return [p for p in plugins if not isinstance(p, CheckpointIO)] + [sharded]
        plugins = list(plugins)
        if not any(isinstance(p, CheckpointIO) for p in plugins):
            plugins.append(SafeCheckpointIO())
        if self.mode.in_background:
            plugins = [BackgroundCheckpointIO(p, overlapped) if type(p) is SafeCheckpointIO else p for p in plugins]
        return plugins


def save_plan(
    async_save: bool,
    overlap_copy: bool,
    plugins: list[Any],
    sharded: bool = False,
    own_writer: str | None = None,
) -> SavePlan:
    """How checkpoints are written, from the config's values: `last_checkpoint.async_save` and `.overlap_copy`,
    `trainer.plugins`, whether the strategy shards (fsdp) and, for a strategy that writes its own checkpoints (neither
    ddp, single-device nor fsdp), its name as written."""
    own = [type(p).__name__ for p in plugins if isinstance(p, CheckpointIO) and type(p) is not SafeCheckpointIO]
    if not async_save:
        return SavePlan(SaveMode.SYNC, sharded)
    if not sharded and own_writer is not None:
        return SavePlan(SaveMode.STRATEGY, strategy=own_writer)
    if not sharded and own:
        return SavePlan(SaveMode.PLUGIN, plugin=own[0])
    return SavePlan(SaveMode.BACKGROUND_OVERLAPPED if overlap_copy else SaveMode.BACKGROUND, sharded)
