"""Test doubles for the diagnostics tests: a module, so spawned ranks can import them."""

from __future__ import annotations

import logging
from typing import Any

from torch import nn
from torch.utils.data import DataLoader

from ddp_strategy import DigitsClassifier, DigitsDataModule


class MultipliedBatchDigits(DigitsDataModule):
    """The mistake the batch-size warning catches: the loader multiplies the configured batch_size by W."""

    def train_dataloader(self) -> DataLoader:
        assert self.train_set is not None
        return DataLoader(self.train_set, batch_size=self.batch_size * self.trainer.world_size, shuffle=True)


class UnusedHeadClassifier(DigitsClassifier):
    """The digits classifier with an extra head that ``forward`` never uses (needs find_unused_parameters)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.aux_head = nn.Linear(4, 2)


class ListHandler(logging.Handler):
    """Collects formatted log records in a list (works with ``-p no:logging``, unlike caplog)."""

    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())
