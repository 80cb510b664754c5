"""A small decoder-only transformer language model: the workload for `strategy: fsdp` (docs/fsdp.md).

    ddp-app fit --config configs/gpt_fsdp.yaml

`GPT` (app/models/transformer.py, shared with the reference) is the bare network; `GPTLanguageModel` adds the next-token
loss and logging. Its blocks sit in an `nn.ModuleList`, which `app.parallel.fsdp` shards one unit per element by
default. Nothing here knows about FSDP."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torchmetrics import MeanMetric

from app.models.lightning import QuickHookBookkeeping, log_step_loss, logs_this_step
from app.models.transformer import GPT, Block, CausalSelfAttention

__all__ = ["GPT", "Block", "CausalSelfAttention", "GPTLanguageModel"]


class GPTLanguageModel(QuickHookBookkeeping):
    """Next-token prediction on (input tokens, target tokens) batches, as `app.data.tokens` makes them.

    The loss is the mean cross-entropy over every position of the batch (a mean, as elastic resume needs:
    docs/resume.md). The logged `val_loss` is exact over the whole validation split."""

    def __init__(
        self,
        vocab_size: int = 64,
        context: int = 32,
        d_model: int = 64,
        n_layers: int = 2,
        n_heads: int = 4,
        mlp_ratio: int = 4,
    ) -> None:
        super().__init__()
        self.net = GPT(vocab_size, context, d_model, n_layers, n_heads, mlp_ratio)
        self.val_loss = MeanMetric()
        self.test_loss = MeanMetric()
        self.save_hyperparameters()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.net(tokens)

    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        inputs, targets = batch
        logits = self.net(inputs)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        if logs_this_step(self):
            log_step_loss(self, loss)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.val_loss.update(self._loss(batch), weight=batch[1].numel())

    def on_validation_epoch_end(self) -> None:
        self.log("val_loss", self.val_loss, prog_bar=True)

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.test_loss.update(self._loss(batch), weight=batch[1].numel())

    def on_test_epoch_end(self) -> None:
        self.log("test_loss", self.test_loss, prog_bar=True)

    def predict_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.net(batch[0]).argmax(dim=-1)
