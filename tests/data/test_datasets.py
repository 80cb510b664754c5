"""The reference builds the same datasets as each DataModule, without Lightning."""

from __future__ import annotations

import inspect
from dataclasses import fields

import pytest
import torch

import app.data
from app.data.datasets import DATASETS, LoaderSettings
from app.reference.config import build_job, load_config


@pytest.mark.parametrize("name", sorted(DATASETS))
def test_dataset_functions_take_the_data_modules_arguments(name: str) -> None:
    module_cls = getattr(app.data, name)
    own = {key: p.default for key, p in inspect.signature(module_cls.__init__).parameters.items()}
    own = {key: value for key, value in own.items() if key not in ("self", "loader_options")}
    function = {key: p.default for key, p in inspect.signature(DATASETS[name]).parameters.items()}
    assert own == function, f"{name} and DATASETS[{name!r}] drifted apart"
    loader = {key: p.default for key, p in inspect.signature(app.data.ShardedDataModule.__init__).parameters.items()}
    assert {key: value for key, value in loader.items() if key != "self"} == {
        field.name: field.default for field in fields(LoaderSettings)
    }


@pytest.mark.parametrize("config", ["configs/digits.yaml", "configs/toy.yaml", "configs/bench_cnn.yaml"])
def test_same_splits_as_the_data_module(config: str) -> None:
    spec = load_config(config)
    job = build_job(spec)
    name = spec["data"]["class_path"].rpartition(".")[2]
    datamodule = getattr(app.data, name)(**spec["data"]["init_args"])
    datamodule.setup("fit")
    for ours, theirs in zip(
        (job.train_dataset, job.val_dataset, job.test_dataset),
        (datamodule.train_dataset, datamodule.val_dataset, datamodule.test_dataset),
        strict=True,
    ):
        assert len(ours) == len(theirs)
        for index in (0, len(ours) - 1):
            for a, b in zip(ours[index], theirs[index], strict=True):
                assert torch.equal(torch.as_tensor(a), torch.as_tensor(b))
    assert (job.batch_size, job.shuffle, job.sampler_seed) == (
        datamodule.batch_size,
        datamodule.shuffle,
        datamodule.seed,
    )
