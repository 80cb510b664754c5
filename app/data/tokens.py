"""Synthetic token sequences for the language model (app/models/gpt.py): nothing to download.

The sequences are walks of a fixed random Markov chain over `vocab_size` tokens, so there is
something to learn (the next token depends on the current one) and a loss that falls within one
epoch. Everything comes from one `torch.Generator` seeded with `data_seed`: every rank and every
run builds the same tensors. The splits are TensorDatasets, which the DataModule base reads in
whole batches (`TensorBatchLoader`), with every resume guarantee of the other DataModules.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import Dataset, TensorDataset

from app.data.base import ShardedDataModule
from app.errors import InvalidConfigError


def markov_token_splits(
    num_sequences: int = 512, context: int = 32, vocab_size: int = 64, data_seed: int = 0
) -> tuple[Dataset, Dataset, Dataset]:
    """(train, val, test): `num_sequences` training sequences and an eighth as many for each of the
    others, each an (inputs, targets) pair of `context` tokens, targets shifted by one position."""
    if num_sequences < 8:
        raise InvalidConfigError(f"data.num_sequences must be >= 8, got {num_sequences}.")
    if context < 2 or vocab_size < 2:
        raise InvalidConfigError(f"data.context and data.vocab_size must be >= 2, got {context} and {vocab_size}.")
    generator = torch.Generator().manual_seed(data_seed)
    # Peaked rows: each token has a few likely successors, so the chain is learnable.
    transitions = torch.softmax(3.0 * torch.randn(vocab_size, vocab_size, generator=generator), dim=1)
    held_out = num_sequences // 8
    total = num_sequences + 2 * held_out
    walks = torch.empty(total, context + 1, dtype=torch.long)
    walks[:, 0] = torch.randint(vocab_size, (total,), generator=generator)
    for position in range(context):
        walks[:, position + 1] = torch.multinomial(transitions[walks[:, position]], 1, generator=generator).squeeze(1)
    inputs, targets = walks[:, :-1].contiguous(), walks[:, 1:].contiguous()
    bounds = (0, num_sequences, num_sequences + held_out, total)
    return tuple(  # type: ignore[return-value]
        TensorDataset(inputs[start:end], targets[start:end]) for start, end in zip(bounds, bounds[1:], strict=False)
    )


class SyntheticTokensDataModule(ShardedDataModule):
    """`num_sequences` training sequences of `context` tokens (Markov walks, `markov_token_splits`)."""

    def __init__(
        self,
        num_sequences: int = 512,
        context: int = 32,
        vocab_size: int = 64,
        data_seed: int = 0,
        **loader_options: Any,
    ) -> None:
        super().__init__(**loader_options)  # batch_size, num_workers, ...: see ShardedDataModule
        self.num_sequences = num_sequences
        self.context = context
        self.vocab_size = vocab_size
        self.data_seed = data_seed

    def make_splits(self) -> tuple[Dataset, Dataset, Dataset]:
        return markov_token_splits(self.num_sequences, self.context, self.vocab_size, self.data_seed)
