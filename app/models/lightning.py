"""LightningModules: thin wrappers that give a bare network (`self.net`) and loss (`self.criterion`), both built in
`app.models.nets`, metrics and logging. Optimizers and schedulers come from LightningCLI's `optimizer:` /
`lr_scheduler:` keys."""

from __future__ import annotations

import lightning as L
import torch
from torchmetrics import MeanMetric
from torchmetrics.classification import MulticlassAccuracy

from app.models.nets import (
    Stem,
    TrainingParts,
    cnn_classifier_parts,
    mlp_classifier_parts,
    resnet_classifier_parts,
    toy_regressor_parts,
)


def logs_this_step(module: L.LightningModule) -> bool:
    """Whether the loggers write this training step (every `trainer.log_every_n_steps`, mirroring Lightning's
    `should_update_logs`): `self.log` is costly, so per-step values are logged only then (docs/performance.md)."""
    trainer = module.trainer
    if trainer.log_every_n_steps == 0:  # logging off: the progress bar still shows the loss
        return True
    return (module.global_step + 1) % trainer.log_every_n_steps == 0 or trainer.should_stop


def log_step_loss(module: L.LightningModule, loss: torch.Tensor) -> None:
    """Log a training step's loss for the loggers and progress bar as a host copy: Lightning reads every progress-bar
    value as a float after every batch, which would wait for the GPU each step."""
    module.log("train_loss", loss.detach().to("cpu", copy=True), prog_bar=True)


class QuickHookBookkeeping(L.LightningModule):
    """A LightningModule whose per-hook `_current_fx_name` bookkeeping skips `nn.Module.__setattr__`'s checks (a str or
    None needs none; cost: docs/bench_per_call.json, "hook name")."""

    def __setattr__(self, name: str, value: object) -> None:
        if name == "_current_fx_name":
            object.__setattr__(self, name, value)
        else:
            super().__setattr__(name, value)


class ClassifierModule(QuickHookBookkeeping):
    """Cross-entropy classification with exact, distributed accuracy and loss.

    Accuracy and evaluation loss are counts and weighted sums summed across ranks once per epoch: the number a single
    process would compute, at any world size. Training keeps its two counts in plain tensors (a torchmetrics `update`
    costs several times more per step; docs/performance.md); metrics are logged in the epoch-end hooks."""

    def __init__(self, parts: TrainingParts, num_classes: int) -> None:
        super().__init__()
        self.net = parts.net
        self.criterion = parts.criterion
        self.channels_last = parts.channels_last
        # Not buffers: DDP would broadcast those from rank 0 before every forward pass.
        self._train_correct = torch.zeros((), dtype=torch.long)
        self._train_seen = torch.zeros((), dtype=torch.long)
        self.val_acc = MulticlassAccuracy(num_classes=num_classes, average="micro")
        self.test_acc = MulticlassAccuracy(num_classes=num_classes, average="micro")
        self.val_loss = MeanMetric()
        self.test_loss = MeanMetric()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        logits = self.net(inputs)
        loss = self.criterion(logits, targets)
        self._train_correct += (logits.detach().argmax(dim=1) == targets).sum()
        self._train_seen += targets.numel()
        # The step loss is this rank's own (no all-reduce per step: that would cost a collective every step just for the
        # progress bar); accuracy is reduced across ranks at epoch end.
        if logs_this_step(self):
            log_step_loss(self, loss)
        return loss

    def on_train_epoch_start(self) -> None:
        self._train_correct = torch.zeros((), dtype=torch.long, device=self.device)
        self._train_seen = torch.zeros((), dtype=torch.long, device=self.device)

    def per_rank_state(self) -> dict[str, torch.Tensor]:
        """This rank's training counts of the running epoch: `ExactResume` keeps them in checkpoints (per rank), so an
        epoch resumed in its middle reports the accuracy of all its batches."""
        return {"train_correct": self._train_correct.cpu(), "train_seen": self._train_seen.cpu()}

    def load_per_rank_state(self, state: dict[str, torch.Tensor]) -> None:
        self._train_correct = state["train_correct"].to(self.device)
        self._train_seen = state["train_seen"].to(self.device)

    def on_train_epoch_end(self) -> None:
        # Every rank trains on the same number of samples (the DistributedSampler pads the training set), so the mean
        # over ranks of each rank's accuracy is the accuracy over all samples.
        self.log("train_acc", self._train_correct / self._train_seen.clamp(min=1), sync_dist=True)

    def _evaluate(self, batch: tuple[torch.Tensor, torch.Tensor], stage: str) -> None:
        inputs, targets = batch
        logits = self.net(inputs)
        loss_metric = self.val_loss if stage == "val" else self.test_loss
        acc_metric = self.val_acc if stage == "val" else self.test_acc
        loss_metric.update(self.criterion(logits, targets), weight=targets.shape[0])
        acc_metric.update(logits, targets)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self._evaluate(batch, "val")

    def on_validation_epoch_end(self) -> None:
        self.log("val_loss", self.val_loss, prog_bar=True)
        self.log("val_acc", self.val_acc, prog_bar=True)

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self._evaluate(batch, "test")

    def on_test_epoch_end(self) -> None:
        self.log("test_loss", self.test_loss, prog_bar=True)
        self.log("test_acc", self.test_acc, prog_bar=True)

    def predict_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        inputs, _ = batch
        return self.net(inputs).argmax(dim=1)


class MLPClassifier(ClassifierModule):
    """The tutorials' SimpleNet: 784 inputs for MNIST, 64 for the 8x8 digits."""

    def __init__(self, in_features: int = 64, hidden: int = 256, num_classes: int = 10) -> None:
        super().__init__(mlp_classifier_parts(in_features, hidden, num_classes), num_classes)
        self.save_hyperparameters()


class CNNClassifier(ClassifierModule):
    """The classic two-convolution MNIST network, on 1x28x28 inputs."""

    def __init__(self, in_channels: int = 1, num_classes: int = 10, dropout: bool = True) -> None:
        super().__init__(cnn_classifier_parts(in_channels, num_classes, dropout), num_classes)
        self.save_hyperparameters()


class ResNetClassifier(ClassifierModule):
    """resnet18 for 32x32 images (CIFAR-10): the GPU-scale workload.

    `channels_last` stores activations NHWC (tensor cores prefer it under bf16/fp16). `stem: imagenet` gives
    torchvision's ImageNet stem (7x7 stride-2 convolution, max-pool) for 224-pixel images; the default `cifar` keeps the
    3x3 stem without max-pool."""

    def __init__(self, num_classes: int = 10, channels_last: bool = False, stem: Stem = "cifar") -> None:
        super().__init__(resnet_classifier_parts(num_classes, channels_last, stem), num_classes)
        self.save_hyperparameters()

    def on_after_batch_transfer(self, batch: tuple[torch.Tensor, torch.Tensor], dataloader_idx: int):
        # After the copy to the device: reordering on the CPU first costs the main thread a strided copy of every batch
        # (and an unpinned tensor, so the copy to the GPU waits).
        if self.channels_last:
            inputs, targets = batch
            batch = (inputs.contiguous(memory_format=torch.channels_last), targets)
        return batch


class ToyRegressor(QuickHookBookkeeping):
    """The PyTorch DDP tutorial's ToyModel with an MSE loss, on seeded random tensors."""

    def __init__(self, in_features: int = 10, hidden: int = 10, out_features: int = 5) -> None:
        super().__init__()
        parts = toy_regressor_parts(in_features, hidden, out_features)
        self.net, self.criterion = parts.net, parts.criterion
        self.val_loss = MeanMetric()
        self.test_loss = MeanMetric()
        self.save_hyperparameters()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        loss = self.criterion(self.net(inputs), targets)
        if logs_this_step(self):
            log_step_loss(self, loss)
        return loss

    def _evaluate(self, batch: tuple[torch.Tensor, torch.Tensor], stage: str) -> None:
        inputs, targets = batch
        loss_metric = self.val_loss if stage == "val" else self.test_loss
        loss_metric.update(self.criterion(self.net(inputs), targets), weight=targets.shape[0])

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self._evaluate(batch, "val")

    def on_validation_epoch_end(self) -> None:
        self.log("val_loss", self.val_loss, prog_bar=True)

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self._evaluate(batch, "test")

    def on_test_epoch_end(self) -> None:
        self.log("test_loss", self.test_loss, prog_bar=True)

    def predict_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.net(batch[0])
