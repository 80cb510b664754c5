"""Read the same YAML that drives `ddp-app` and build what the reference trainer needs: the bare network and loss
(`app.models.nets`) and datasets (`app.data.datasets`); the loop is its own. No Lightning.
"""

from __future__ import annotations

import importlib
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml
from torch import nn
from torch.utils.data import Dataset

from app.data.datasets import DATASETS, DOWNLOADS, LoaderSettings
from app.data.image_datasets import imagefolder_splits
from app.models.nets import PARTS, TrainingParts
from app.reference.diloco import diloco_settings

# DataModule class name -> its splits: `app.data.datasets.DATASETS`, and the ImageFolder's, whose module imports
# app.data.datasets (so it cannot be listed there).
SPLITS = {**DATASETS, "ImageFolderDataModule": imagefolder_splits}


def load_config(path: str | Path) -> dict[str, Any]:
    with open(path) as file:
        config = yaml.safe_load(file)
    if not isinstance(config, dict):
        raise ValueError(f"{path} is not a YAML mapping of config keys.")
    return config


def instantiate(spec: dict[str, Any], *args: Any) -> Any:
    """Build `class_path(*args, **init_args)`, as LightningCLI does for the same YAML entry."""
    module_name, _, class_name = spec["class_path"].rpartition(".")
    cls = getattr(importlib.import_module(module_name), class_name)
    return cls(*args, **(spec.get("init_args") or {}))


def seed_everything(seed: int) -> None:
    """The same generators Lightning's `seed_everything` seeds, so both build identical weights."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


# The DDPStrategy arguments that are DistributedDataParallel's own: the reference wraps its model with the same ones, so
# that both sides run the same DDP and a benchmark compares the trainers.
DDP_ARGUMENTS = ("bucket_cap_mb", "gradient_as_bucket_view", "static_graph", "find_unused_parameters")
PRECISIONS = ("32-true", "32", "bf16-mixed")


def accumulation_steps_of(trainer_config: dict[str, Any]) -> int:
    """`trainer.accumulate_grad_batches`: micro-batches per optimizer step (1: no accumulation)."""
    return int(trainer_config.get("accumulate_grad_batches") or 1)


def ddp_arguments(trainer_config: dict[str, Any]) -> dict[str, Any]:
    """`trainer.strategy.init_args` entries that DistributedDataParallel takes (strategy: ddp has none)."""
    strategy = trainer_config.get("strategy")
    init_args = (strategy.get("init_args") or {}) if isinstance(strategy, dict) else {}
    kwargs = {key: init_args[key] for key in DDP_ARGUMENTS if key in init_args}
    if accumulation_steps_of(trainer_config) > 1 and kwargs.get("static_graph"):
        # no_sync() on accumulation steps does not work with static_graph; ddp-app drops it for such a run too
        # (app/run/config_checks.py `drop_static_graph_for_accumulation`), so both run the same DDP.
        kwargs["static_graph"] = False
    return kwargs


COMPRESSION_METHODS = ("none", "fp16", "bf16", "powersgd")


def compression_of(config: dict[str, Any]) -> dict[str, Any]:
    """The config's `gradient_compression:` (method none when absent), with ddp-app's defaults."""
    settings = {"method": "none", "powersgd_rank": 4, "start_iter": 10, "warm_start": True, "error_feedback": True}
    settings.update(
        {key: value for key, value in (config.get("gradient_compression") or {}).items() if key in settings}
    )
    if settings["method"] not in COMPRESSION_METHODS:
        raise ValueError(
            f"the reference trainer runs gradient_compression.method {', '.join(COMPRESSION_METHODS)}, not "
            f"{settings['method']!r}: auto picks from step times measured inside ddp-app. Fix: name a method."
        )
    return settings


def precision_of(trainer_config: dict[str, Any]) -> str:
    precision = str(trainer_config.get("precision", "32-true"))
    if precision not in PRECISIONS:
        raise ValueError(
            f"the reference trainer supports trainer.precision {', '.join(PRECISIONS)}, not {precision!r}. "
            "Fix: use one of those for a reference run (fp16 would also need a GradScaler)."
        )
    return precision


@dataclass
class Job:
    """What one training run needs, read from a config."""

    net: nn.Module
    criterion: nn.Module
    train_dataset: Dataset
    val_dataset: Dataset
    test_dataset: Dataset
    batch_size: int
    shuffle: bool
    sampler_seed: int
    num_workers: int | None  # None: sized to the machine (app.data.datasets.default_num_workers)
    pin_memory: bool | None  # None: pin when training on a GPU
    persistent_workers: bool
    channels_last: bool  # inputs in NHWC layout, as the LightningModule's weights
    precision: str  # "32-true" or "bf16-mixed" (autocast around the forward pass)
    deterministic: bool | str  # trainer.deterministic: True, "warn" or False/None
    accumulation_steps: int  # trainer.accumulate_grad_batches
    ddp_kwargs: dict[str, Any]
    compression: dict[str, Any]  # gradient_compression: method, powersgd_rank, start_iter, ...
    diloco: dict[str, Any] | None  # strategy: diloco's settings (app/reference/diloco.py), None otherwise
    config: dict[str, Any]

    def optimizer(self, params) -> torch.optim.Optimizer:
        spec = self.config.get("optimizer") or {"class_path": "torch.optim.SGD", "init_args": {"lr": 0.001}}
        return instantiate(spec, params)

    def scheduler(self, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler | None:
        spec = self.config.get("lr_scheduler")
        return instantiate(spec, optimizer) if spec else None


def class_name(spec: dict[str, Any], key: str, known: dict[str, Any]) -> str:
    """The class a config's `model:` or `data:` entry names, if the reference knows how to build it."""
    name = spec["class_path"].rpartition(".")[2]
    if name not in known:
        raise ValueError(
            f"the reference trainer builds {key}.class_path {', '.join(known)}, not {spec['class_path']!r}. "
            f"Fix: add its bare parts to {'app.models.nets.PARTS' if key == 'model' else 'app.data.datasets.DATASETS'}."
        )
    return name


def build_parts(model: dict[str, Any]) -> TrainingParts:
    """The bare network and loss that the config's LightningModule would build, without it."""
    return PARTS[class_name(model, "model", PARTS)](**(model.get("init_args") or {}))


def build_job(config: dict[str, Any]) -> Job:
    """Seed, then build the network and datasets in the order LightningCLI does (model, then data)."""
    seed_everything(int(config.get("seed_everything", 0)))
    parts = build_parts(config["model"])
    data = config["data"]
    loader, dataset_args = LoaderSettings.split_off(data.get("init_args") or {})
    train_dataset, val_dataset, test_dataset = SPLITS[class_name(data, "data", SPLITS)](**dataset_args)
    return Job(
        net=parts.net,
        criterion=parts.criterion,
        train_dataset=train_dataset,
        val_dataset=val_dataset,
        test_dataset=test_dataset,
        batch_size=loader.batch_size,
        shuffle=loader.shuffle,
        sampler_seed=loader.seed,
        num_workers=loader.num_workers,
        pin_memory=loader.pin_memory,
        persistent_workers=loader.persistent_workers,
        channels_last=parts.channels_last,
        precision=precision_of(config.get("trainer") or {}),
        deterministic=(config.get("trainer") or {}).get("deterministic") or False,
        accumulation_steps=accumulation_steps_of(config.get("trainer") or {}),
        ddp_kwargs=ddp_arguments(config.get("trainer") or {}),
        compression=compression_of(config),
        diloco=diloco_settings(config.get("trainer") or {}),
        config=config,
    )


def prepare_data(config: dict[str, Any]) -> None:
    """Download once, before any worker starts (what the DataModule's own `prepare_data` does)."""
    download = DOWNLOADS.get(class_name(config["data"], "data", SPLITS))
    if download is not None:
        download(**(config["data"].get("init_args") or {}))
