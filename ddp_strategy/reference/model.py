"""The reference model: a small multilayer perceptron for the 8x8 digits, plain and as a LightningModule."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torchmetrics.classification import MulticlassAccuracy

from ddp_strategy._compat import namespace as _namespace
from ddp_strategy.reference.data import NUM_CLASSES, NUM_FEATURES


class DigitsNet(nn.Module):
    """The plain classifier: 64 -> hidden -> hidden -> 10 with ReLU; input (B, 64) float32 pixels in 0..1, output
    (B, 10) logits. No Lightning, no DDP.

    Args:
        hidden_size: width of both hidden layers (default 128).
    """

    def __init__(self, hidden_size: int = 128) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(NUM_FEATURES, hidden_size),
            nn.ReLU(),
            nn.Linear(hidden_size, hidden_size),
            nn.ReLU(),
            nn.Linear(hidden_size, NUM_CLASSES),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits of shape (B, 10) for images of shape (B, 64)."""
        return self.layers(x)


class DigitsClassifier(_namespace.LightningModule):
    """The reference LightningModule: :class:`DigitsNet` under ``self.model``, cross-entropy, Adam.

    Accuracy is a ``torchmetrics`` ``MulticlassAccuracy``; under DDP torchmetrics sums its counts over ranks at epoch
    end, so ``val_acc`` is over the whole validation set. Checkpoint keys are ``model.<name>``:
    :func:`ddp_strategy.checkpoint.convert.load_plain_state_dict` returns them ready for ``DigitsNet.load_state_dict``.

    Args:
        hidden_size: see :class:`DigitsNet` (default 128).
        learning_rate: Adam's learning rate (default 1e-3).
        weight_decay: Adam's L2 penalty (default 0).
    """

    def __init__(self, hidden_size: int = 128, learning_rate: float = 1e-3, weight_decay: float = 0.0) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = DigitsNet(hidden_size)
        self.train_acc = MulticlassAccuracy(num_classes=NUM_CLASSES, average="micro")
        self.val_acc = MulticlassAccuracy(num_classes=NUM_CLASSES, average="micro")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits (B, 10) for images (B, 64)."""
        return self.model(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        """Mean cross-entropy over this rank's batch; DDP averages its gradient over ranks."""
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y)
        self.train_acc(logits, y)
        self.log("train_loss", loss, prog_bar=True)
        self.log("train_acc", self.train_acc, on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        """Validation loss (averaged over ranks) and accuracy (counted over ranks)."""
        x, y = batch
        logits = self(x)
        self.val_acc(logits, y)
        self.log("val_loss", F.cross_entropy(logits, y), prog_bar=True, sync_dist=True)
        self.log("val_acc", self.val_acc, prog_bar=True)

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        """Same as validation, logged as ``test_acc``."""
        x, y = batch
        self.val_acc(self(x), y)
        self.log("test_acc", self.val_acc)

    def configure_optimizers(self) -> Any:
        """Adam with the configured learning rate and weight decay."""
        return torch.optim.Adam(
            self.parameters(), lr=self.hparams.learning_rate, weight_decay=self.hparams.weight_decay
        )
