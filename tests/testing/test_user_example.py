"""A user's test of their own LightningModule under DDP, written with the testing kit only (docs/testing.md).

It checks what DDP promises for this module: the replicas hold the same weights after training, every
validation sample is evaluated exactly once across the ranks, and the synced validation loss equals the
loss one process computes on the whole validation set.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from ddp_strategy import MyDDPStrategy
from ddp_strategy.testing import assert_each_sample_once, assert_matches_single_process, assert_same_on_every_rank

pytestmark = pytest.mark.multiprocess


class IndexedData(Dataset):
    """N samples of 4 features; each item carries its index so a test can see which rank read it."""

    def __init__(self, n: int = 21) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(n, 4, generator=generator), torch.randn(n, 1, generator=generator)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        return i, self.x[i], self.y[i]


class Regressor(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Linear(4, 1)
        self.seen: list[int] = []
        self.sum_sq = torch.zeros(())

    def training_step(self, batch, batch_idx):
        _, x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        index, x, y = batch
        self.seen += index.tolist()
        loss = nn.functional.mse_loss(self.net(x), y, reduction="sum")
        self.sum_sq = self.sum_sq + loss.detach()
        self.log("val_sum_sq", loss, reduce_fx="sum", sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit_on_this_rank(rank: int, world_size: int) -> dict:
    """What each rank returns to the test: its weights, the validation samples it saw, the synced loss sum."""
    data = IndexedData()
    model = Regressor()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy=MyDDPStrategy(),
        max_epochs=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, DataLoader(data, batch_size=4, shuffle=True), DataLoader(data, batch_size=4))
    model.seen = []
    trainer.validate(model, DataLoader(data, batch_size=4), verbose=False)
    return {
        "weights": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "seen": model.seen,
        "val_sum_sq": trainer.callback_metrics["val_sum_sq"].item(),
    }


def test_my_module_under_ddp(ddp_ranks):
    """Two ranks: same weights, each validation sample once, and the synced loss equals one process's."""
    per_rank = ddp_ranks(fit_on_this_rank, init_process_group=False, timeout_s=120)
    assert_same_on_every_rank([r["weights"] for r in per_rank], "weights")
    assert_each_sample_once([r["seen"] for r in per_rank], len(IndexedData()))
    model = Regressor()
    model.load_state_dict(per_rank[0]["weights"])
    data = IndexedData()
    with torch.no_grad():
        single_process = nn.functional.mse_loss(model.net(data.x), data.y, reduction="sum").item()
    assert_matches_single_process(per_rank[0]["val_sum_sq"], single_process, "validation loss sum", atol=1e-4)
    assert_same_on_every_rank([r["val_sum_sq"] for r in per_rank], "synced validation loss")
