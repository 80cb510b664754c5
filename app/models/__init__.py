"""Models: bare networks (`nets`) and the LightningModules that train them."""

from app.models.lightning import (
    ClassifierModule,
    CNNClassifier,
    MLPClassifier,
    ResNetClassifier,
    ToyRegressor,
)

__all__ = ["ClassifierModule", "CNNClassifier", "MLPClassifier", "ResNetClassifier", "ToyRegressor"]
