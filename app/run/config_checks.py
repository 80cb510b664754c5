"""Checks and rewrites of a parsed `ddp-app` config, before any class is built.

Each check refuses, in one line with its fix, a value that Lightning or PyTorch would accept
silently or reject deep inside a rank; each rewrite changes the config the way every rank must
(a collective timeout, DDP's static graph under gradient accumulation). `app.cli.DDPAppCLI`
calls them once the config is parsed.
"""

from __future__ import annotations

import datetime
import errno
import importlib
import inspect
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from jsonargparse import Namespace
from lightning.pytorch.strategies import StrategyRegistry

from app.checkpoints.io import refuse_url
from app.cluster.preflight import (
    already_launched,
    devices_as_written_count,
    on_gpu,
    resolve_devices,
    visible_gpus,
)
from app.errors import UserFacingError
from app.parallel.strategy import ResolvedStrategy, StrategyKind
from app.tracking.run import require_tracker


def check_config(config: Any, strategy: ResolvedStrategy) -> None:
    """Refuse values that Lightning or PyTorch would accept silently or reject deep inside a rank
    (`--ckpt_path` is checked by app/run/plan.py `resume_from`)."""
    check_paths_are_local(config)
    trainer = config["trainer"]
    check_training_length(trainer)
    optimizer = config.get("optimizer")
    lr = (optimizer or {}).get("init_args", {}).get("lr") if optimizer else None
    if isinstance(lr, (int, float)) and lr <= 0:
        raise UserFacingError(f"optimizer.init_args.lr must be > 0, got {lr}. Fix: a positive learning rate.")
    if (config.get("restarts") or 0) < 0:
        raise UserFacingError(f"restarts must be >= 0, got {config['restarts']}. Fix: 0 (no restarts) or a count.")
    written_count = devices_as_written_count(trainer.get("devices"))
    if written_count is not None and written_count < 1 and written_count != -1:  # -1: every GPU (on CPU, every core)
        raise UserFacingError(f"trainer.devices must be >= 1, got {written_count}. Fix: a positive process count.")
    accelerator = trainer.get("accelerator")
    accelerator = accelerator if isinstance(accelerator, str) else None
    if accelerator in ("gpu", "cuda") and not visible_gpus():
        raise UserFacingError(
            f"trainer.accelerator={accelerator} but this machine has no usable GPU (torch.cuda.device_count() "
            "is 0). Fix: --trainer.accelerator=cpu (or auto), or run on a GPU node."
        )
    check_compression_fits(config)
    check_fsdp_combinations(config, strategy)
    if strategy.kind is StrategyKind.DILOCO:
        from app.parallel.diloco import check_config as check_diloco  # Lightning's strategies: only for diloco

        check_diloco(config)
    check_tracking(config)
    on_cpu = not on_gpu(trainer)
    precision = str(trainer.get("precision"))
    if on_cpu and precision in ("16", "16-mixed", "16-true", "half"):
        raise UserFacingError(
            f"trainer.precision={precision} on CPU: CPUs have no native float16 arithmetic (it is emulated, "
            "slower than 32-bit). Fix: --trainer.precision=bf16-mixed or 32-true on CPU; 16-mixed is for GPUs."
        )
    check_data_against_model(config)
    warn_if_oversubscribed(on_cpu, resolve_devices(trainer.get("devices", "auto"), trainer.get("accelerator", "auto")))
    if os.environ.get("LOCAL_RANK", "0") == "0":
        check_writable(Path(trainer.get("default_root_dir") or os.getcwd()))


def warn_if_oversubscribed(on_cpu: bool, devices: int | None) -> None:
    """One line when more CPU ranks than cores are asked for: slow (every step waits for the slowest
    rank), not wrong, so the run goes on. A resume on more ranks than the run started with is
    exactly that on a small machine. Said once, by the launcher (or an in-process run), not by each
    rank; `DDP_APP_ALLOW_OVERSUBSCRIBE=1` silences it."""
    cores = os.cpu_count() or 1
    if not on_cpu or devices is None or devices <= cores or os.environ.get("DDP_APP_ALLOW_OVERSUBSCRIBE"):
        return
    if already_launched(os.environ):
        return
    print(
        f"ddp-app: warning: trainer.devices={devices} CPU processes on a machine with {cores} cores oversubscribe it: "
        f"every step waits for the slowest rank. For speed: trainer.devices <= {cores} "
        "(DDP_APP_ALLOW_OVERSUBSCRIBE=1 silences this line).",
        file=sys.stderr,
        flush=True,
    )


def check_training_length(trainer: Any) -> None:
    """How long fit trains, as Lightning defines it: max_epochs -1 lifts the epoch limit, max_steps -1
    (the default) the step limit. Refused: a length that trains nothing (0), a value below -1, and
    neither limit nor max_time (a run that never ends)."""
    max_epochs, max_steps, max_time = trainer.get("max_epochs"), trainer.get("max_steps"), trainer.get("max_time")
    if max_steps is not None and (max_steps == 0 or max_steps < -1):
        raise UserFacingError(
            f"trainer.max_steps must be >= 1, or -1 for no step limit, got {max_steps}"
            + (" (0 steps would train nothing)" if max_steps == 0 else "")
            + ". Fix: a positive number of optimizer steps, or leave trainer.max_steps out (-1) to train by epochs."
        )
    if max_epochs == -1:
        if (max_steps is None or max_steps == -1) and not max_time:
            raise UserFacingError(
                "trainer.max_epochs=-1 (no epoch limit) with trainer.max_steps=-1 (no step limit) would train "
                "forever. Fix: set one of them, e.g. --trainer.max_steps 1000 or --trainer.max_epochs 10 "
                "(or set trainer.max_time)."
            )
        return
    if max_epochs is not None and max_epochs < 1:
        raise UserFacingError(
            f"trainer.max_epochs must be >= 1, or -1 for no epoch limit, got {max_epochs}. Fix: a positive "
            "number of epochs, or -1 with trainer.max_steps or trainer.max_time set to bound the run by steps "
            "or time."
        )


def check_paths_are_local(config: Any) -> None:
    """Checkpoints go to a filesystem path (`refuse_url` says why): a URL stops here, before any rank
    starts, instead of at the first save, or as a local directory named "s3:"."""
    trainer = config["trainer"]
    refuse_url(trainer.get("default_root_dir") or "", "trainer.default_root_dir")
    callbacks = trainer.get("callbacks") or []
    for index, callback in enumerate(callbacks if isinstance(callbacks, list) else [callbacks]):
        dirpath = (getattr(callback, "init_args", None) or {}).get("dirpath")
        refuse_url(dirpath or "", f"trainer.callbacks[{index}].init_args.dirpath")


def check_compression_fits(config: Any) -> None:
    """gradient_compression and a strategy's own communication hook would both register on the same
    DDP model, which PyTorch allows once (Lightning registers its own on CUDA only)."""
    method = (config.get("gradient_compression") or {}).get("method", "none")
    init_args = getattr(config["trainer"].get("strategy"), "init_args", None) or {}
    if method != "none" and init_args.get("ddp_comm_hook") is not None:
        raise UserFacingError(
            f"gradient_compression.method={method} and trainer.strategy.init_args.ddp_comm_hook are both set: DDP "
            "takes one communication hook. Fix: keep gradient_compression (it also works on CPU and is checkpointed) "
            "and remove ddp_comm_hook, or set gradient_compression.method=none."
        )


def check_fsdp_combinations(config: Any, strategy: ResolvedStrategy) -> None:
    """What does not combine with strategy fsdp is refused here, before any rank starts, naming the key."""
    if not strategy.is_sharded:
        return
    method = (config.get("gradient_compression") or {}).get("method", "none")
    data_args = getattr(config.get("data"), "init_args", None) or {}
    refused = [
        (method != "none", f"gradient_compression.method={method}", "a DDP communication hook; FSDP2 reduce-scatters "
         "the gradients itself", "gradient_compression.method=none"),
        (bool(data_args.get("on_device")), "data.init_args.on_device=true", "not built for sharded models yet",
         "data.init_args.on_device=false"),
        (bool(config.get("compile")), "compile=true", "torch.compile of sharded units is not built yet",
         "compile=false"),
    ]  # fmt: skip
    for is_set, key, why, fix in refused:
        if is_set:
            raise UserFacingError(
                f"{key} does not combine with trainer.strategy fsdp ({why}). Fix: {fix}, or strategy ddp."
            )


def check_tracking(config: Any) -> None:
    """A tracker asked for must be installed, and it needs ddp-app's own logger (trainer.logger unset)."""
    tracking = config.get("tracking") or {}
    asked = [name for name in ("mlflow", "wandb") if tracking.get(name) is not None]
    if tracking.get("tensorboard"):
        asked.append("tensorboard")
    if not asked:
        return
    for name in asked:
        require_tracker(name)
    if config["trainer"].get("logger") not in (None, True):
        raise UserFacingError(
            f"tracking.{asked[0]} and trainer.logger are both set: the tracking section replaces trainer.logger "
            "(one run across restarts). Fix: remove trainer.logger, or remove the tracking section."
        )


def drop_static_graph_for_accumulation(trainer_config: Any) -> str | None:
    """Turn DDP's `static_graph` off when gradients are accumulated; returns a notice, or None if unchanged.

    Lightning skips the all-reduce on accumulation micro-batches with `DistributedDataParallel.no_sync()`,
    which static_graph does not support: the reducer fails an internal assert, and PyTorch reports
    runs where it instead silently stops all-reducing (ranks train apart). static_graph is only a
    speed hint (the gradients are the same without it), so we drop it for this run rather than
    refuse a config we ship. The reference trainer decides the same (`app.reference.config.ddp_arguments`).
    """
    accumulate = trainer_config.get("accumulate_grad_batches") or 1
    strategy = trainer_config.get("strategy")
    init_args = getattr(strategy, "init_args", None)
    if accumulate <= 1 or init_args is None or not init_args.get("static_graph"):
        return None
    init_args["static_graph"] = False
    return (
        f"ddp-app: trainer.accumulate_grad_batches={accumulate} with static_graph: true in "
        "trainer.strategy.init_args: DDP's static graph cannot skip the all-reduce on accumulation steps "
        "(no_sync), so this run uses static_graph=false (a speed hint; same gradients). "
        "Set static_graph: false in the config to silence this."
    )


def apply_collective_timeout(trainer_config: Any, seconds: float, resolved: ResolvedStrategy) -> None:
    """Give the strategy `timeout=collective_timeout_s` through its own argument, before it is built.

    A `class_path` strategy gets it in its `init_args` (unless the config sets a timeout of its
    own); a name (`ddp`, `ddp_spawn`, ..., or `auto` where Lightning would choose `ddp`) becomes
    the registered class with its registered arguments plus the timeout. Strategies without a
    `timeout` argument (single device) are left alone. `resolved`: the run plan's strategy, at the
    run's world size (`strategy: auto` is `ddp` on more than one process).
    """
    timeout = datetime.timedelta(seconds=seconds)
    strategy = trainer_config.get("strategy")
    if isinstance(strategy, str):
        if resolved.registered_name is None:
            return
        entry = StrategyRegistry[resolved.registered_name]
        cls = entry["strategy"]
        if "timeout" in inspect.signature(cls).parameters:
            init_args = Namespace(**{**entry["init_params"], "timeout": timeout})
            trainer_config["strategy"] = Namespace(
                class_path=f"{cls.__module__}.{cls.__qualname__}", init_args=init_args
            )
        return
    class_path = getattr(strategy, "class_path", None)
    if class_path is None:
        return
    module_name, _, class_name = class_path.rpartition(".")
    parameter = inspect.signature(getattr(importlib.import_module(module_name), class_name)).parameters.get("timeout")
    if parameter is None:
        return
    if strategy.get("init_args") is None:
        strategy["init_args"] = Namespace()
    if strategy["init_args"].get("timeout") in (None, parameter.default):
        strategy["init_args"]["timeout"] = timeout


def check_writable(directory: Path) -> None:
    """Fail before training, not at the first checkpoint an hour later. Leaves nothing behind: a
    directory that does not exist yet is made by the run, so the probe goes into its nearest existing
    parent (a refused run creates no empty run directory)."""
    existing = directory
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    try:
        if not existing.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(existing))
        with tempfile.NamedTemporaryFile(dir=existing, prefix=".write-probe-"):
            pass
    except OSError as error:
        raise UserFacingError(
            f"trainer.default_root_dir {directory} is not writable ({error.strerror}). "
            "Fix: choose a directory you can write to."
        ) from error


def command_line_model_keys(args: list[str]) -> list[str]:
    """The model arguments set on the command line: `hidden` for `--model.init_args.hidden 128`
    or `--model.hidden=128` (jsonargparse accepts both)."""
    keys = []
    for arg in args:
        if arg.startswith("--model."):
            path = arg.removeprefix("--model.").partition("=")[0].split(".")
            if path[0] in ("init_args", "dict_kwargs"):
                path = path[1:]
            if path and path[0] not in ("class_path", "help"):
                keys.append(path[0])
    return keys


# Lines said once per process: the launcher's pass and an in-process run both check the same config.
SAID_ONCE: set[str] = set()


def check_data_against_model(config: Any) -> None:
    """The classes on disk against the model's `num_classes`, and an image config on a CPU, before any rank
    starts. A data module that lists its classes cheaply (`classes_on_disk(data_dir)`: ImageFolder's class
    folders, the shard writer's record) is asked: a missing `data_dir` is refused here; a model whose
    `num_classes` init arg is smaller than the classes found is refused in one line (every rank would
    fail at its first batch, "Target 5 is out of bounds"), a larger one gets a warning line. A model
    without such an argument (a user's own) is not checked. Such a config written for GPUs and run on a
    machine without one gets one line naming what to change."""
    data, model, trainer = config.get("data"), config.get("model"), config["trainer"]
    class_path = getattr(data, "class_path", None)
    if not isinstance(class_path, str) or "." not in class_path:
        return
    module_name, _, class_name = class_path.rpartition(".")
    classes_on_disk = getattr(getattr(importlib.import_module(module_name), class_name, None), "classes_on_disk", None)
    if classes_on_disk is None:
        return
    from app.data.image_datasets import check_class_count, cpu_first_run_advice  # imported by the data module

    data_dir = str((getattr(data, "init_args", None) or {}).get("data_dir"))
    classes = classes_on_disk(data_dir)
    num_classes = (getattr(model, "init_args", None) or {}).get("num_classes")
    lines = []
    if classes is not None and isinstance(num_classes, int) and not isinstance(num_classes, bool):
        lines.append(check_class_count(num_classes, classes, f"data.init_args.data_dir {data_dir}"))
    if not on_gpu(trainer):
        processes = resolve_devices(trainer.get("devices", "auto"), trainer.get("accelerator", "auto"))
        lines.append(cpu_first_run_advice(str(trainer.get("precision")), processes, os.cpu_count() or 1))
    for line in lines:
        if line and line not in SAID_ONCE and not already_launched(os.environ):
            SAID_ONCE.add(line)
            print(line, file=sys.stderr, flush=True)
