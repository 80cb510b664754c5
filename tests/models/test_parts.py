"""The reference builds the same bare network and loss as each LightningModule, without Lightning."""

from __future__ import annotations

import inspect

import pytest
import torch

import app.models
from app.models.nets import PARTS
from app.reference.config import build_parts, seed_everything


@pytest.mark.parametrize("name", sorted(PARTS))
def test_parts_take_the_modules_arguments(name: str) -> None:
    module_parameters = inspect.signature(getattr(app.models, name).__init__).parameters
    parts_parameters = inspect.signature(PARTS[name]).parameters
    module_defaults = {key: p.default for key, p in module_parameters.items() if key != "self"}
    parts_defaults = {key: p.default for key, p in parts_parameters.items()}
    assert module_defaults == parts_defaults, f"{name} and PARTS[{name!r}] drifted apart"


@pytest.mark.parametrize(
    ("name", "init_args"),
    [
        ("MLPClassifier", {"in_features": 64, "hidden": 32}),
        ("CNNClassifier", {}),
        ("ToyRegressor", {}),
        ("ResNetClassifier", {"channels_last": True}),
    ],
)
def test_same_seed_same_weights_as_the_lightning_module(name: str, init_args: dict) -> None:
    seed_everything(7)
    module = getattr(app.models, name)(**init_args)
    seed_everything(7)
    parts = build_parts({"class_path": f"app.models.{name}", "init_args": init_args})
    expected = module.net.state_dict()
    assert list(parts.net.state_dict()) == list(expected)
    for key, tensor in parts.net.state_dict().items():
        assert torch.equal(tensor, expected[key]), key
        assert tensor.stride() == expected[key].stride(), f"{key}: memory format differs"
    assert type(parts.criterion) is type(module.criterion)
    assert parts.channels_last == getattr(module, "channels_last", False)


def test_unknown_model_is_named() -> None:
    with pytest.raises(ValueError, match="MyModel"):
        build_parts({"class_path": "mypackage.MyModel"})
