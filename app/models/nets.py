"""Bare `torch.nn.Module` networks and their losses, no Lightning: shared by `app.models.lightning` and the reference
trainer, so parity compares the same modules."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import torchvision
from torch import nn


class ToyNet(nn.Module):
    """The PyTorch DDP tutorial's ToyModel: Linear(10, 10) -> ReLU -> Linear(10, 5)."""

    def __init__(self, in_features: int = 10, hidden: int = 10, out_features: int = 5) -> None:
        super().__init__()
        self.net1 = nn.Linear(in_features, hidden)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(hidden, out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net2(self.relu(self.net1(x)))


class ToyMpNet(nn.Module):
    """The tutorial's ToyMpModel: ToyNet's two halves on two devices (model parallelism).

    DDP wraps it without `device_ids`. On CPU both halves are on "cpu"."""

    def __init__(self, dev0: str | torch.device, dev1: str | torch.device) -> None:
        super().__init__()
        self.dev0 = torch.device(dev0)
        self.dev1 = torch.device(dev1)
        self.net1 = nn.Linear(10, 10).to(self.dev0)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5).to(self.dev1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.net1(x.to(self.dev0)))
        return self.net2(x.to(self.dev1))


class SimpleNet(nn.Module):
    """The tutorials' SimpleNet: flatten -> Linear(in_features, hidden) -> ReLU -> Linear(hidden, 10)."""

    def __init__(self, in_features: int = 784, hidden: int = 256, num_classes: int = 10) -> None:
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden)
        self.relu = nn.ReLU()
        self.fc2 = nn.Linear(hidden, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.relu(self.fc1(torch.flatten(x, 1))))


class ConvNet(nn.Module):
    """The classic two-convolution MNIST network (pytorch/examples mnist/main.py)."""

    def __init__(self, in_channels: int = 1, num_classes: int = 10, dropout: bool = True) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        # Off (Identity, no random draw) where runs must be compared number by number across world sizes: dropout masks
        # come from each rank's generator (docs/resume.md, elastic resume).
        self.dropout1 = nn.Dropout(0.25) if dropout else nn.Identity()
        self.dropout2 = nn.Dropout(0.5) if dropout else nn.Identity()
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.conv1(x))
        x = torch.relu(self.conv2(x))
        x = self.dropout1(torch.max_pool2d(x, 2))
        x = self.dropout2(torch.relu(self.fc1(torch.flatten(x, 1))))
        return self.fc2(x)


# The first layers of resnet18: "cifar" for 32x32 (or 64x64) inputs, "imagenet" for 224x224.
Stem = Literal["cifar", "imagenet"]


def resnet18_cifar(num_classes: int = 10) -> nn.Module:
    """torchvision resnet18 for 32x32 inputs: 3x3 stem, no max-pool (the ImageNet stem would shrink the image to 8x8
    before the first block)."""
    model = torchvision.models.resnet18(weights=None, num_classes=num_classes)
    model.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()
    return model


def resnet18(num_classes: int = 10, stem: Stem = "cifar") -> nn.Module:
    """resnet18 with the `stem` for its input size: "cifar" (`resnet18_cifar`), or "imagenet", torchvision's own (7x7
    stride-2 convolution and a 3x3 stride-2 max-pool: a 224x224 image reaches the first block as 56x56, where the CIFAR
    stem would run the blocks at 224x224, 16x the cost)."""
    if stem == "imagenet":
        return torchvision.models.resnet18(weights=None, num_classes=num_classes)
    if stem == "cifar":
        return resnet18_cifar(num_classes)
    raise ValueError(f"model.init_args.stem must be 'cifar' or 'imagenet', got {stem!r}.")


@dataclass
class TrainingParts:
    """What a LightningModule trains, without Lightning: the bare network and its loss, built by the same function the
    reference trainer calls, so both get identical modules (and, seeded alike, weights)."""

    net: nn.Module
    criterion: nn.Module
    channels_last: bool = False  # inputs go in NHWC layout, as the weights are stored


def mlp_classifier_parts(in_features: int = 64, hidden: int = 256, num_classes: int = 10) -> TrainingParts:
    return TrainingParts(SimpleNet(in_features, hidden, num_classes), nn.CrossEntropyLoss())


def cnn_classifier_parts(in_channels: int = 1, num_classes: int = 10, dropout: bool = True) -> TrainingParts:
    return TrainingParts(ConvNet(in_channels, num_classes, dropout), nn.CrossEntropyLoss())


def resnet_classifier_parts(num_classes: int = 10, channels_last: bool = False, stem: Stem = "cifar") -> TrainingParts:
    net = resnet18(num_classes, stem)
    if channels_last:
        net = net.to(memory_format=torch.channels_last)
    return TrainingParts(net, nn.CrossEntropyLoss(), channels_last)


def toy_regressor_parts(in_features: int = 10, hidden: int = 10, out_features: int = 5) -> TrainingParts:
    return TrainingParts(ToyNet(in_features, hidden, out_features), nn.MSELoss())


# LightningModule class name (the last part of a config's `model.class_path`) -> its parts, with the same arguments and
# defaults as the module's `__init__` (tests/models/test_parts.py checks).
PARTS: dict[str, Callable[..., TrainingParts]] = {
    "MLPClassifier": mlp_classifier_parts,
    "CNNClassifier": cnn_classifier_parts,
    "ResNetClassifier": resnet_classifier_parts,
    "ToyRegressor": toy_regressor_parts,
}
