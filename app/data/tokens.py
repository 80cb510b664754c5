"""Synthetic token sequences for the language model (app/models/gpt.py): nothing to download.

Walks of a fixed random Markov chain over `vocab_size` tokens (learnable within an epoch), from one generator seeded
with `data_seed`; TensorDatasets, read in whole batches (`TensorBatchLoader`)."""

from __future__ import annotations

from typing import Any

from torch.utils.data import Dataset

from app.data.base import ShardedDataModule
from app.data.datasets import markov_token_splits

__all__ = ["SyntheticTokensDataModule", "markov_token_splits"]


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
