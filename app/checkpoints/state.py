"""Everything ddp-app keeps in a checkpoint beside Lightning's own entries: one key, one format version,
one table of parts.

Lightning's checkpoint holds the weights, the optimizer and scheduler states, the loops' counters and
each callback's `state_dict`. What ddp-app adds lives under `checkpoint["ddp_app"]`:

    {"format_version": 2, "parts": {"exact_resume": {...}, "tracking": {...}, "gradient_compression": {...}}}

Each part has one owner, named in `PARTS`, which writes it with `put` while Lightning builds the
checkpoint (on every rank, in the owner's `on_save_checkpoint`) and reads it with `get`. Only
app/checkpoints/ writes a checkpoint's top-level keys (`TOP_LEVEL_KEYS`) or the entries under them;
code elsewhere goes through the functions here (`put`, `lightning_checkpoint`, `replace_loop_state`),
and tests/checkpoints/test_one_writer.py checks it. On the sharded path (strategy fsdp) the same dict
goes into the checkpoint's `meta.pt` beside the shards (app/checkpoints/sharded_io.py).

Checkpoints written before this format (format 1: ddp-app 689925d and earlier, one top-level key per
part) are read through `migrate_format_1`, so they still resume; a checkpoint of a newer format is
refused in one line that names both versions. No Lightning here: the checkpoint summaries, the export
and the parity tools read it too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from app.errors import ResumeError

STATE_KEY = "ddp_app"
FORMAT_VERSION = 2

# Every part ddp-app keeps, and who owns it (who writes and reads it).
PARTS = {
    "exact_resume": "app/resume/exact.py ExactResume: the data position, each rank's random state, per-rank "
    "metric state and stream states, and where the user's classes were imported from",
    "tracking": "app/tracking/run.py Tracking: the tracked run and its journal position, the epoch's measured "
    "throughput so far",
    "gradient_compression": "app/parallel/compression.py GradientCompression: each rank's compression state",
    "step_timing": "app/run/step_timing.py StepTiming: the epoch's step-time sums so far",
    "sharding": "app/parallel/fsdp.py FSDP2Strategy: the mesh the shards were written from (replicas x shards)",
    "diloco": "app/parallel/diloco.py DiLoCoStrategy (written by DiLoCoCheckpoint): the anchor, the outer momentum, "
    "the inner step count, every rank's replica (parameters and inner optimizer state) and, with overlap_steps, "
    "the outer all-reduce in flight (its mean and each rank's parameters when it was sent)",
}

# Format 1 (ddp-app 689925d and earlier): the top-level keys each part wrote.
_FORMAT_1_KEYS = {
    "ddp_app_data_position": ("exact_resume", "position"),
    "rng_states_per_rank": ("exact_resume", "per_rank"),
    "user_code_directories": ("exact_resume", "user_code_directories"),
    "ddp_app_run": ("tracking", "run"),
}


# The top-level keys of a Lightning checkpoint (`_CheckpointConnector.dump_checkpoint`) that ddp-app
# reads or builds; with ddp-app's own and format 1's, every key only app/checkpoints/ writes.
LIGHTNING_KEYS = (
    "epoch",
    "global_step",
    "pytorch-lightning_version",
    "state_dict",
    "loops",
    "callbacks",
    "optimizer_states",
    "lr_schedulers",
    "hparams_name",
    "hyper_parameters",
    "datamodule_hparams_name",
    "datamodule_hyper_parameters",
)
COUNTER_KEYS = ("pytorch-lightning_version", "epoch", "global_step", "loops")  # where a fit stopped
TOP_LEVEL_KEYS = frozenset((*LIGHTNING_KEYS, STATE_KEY, *_FORMAT_1_KEYS, "gradient_compression"))


def put(checkpoint: dict[str, Any], part: str, value: Any) -> None:
    """Write `part` of ddp-app's state into a checkpoint being built."""
    if part not in PARTS:
        raise KeyError(f"{part!r} is not a part of ddp-app's checkpoint state; add it to PARTS ({__name__}) first")
    state = checkpoint.setdefault(STATE_KEY, {"format_version": FORMAT_VERSION, "parts": {}})
    state["parts"][part] = value


def get(checkpoint: dict[str, Any], part: str) -> Any:
    """`part` of ddp-app's state in a loaded checkpoint (of any format this version reads), or None."""
    if part not in PARTS:
        raise KeyError(f"{part!r} is not a part of ddp-app's checkpoint state ({__name__} PARTS)")
    return parts_of(checkpoint).get(part)


def parts_of(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """Every part in a loaded checkpoint, by name; a checkpoint without ddp-app's state has none."""
    state = checkpoint.get(STATE_KEY)
    if state is None:
        return migrate_format_1(checkpoint)
    version = state.get("format_version") if isinstance(state, dict) else None
    if version != FORMAT_VERSION:
        raise ResumeError(
            f"this checkpoint holds ddp-app state of format {version!r}, and this ddp-app reads formats 1 to "
            f"{FORMAT_VERSION}. Fix: resume it with the ddp-app version that wrote it, or load only its weights "
            "(python -m app.export) and start a new run."
        )
    return state.get("parts") or {}


def migrate_format_1(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """The parts of a checkpoint written in format 1, where each part had its own top-level key (and
    Tracking's throughput was Lightning's callback state of the callback named `Tracking`)."""
    parts: dict[str, Any] = {}
    for key, (part, field) in _FORMAT_1_KEYS.items():
        if key in checkpoint:
            parts.setdefault(part, {})[field] = checkpoint[key]
    throughput = (checkpoint.get("callbacks") or {}).get("Tracking")
    if throughput is not None:
        parts.setdefault("tracking", {})["epoch_throughput"] = throughput
    if "gradient_compression" in checkpoint:
        parts["gradient_compression"] = checkpoint["gradient_compression"]
    return parts


def lightning_checkpoint(
    state_dict: dict[str, Any],
    optimizer_states: list[Any],
    lr_schedulers: list[Any] | None = None,
    counters_of: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A checkpoint Lightning loads: these weights, optimizer and scheduler states and, from
    `counters_of` (a checkpoint Lightning wrote), where its fit stopped (`COUNTER_KEYS`) and its data
    position (the `exact_resume` part's), nothing else of it (app.parity continues the reference's
    run from one; the save benchmarks write one)."""
    checkpoint: dict[str, Any] = {key: counters_of[key] for key in COUNTER_KEYS if key in (counters_of or {})}
    checkpoint["state_dict"] = state_dict
    checkpoint["optimizer_states"] = optimizer_states
    if lr_schedulers is not None:
        checkpoint["lr_schedulers"] = lr_schedulers
    position = (get(counters_of, "exact_resume") or {}).get("position") if counters_of is not None else None
    if position is not None:
        put(checkpoint, "exact_resume", {"position": position})
    return checkpoint


def replace_loop_state(checkpoint: dict[str, Any], loop: str, change: Callable[[Any], Any]) -> None:
    """Lightning's state of `loop` (`fit_loop`) in a checkpoint being loaded, replaced by
    `change(state)`; nothing where the checkpoint has none (ExactResume's canonical counters)."""
    loops = checkpoint.get("loops") or {}
    if loop in loops:
        loops[loop] = change(loops[loop])
