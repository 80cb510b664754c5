"""The Trainer's arguments, checked once in the launcher before any rank starts.

`check_trainer_arguments` builds the Trainer as every rank will (milliseconds): whatever Lightning or PyTorch raises
becomes one line naming the key, found by rebuilding with one argument at a time back at its default. Errors from
outside Lightning and PyTorch, or that no single argument explains, keep their traceback. The build starts no process
and touches no GPU (NVML check); its side effects are put back or kept quiet."""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import traceback
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import lightning
import torch
from jsonargparse import Namespace

from app.errors import TrainerArgumentError

# Left out of the check's Trainer: they choose nothing about devices, strategy or precision, and building them can run a
# user's code or prepare to write (loggers); every rank still builds them.
LEFT_OUT: dict[str, Any] = {
    "callbacks": None,
    "logger": False,
    "profiler": None,
    "enable_checkpointing": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
}

# The values Lightning's Trainer accepts when it is built and only fails on later, in every rank (0 for
# accumulate_grad_batches, val_check_interval or check_val_every_n_epoch: a ZeroDivisionError at the first step or epoch
# end), or silently ignores (a negative gradient_clip_val: no clipping; a negative log_every_n_steps: a log line every
# step). Everything else Lightning checks itself. key: (lowest value, whether that value is allowed, what the key means)
LOWER_BOUNDS: dict[str, tuple[float, bool, str]] = {
    "accumulate_grad_batches": (1, True, "a number of batches per optimizer step (1: no accumulation)"),
    "check_val_every_n_epoch": (1, True, "a number of epochs (null: validate every val_check_interval batches)"),
    "val_check_interval": (0, False, "a fraction of an epoch in (0, 1] or a number of batches"),
    "log_every_n_steps": (0, True, "a number of steps (0: no logging within an epoch)"),
    "gradient_clip_val": (0, True, "the norm (or value) to clip gradients at (0 or null: no clipping)"),
}

# Where an error must have been raised to count as Lightning's (or PyTorch's) verdict on an input.
LIBRARY_DIRECTORIES = (Path(lightning.__file__).parent, Path(torch.__file__).parent)


def check_lower_bounds(trainer_config: Mapping[str, Any]) -> None:
    """The values in LOWER_BOUNDS that Lightning would take now and fail on during training."""
    for key, (lowest, inclusive, meaning) in LOWER_BOUNDS.items():
        value = trainer_config.get(key)
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            continue
        if value > lowest or (inclusive and value == lowest):
            continue
        bound = f">= {lowest}" if inclusive else f"> {lowest}"
        raise TrainerArgumentError(
            f"invalid value {value!r} for trainer.{key}: it must be {bound} ({meaning}); Lightning would take it "
            f"here and then fail on it, or ignore it, during training. Fix: set trainer.{key} {bound}, or leave it "
            f"out for Lightning's default ({trainer_default(key)!r})."
        )


def trainer_default(key: str) -> Any:
    """Lightning's default for a Trainer argument."""
    return inspect.signature(lightning.pytorch.Trainer.__init__).parameters[key].default


def check_trainer_arguments(
    instantiate: Callable[[], Mapping[str, Any]],
    trainer_config: Mapping[str, Any],
    overrides: Mapping[str, Any] | None = None,
    trainer_class: type = lightning.pytorch.Trainer,
) -> None:
    """Build the Trainer as the ranks will; raise TrainerArgumentError naming the key Lightning refuses.

    `instantiate` builds the section's classes fresh per call (Lightning changes a strategy it is given);
    `trainer_config` is the section as parsed; `overrides` are what the ranks get instead (the launcher's devices on
    CPU)."""
    check_lower_bounds(trainer_config)
    given = {**(overrides or {}), **LEFT_OUT}

    def build(reset: str | None = None) -> None:
        arguments = {**instantiate(), **given}
        if reset is not None:
            arguments[reset] = trainer_default(reset)
        with quiet_and_without_cuda():
            trainer_class(**arguments)

    try:
        build()
    except Exception as error:
        explained = explain(error, build, trainer_config, given)
        if explained is None:
            raise
        raise explained from error


def explain(
    error: Exception,
    build: Callable[[str | None], None],
    trainer_config: Mapping[str, Any],
    given: Mapping[str, Any],
) -> TrainerArgumentError | None:
    """The one-line error for Lightning's refusal, or None (a bug, or no single key explains it)."""
    if not raised_in_a_library(error):
        return None
    reason = " ".join(str(error).split()) or type(error).__name__
    signature = (type(error), str(error))
    culprits = []
    for key in keys_set(trainer_config, given):
        try:
            build(key)
        except Exception as other:
            if (type(other), str(other)) == signature:
                continue  # this key's default changes nothing: not the cause
        culprits.append(key)
    named = [key for key in culprits if key in reason]
    culprits = named or culprits
    if not culprits:
        return None
    if not reason.endswith((".", "!", "?")):
        reason += "."
    if len(culprits) == 1:
        key = culprits[0]
        return TrainerArgumentError(
            f"invalid value {shown(trainer_config, given, key)!r} for trainer.{key}: {reason} Fix: give trainer.{key} "
            f"a value Lightning accepts there, or leave it out for its default ({trainer_default(key)!r})."
        )
    values = ", ".join(f"trainer.{key}={shown(trainer_config, given, key)!r}" for key in culprits)
    return TrainerArgumentError(
        f"invalid combination {values}: {reason} Fix: change one of them (Lightning's defaults: "
        + ", ".join(f"{key}={trainer_default(key)!r}" for key in culprits)
        + ")."
    )


def raised_in_a_library(error: BaseException) -> bool:
    """Raised by Lightning's or PyTorch's own code (its last frame), not ours or a user's."""
    frames = traceback.extract_tb(error.__traceback__)
    if not frames:
        return False
    where = Path(frames[-1].filename).resolve()
    return any(where.is_relative_to(directory.resolve()) for directory in LIBRARY_DIRECTORIES)


def keys_set(trainer_config: Mapping[str, Any], given: Mapping[str, Any]) -> list[str]:
    """The Trainer arguments this run sets to something other than Lightning's default, in signature order."""
    parameters = inspect.signature(lightning.pytorch.Trainer.__init__).parameters
    keys = []
    for key, parameter in parameters.items():
        if key == "self" or key in LEFT_OUT or parameter.kind is not inspect.Parameter.KEYWORD_ONLY:
            continue
        value = given.get(key, trainer_config.get(key, parameter.default))
        if value is not parameter.default and value != parameter.default:
            keys.append(key)
    return keys


def shown(trainer_config: Mapping[str, Any], given: Mapping[str, Any], key: str) -> Any:
    """A value as the user wrote it: a class by its class_path."""
    value = given.get(key, trainer_config.get(key))
    if isinstance(value, Namespace) and "class_path" in value:
        return value["class_path"]
    if isinstance(value, list):
        return [shown({key: item}, {}, key) for item in value]
    return value


@contextlib.contextmanager
def quiet_and_without_cuda() -> Iterator[None]:
    """Keep a Trainer's construction from changing this process: no log lines or warnings (each rank prints its own), no
    CUDA initialised (`torch.cuda.is_available` through NVML: a CUDA context does not survive the fork of the ranks),
    and torch's flags and the environment as they were."""
    environment = dict(os.environ)
    deterministic = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    benchmark = torch.backends.cudnn.benchmark
    logging_disabled = logging.root.manager.disable
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
    logging.disable(logging.CRITICAL)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.disable(logging_disabled)
        torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
        torch.backends.cudnn.benchmark = benchmark
        for name in set(os.environ) - set(environment):
            del os.environ[name]
        os.environ.update({name: value for name, value in environment.items() if os.environ.get(name) != value})
