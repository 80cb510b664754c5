"""Models: bare networks and their losses (`nets`, no Lightning) and the LightningModules that train them.

The LightningModules are imported on first use (`app.models.MLPClassifier`), so that importing
`app.models.nets`, as the reference trainer does, does not import Lightning.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["ClassifierModule", "CNNClassifier", "MLPClassifier", "ResNetClassifier", "ToyRegressor"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("app.models.lightning"), name)
    raise AttributeError(f"module 'app.models' has no attribute {name!r}")
