"""BatchNorm buffers during validation in ``fit`` (ddp_strategy/sync/): with ``broadcast_buffers=True`` both ranks
validate with rank 0's running statistics, as under Lightning's ``strategy="ddp"``, also those a callback swaps in at
``on_validation_epoch_start`` (``EMAWeightAveraging``); with False each keeps its own.

One launch of 2 real gloo processes: the EMA fits under both strategies, then tests/sync/sync_workers.py's
``scenario_batchnorm``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from ddp_testing import launch, load, quiet_trainer, save
from lightning.pytorch.callbacks import EMAWeightAveraging
from sync_workers import scenario_batchnorm
from torch.utils.data import DataLoader

from ddp_strategy import MyDDPStrategy

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(400)]


class EMANet(pl.LightningModule):
    """A BatchNorm1d model whose ranks train on differently shifted inputs, so their running means (and those
    EMAWeightAveraging averages) differ; records the buffers each validation run uses and the synced val_loss."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 1))
        self.rec: dict[str, list[torch.Tensor]] = {"during": [], "val_loss": []}

    def train_dataloader(self) -> Any:
        x = torch.randn(32, 4, generator=torch.Generator().manual_seed(1))
        return DataLoader(list(zip(x, torch.zeros(32), strict=True)), batch_size=4, shuffle=True)  # Lightning's shards

    def val_dataloader(self) -> Any:
        return DataLoader(
            list(zip(torch.randn(8, 4, generator=torch.Generator().manual_seed(2)), torch.zeros(8), strict=True)),
            batch_size=4,
        )

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.net(batch[0] + 3 * self.global_rank).pow(2).mean()

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        if batch_idx == 0:
            self.rec["during"].append(torch.cat([self.net[1].running_mean, self.net[1].running_var]))
        self.log("val_loss", self.net(batch[0]).pow(2).mean(), sync_dist=True)

    def on_train_epoch_end(self) -> None:
        self.rec["val_loss"].append(self.trainer.callback_metrics["val_loss"].clone())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def scenario_ema_then_batchnorm(out: Path) -> None:
    """Fit EMANet 2 epochs with EMAWeightAveraging under Lightning's ddp and MyDDPStrategy; then scenario_batchnorm."""
    for name, strategy in (("ema_lightning", "ddp"), ("ema_mine", MyDDPStrategy(start_method="popen", timeout=60))):
        model = EMANet()
        quiet_trainer(
            2,
            strategy,
            max_epochs=2,
            callbacks=[EMAWeightAveraging(decay=0.5)],
            num_sanity_val_steps=0,
            default_root_dir=str(out),
        ).fit(model)
        save(out, name, model.rec)
    scenario_batchnorm(out)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """The launch; returns the folder holding every rank's records."""
    out = tmp_path_factory.mktemp("batchnorm")
    launch(scenario_ema_then_batchnorm, 2, out)
    return out


def test_buffers_a_callback_swaps_in_at_validation_epoch_start_are_rank_zeros_as_under_lightning(runs):
    """EMAWeightAveraging swaps its averaged (per-rank) buffers in at on_validation_epoch_start: every rank validates
    with rank 0's averaged buffers and the synced val_loss equals Lightning's ddp's, epoch by epoch."""
    mine, lightning = load(runs, "ema_mine", 2), load(runs, "ema_lightning", 2)
    for epoch in range(2):
        for records in (mine, lightning):
            torch.testing.assert_close(records[1]["during"][epoch], records[0]["during"][epoch], rtol=0, atol=0)
        torch.testing.assert_close(mine[0]["during"][epoch], lightning[0]["during"][epoch])
        for a, b in zip(mine, lightning, strict=True):
            torch.testing.assert_close(a["val_loss"][epoch], b["val_loss"][epoch])


def test_batchnorm_buffers_are_rank_zeros_inside_validation_step(runs):
    """broadcast_buffers=True: inside validation_step both ranks hold rank 0's running_mean, as under Lightning."""
    # Lightning's ddp always shuffles training data, so its numbers differ from ours; the rule is the same.
    for records in (load(runs, "bn_true", 2), load(runs, "bn_lightning", 2)):
        for epoch in range(2):
            before0, before1 = records[0]["before"][epoch], records[1]["before"][epoch]
            assert (before0 - before1).abs().max() > 1e-2  # the ranks drifted apart in training
            for rec in records:
                torch.testing.assert_close(rec["during"][epoch], before0, rtol=0, atol=0)


def test_batchnorm_buffers_stay_per_rank_without_broadcast_buffers(runs):
    """broadcast_buffers=False: each rank validates with its own running statistics."""
    records = load(runs, "bn_false", 2)
    for epoch in range(2):
        for rec in records:
            torch.testing.assert_close(rec["during"][epoch], rec["before"][epoch], rtol=0, atol=0)
        assert (records[0]["during"][epoch] - records[1]["during"][epoch]).abs().max() > 1e-2
