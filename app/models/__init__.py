"""Models: bare networks and their losses (`nets`, no Lightning) and the LightningModules that train them.

The LightningModules are imported on first use (`app.models.MLPClassifier`), so that importing `app.models.nets`, as the
reference trainer does, does not import Lightning."""

from __future__ import annotations

import importlib
from typing import Any

# Public name -> the module that defines it.
MODULES = {
    "ClassifierModule": "app.models.lightning",
    "CNNClassifier": "app.models.lightning",
    "MLPClassifier": "app.models.lightning",
    "ResNetClassifier": "app.models.lightning",
    "ToyRegressor": "app.models.lightning",
    "GPTLanguageModel": "app.models.gpt",
}

__all__ = sorted(MODULES)


def __getattr__(name: str) -> Any:
    if name in MODULES:
        return getattr(importlib.import_module(MODULES[name]), name)
    raise AttributeError(f"module 'app.models' has no attribute {name!r}")
