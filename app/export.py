"""Export a trained model from a Lightning checkpoint, for use without Lightning.

    python -m app.export --ckpt runs/digits/checkpoints/last.ckpt --out model.pt
    python -m app.export --ckpt runs/digits/checkpoints/last.ckpt --out model.pt2 --format exported-program

A sharded checkpoint (strategy fsdp, docs/fsdp.md) exports with `--format state-dict`: its shards are
joined into whole tensors in this one process.

`--format state-dict` (the default) writes a plain `state_dict` (no pickled classes): the bare network's
weights (keys `net.*` without the prefix) when the LightningModule has a `net` attribute, else the
module's own weights. Load it into the same architecture with
`net.load_state_dict(torch.load("model.pt", weights_only=True))`.

`--format exported-program` writes a `torch.export` ExportedProgram: the module's `forward` in eval
mode, traced with a sample batch from the DataModule, that loads without this project or the
model's Python code: `torch.export.load("model.pt2").module()(x)`. The batch dimension is dynamic
(any batch size). The model and DataModule are rebuilt from, in this order: `--config` (the run's
YAML), the checkpoint's hyperparameters (LightningCLI stores the model's `_class_path` there when
the module calls `save_hyperparameters`), and the `config.yaml` LightningCLI wrote into the run's
log directory (`<default_root_dir>/lightning_logs/version_N/config.yaml`, the newest one).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch
import yaml

from app.checkpoints import state as checkpoint_state
from app.checkpoints.io import (
    CLI_CLASS_PATH_KEY,
    CheckpointError,
    atomic_write,
    check_compatible,
    export_state_dict,
    exportable_state_dict,
    safe_load,
)
from app.checkpoints.sharded import META_NAME, is_sharded_checkpoint, load_full_tensors
from app.errors import UserFacingError

FORMATS = ("state-dict", "exported-program")


class ExportError(UserFacingError):
    """The model, its data or its forward pass cannot be exported; the message says why and what to do."""


def config_from_hyperparameters(hyper_parameters: dict[str, Any]) -> dict[str, Any] | None:
    """`{"class_path", "init_args"}` from hyperparameters saved under LightningCLI, or None without a class path."""
    if CLI_CLASS_PATH_KEY not in hyper_parameters:
        return None
    init_args = {key: value for key, value in hyper_parameters.items() if not key.startswith("_")}
    return {"class_path": hyper_parameters[CLI_CLASS_PATH_KEY], "init_args": init_args}


def logged_run_config(ckpt_path: Path) -> Path | None:
    """The newest `config.yaml` LightningCLI saved beside the run whose checkpoint is `ckpt_path`.

    ddp-app writes checkpoints to `<root>/checkpoints/` and logs to `<root>/<name>/<version>/`."""
    directory = ckpt_path.resolve().parent
    if directory.name != "checkpoints":  # not a run's checkpoint directory: its parent is no run
        return None
    found = list(directory.parent.glob("*/*/config.yaml"))
    return max(found, key=lambda path: path.stat().st_mtime) if found else None


def read_yaml_config(path: Path) -> dict[str, Any]:
    try:
        config = yaml.safe_load(path.read_text())
    except OSError as error:
        raise ExportError(f"cannot read --config {path}: {error.strerror}. Fix: name the run's YAML file.") from error
    except yaml.YAMLError as error:
        raise ExportError(f"--config {path} is not valid YAML ({' '.join(str(error).split())[:200]}).") from error
    if not isinstance(config, dict):
        raise ExportError(f"--config {path} is not a LightningCLI config (no 'model:' and 'data:' keys).")
    return config


def model_and_data_config(
    ckpt_path: Path, checkpoint: dict[str, Any], config_path: Path | None
) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
    """The `model` and `data` sections to build, and where each came from (for the summary line)."""
    sources: list[tuple[str, dict[str, Any]]] = []
    if config_path is not None:
        sources.append((str(config_path), read_yaml_config(config_path)))
    from_checkpoint = {
        "model": config_from_hyperparameters(checkpoint.get("hyper_parameters") or {}),
        "data": config_from_hyperparameters(checkpoint.get("datamodule_hyper_parameters") or {}),
    }
    sources.append(("the checkpoint's hyperparameters", from_checkpoint))
    logged = logged_run_config(ckpt_path)
    if logged is not None:
        sources.append((str(logged), read_yaml_config(logged)))
    sections = []
    for key in ("model", "data"):
        found = next(((name, config[key]) for name, config in sources if config.get(key)), None)
        if found is None:
            raise ExportError(
                f"cannot tell which {key} class {ckpt_path} was trained with: no --config, no class path in the "
                "checkpoint's hyperparameters and no config.yaml in the run's log directory. "
                "Fix: pass --config with the YAML the run was trained with."
            )
        sections.append(found)
    (model_source, model_config), (data_source, data_config) = sections
    return model_config, data_config, [model_source, data_source]


def build_model_and_data(model_config: Any, data_config: Any) -> tuple[torch.nn.Module, Any]:
    """Instantiate the LightningModule and LightningDataModule as LightningCLI would from YAML."""
    import lightning as L
    from jsonargparse import ArgumentParser

    import app.data  # noqa: F401  (registers short class names, as in `ddp-app`)
    import app.models  # noqa: F401

    parser = ArgumentParser(exit_on_error=False)
    parser.add_subclass_arguments(L.LightningModule, "model", fail_untyped=False)
    parser.add_subclass_arguments(L.LightningDataModule, "data", fail_untyped=False)
    try:
        parsed = parser.parse_object({"model": model_config, "data": data_config})
        # jsonargparse 4.49 renamed `instantiate_classes` to `instantiate` (the old name warns); we allow >= 4.32.
        instantiate = getattr(parser, "instantiate", None) or parser.instantiate_classes
        built = instantiate(parsed)
    except Exception as error:
        first = " ".join(str(error).split())[:300]
        raise ExportError(
            f"could not build the model and data from the run's config ({first}). Fix: run from the directory "
            "where the model's module is importable (or set PYTHONPATH), or pass --config with the run's YAML."
        ) from error
    return built.model, built.data


def sample_input(datamodule: Any) -> torch.Tensor:
    """The inputs of one training batch: a tensor batch, or the first element of a (inputs, targets) batch."""
    datamodule.prepare_data()
    datamodule.setup("fit")
    batch = next(iter(datamodule.train_dataloader()))
    inputs = batch[0] if isinstance(batch, (tuple, list)) else batch
    if not isinstance(inputs, torch.Tensor):
        raise ExportError(
            f"the DataModule's batches are {type(batch).__name__}, and their inputs are not one tensor "
            "(expected a tensor or a tuple (inputs, targets)). Fix: export with --format state-dict."
        )
    # torch.export specialises a dimension of size 1 to a constant, so a dynamic batch needs >= 2 samples.
    return inputs[:2] if len(inputs) >= 2 else torch.cat([inputs, inputs])


def export_program(module: torch.nn.Module, inputs: torch.Tensor) -> torch.export.ExportedProgram:
    """`torch.export.export` of the module's forward, with a dynamic batch dimension."""
    batch = torch.export.Dim("batch")
    try:
        with torch.no_grad():
            return torch.export.export(module, (inputs,), dynamic_shapes=({0: batch},))
    except Exception as error:
        first = " ".join(str(error).split())[:300]
        raise ExportError(
            f"torch.export could not trace {type(module).__name__}.forward on an input of shape "
            f"{tuple(inputs.shape)} ({first}). Fix: make forward traceable (no data-dependent Python control "
            "flow, no batch-size-dependent code), or export with --format state-dict."
        ) from error


def export_exported_program(ckpt_path: Path, out_path: Path, config_path: Path | None) -> str:
    """Write the `.pt2` file; returns the summary line."""
    if is_sharded_checkpoint(ckpt_path):  # strategy fsdp: its shards joined whole in this process
        checkpoint = {**safe_load(ckpt_path / META_NAME), "state_dict": load_full_tensors(ckpt_path)}
    else:
        checkpoint = safe_load(ckpt_path)
    state = checkpoint.get("state_dict")
    if not isinstance(state, dict):
        raise CheckpointError("this file is not a Lightning checkpoint (it has no 'state_dict').")
    exportable_state_dict(checkpoint, str(ckpt_path))  # the same "nothing to export" error as state-dict
    model_config, data_config, sources = model_and_data_config(ckpt_path, checkpoint, config_path)
    # Where the run imported the user's classes from (`ddp-app` records it), then beside --config.
    directories = (checkpoint_state.get(checkpoint, "exact_resume") or {}).get("user_code_directories") or []
    recorded = [str(path) for path in directories if Path(path).is_dir()]
    config_directories = [str(config_path.resolve().parent)] if config_path is not None else []
    sys.path[:0] = [path for path in dict.fromkeys(config_directories + recorded) if path not in sys.path]
    module, datamodule = build_model_and_data(model_config, data_config)
    check_compatible(module, state, str(ckpt_path))
    module.load_state_dict(state)
    module.eval()
    inputs = sample_input(datamodule)
    program = export_program(module, inputs)
    atomic_write(out_path, lambda file: torch.export.save(program, file))
    return (
        f"wrote {out_path}: torch.export ExportedProgram of {type(module).__module__}.{type(module).__name__} "
        f"(eval mode), input (batch, {', '.join(map(str, inputs.shape[1:]))}) {inputs.dtype} with a dynamic batch; "
        f"model from {sources[0]}, data from {sources[1]}. "
        f"Load: torch.export.load({str(out_path)!r}).module()(x)"
    )


def export_sharded_state_dict(ckpt_path: Path, out_path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """`--format state-dict` of a sharded checkpoint (app/checkpoints/sharded.py): every weight joined whole in this
    process, no process group; the same file a single-file checkpoint exports to."""
    state = exportable_state_dict({"state_dict": load_full_tensors(ckpt_path)}, str(ckpt_path))
    atomic_write(out_path, lambda file: torch.save(state, file))
    return state, safe_load(ckpt_path / META_NAME).get("hyper_parameters", {})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m app.export", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ckpt", required=True, help="a Lightning checkpoint (.ckpt)")
    parser.add_argument("--out", required=True, help="where to write the model (.pt for state-dict, .pt2)")
    parser.add_argument("--format", choices=FORMATS, default="state-dict", help="what to write (default state-dict)")
    parser.add_argument(
        "--config", type=Path, help="exported-program: the YAML the run was trained with (default: found from the run)"
    )
    args = parser.parse_args(argv)
    try:
        if args.format == "exported-program":
            print(export_exported_program(Path(args.ckpt), Path(args.out), args.config))
            return
        if is_sharded_checkpoint(args.ckpt):  # strategy fsdp: every rank's shards, joined here
            state, hyper_parameters = export_sharded_state_dict(Path(args.ckpt), Path(args.out))
        else:
            state = export_state_dict(args.ckpt, args.out)
            hyper_parameters = safe_load(args.ckpt).get("hyper_parameters", {})
    except UserFacingError as error:
        print(f"app.export: error: {' '.join(str(error).split())}", file=sys.stderr)
        raise SystemExit(2) from None
    tensors = sum(value.numel() for value in state.values())
    print(f"wrote {args.out}: {len(state)} tensors, {tensors} numbers; model arguments {dict(hyper_parameters)}")


if __name__ == "__main__":
    main()
