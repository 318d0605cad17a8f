"""The reference data: scikit-learn's bundled handwritten digits, as a LightningDataModule.

``sklearn.datasets.load_digits`` ships 1,797 real 8x8 grey-scale images of the digits 0-9 (UCI ML
hand-written digits, test set) inside scikit-learn, so no download is needed.
"""

from __future__ import annotations

from typing import cast

import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset, random_split

from ddp_strategy._compat import namespace as _namespace

NUM_FEATURES = 64
NUM_CLASSES = 10


def load_digits_tensors() -> tuple[torch.Tensor, torch.Tensor]:
    """All 1,797 digits as tensors.

    Returns:
        ``(x, y)``: ``x`` float32 of shape (1797, 64), pixel intensities scaled from 0..16 to 0..1;
        ``y`` int64 of shape (1797,), the digit 0-9.
    """
    from sklearn.datasets import load_digits  # imported here: scikit-learn costs ~0.3 s and ~15 MiB per rank

    data = load_digits()
    return torch.tensor(data.data, dtype=torch.float32) / 16.0, torch.tensor(data.target, dtype=torch.int64)


class DigitsDataModule(_namespace.LightningDataModule):
    """Digits, split 80/20 into train (1,438 images) and validation (359) with a fixed seed.

    Args:
        batch_size: the per-device batch size B (default 32). Under DDP each rank loads B samples per
            step, so the global batch is ``B * world_size``; do not multiply it by the device count.
        val_fraction: validation share (default 0.2).
        split_seed: seed of the train/validation split (default 1234), independent of training seeds.
        num_workers: DataLoader worker processes per rank (default 0).

    Raises:
        ValueError: ``batch_size < 1`` or ``num_workers < 0``.
    """

    def __init__(
        self, batch_size: int = 32, val_fraction: float = 0.2, split_seed: int = 1234, num_workers: int = 0
    ) -> None:
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"batch_size is the per-device batch size and must be >= 1, got {batch_size}.")
        if num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers}.")
        self.save_hyperparameters()  # val_fraction, split_seed and num_workers are read from self.hparams
        self.batch_size = batch_size  #: an attribute, where Lightning's batch-size finder looks
        self.train_set: TensorDataset | None = None
        self.val_set: TensorDataset | None = None

    def setup(self, stage: str | None = None) -> None:
        """Load the digits and split off ``round(N * val_fraction)`` for validation with ``random_split``, seeded
        by ``split_seed`` (the same split on every rank and run); ``ValueError`` unless 0 < val_fraction < 1."""
        if not 0.0 < self.hparams.val_fraction < 1.0:
            raise ValueError(f"val_fraction must be between 0 and 1 (exclusive), got {self.hparams.val_fraction}.")
        x, y = load_digits_tensors()
        n_val = round(len(y) * self.hparams.val_fraction)
        val, train = random_split(
            cast(Dataset[int], range(len(y))),
            [n_val, len(y) - n_val],
            torch.Generator().manual_seed(self.hparams.split_seed),
        )
        self.train_set = TensorDataset(x[train.indices], y[train.indices])
        self.val_set = TensorDataset(x[val.indices], y[val.indices])

    def train_dataloader(self) -> DataLoader:
        """Shuffled training batches of the per-device batch size; the strategy shards them (its fit summary states
        the global batch size)."""
        assert self.train_set is not None, "call setup() first"
        return DataLoader(
            self.train_set, batch_size=self.batch_size, shuffle=True, num_workers=self.hparams.num_workers
        )

    def val_dataloader(self) -> DataLoader:
        """Validation batches in data-set order; also the test loader (digits has no separate test split here)."""
        assert self.val_set is not None, "call setup() first"
        return DataLoader(self.val_set, batch_size=self.batch_size, shuffle=False, num_workers=self.hparams.num_workers)

    test_dataloader = val_dataloader
