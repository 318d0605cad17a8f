"""Parameters frozen or unfrozen after DDP wrapped the model (ddp_strategy/sync/wrapping.py: ``wrap``, called again
before every training step's forward): under ``MyDDPStrategy`` the ranks stay equal and equal one process fed the
union of their batches; under Lightning's ``strategy="ddp"`` (Lightning-AI/pytorch-lightning#20340) the parameters
unfrozen later are never all-reduced and the ranks drift apart.

One launch of 2 real gloo processes fits the same user code under both strategies: ``BackboneFinetuning`` unfreezing
at epoch 1, and a plain callback calling ``requires_grad_`` inside accumulation windows (unfreeze at a window's first
micro-batch, freeze again at another's last). The single-process replays run here, under Lightning's default
strategy, with the same callbacks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from ddp_testing import launch, load, save
from lightning.pytorch.callbacks import BackboneFinetuning
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ddp_strategy import MyDDPStrategy

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

#: (name, callbacks' factory, accumulate_grad_batches)
B = 4  # per-device batch size
BATCHES = 6  # training batches per epoch and rank


def _data() -> TensorDataset:
    x = torch.randn(2 * B * BATCHES, 8, generator=torch.Generator().manual_seed(1))
    return TensorDataset(x, x.sum(1, keepdim=True).sin(), torch.arange(len(x)))


class Finetuned(pl.LightningModule):
    """A backbone and a head; ``frozen``: the backbone frozen here and the optimizer over every parameter (a plain
    callback unfreezes it), else the optimizer over the trainable ones (``BackboneFinetuning``'s recipe)."""

    def __init__(self, frozen: bool, batches: list[list[int]] | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.backbone = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
        self.head = nn.Linear(8, 1)
        self.frozen, self.batches, self.seen = frozen, batches, []
        if frozen:
            self.backbone.requires_grad_(False)

    def train_dataloader(self) -> Any:
        if self.batches is not None:  # the replay: one process, the union of both ranks' batches
            return DataLoader(_data(), batch_sampler=self.batches)
        return DataLoader(_data(), batch_size=B)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, index = batch
        self.seen.append(index.tolist())
        return F.mse_loss(self.head(self.backbone(x)), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        params = self.parameters() if self.frozen else [p for p in self.parameters() if p.requires_grad]
        return torch.optim.SGD(params, lr=0.5)


class Toggle(pl.Callback):
    """At epoch 1: unfreeze the backbone at batch 2 (an accumulation window's first micro-batch), freeze it again at
    batch 5 (a window's last micro-batch, after its first one accumulated backbone gradients)."""

    def on_train_batch_start(self, trainer: pl.Trainer, module: Finetuned, batch: Any, batch_idx: int) -> None:
        if trainer.current_epoch == 1 and batch_idx in (2, 5):
            module.backbone.requires_grad_(batch_idx == 2)


#: scenario: (frozen in __init__, callbacks, accumulate_grad_batches)
SCENARIOS = {
    "finetuning": (False, lambda: [BackboneFinetuning(unfreeze_backbone_at_epoch=1)], 1),
    "toggle": (True, lambda: [Toggle()], 2),
}


def _fit(strategy: Any, devices: int, name: str, batches: list[list[int]] | None = None) -> Finetuned:
    frozen, callbacks, accumulate = SCENARIOS[name]
    model = Finetuned(frozen, batches)
    pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_epochs=2,
        limit_train_batches=BATCHES,
        accumulate_grad_batches=accumulate,
        callbacks=callbacks(),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    ).fit(model)
    return model


def scenario_trainable_changes(out: Path) -> None:
    """Each scenario under Lightning's ddp, then MyDDPStrategy; each rank saves the batches it saw and its weights."""
    for name in SCENARIOS:
        for label, strategy in (("ddp", "ddp"), ("mine", MyDDPStrategy(start_method="popen", timeout=60))):
            model = _fit(strategy, 2, name)
            save(out, f"{name}_{label}", {"seen": model.seen, "final": dict(model.state_dict())})
    torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """The launch; returns the folder holding every rank's records."""
    out = tmp_path_factory.mktemp("trainable")
    launch(scenario_trainable_changes, 2, out)
    return out


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_parameters_unfrozen_or_frozen_after_wrapping_train_as_one_process(runs, name, tmp_path):
    """Ours: the ranks hold equal weights, equal to one process fed the union of their batches; Lightning's ddp
    never all-reduces the backbone unfrozen after wrapping: its ranks' backbones differ."""
    mine, ddp = load(runs, f"{name}_mine", 2), load(runs, f"{name}_ddp", 2)
    union = [a + b for a, b in zip(mine[0]["seen"], mine[1]["seen"], strict=True)]
    replay = _fit("auto", 1, name, batches=union[:BATCHES]).state_dict()
    assert union[BATCHES:] == union[:BATCHES]  # the same batches in epoch 1
    for key, value in replay.items():
        assert torch.equal(mine[0]["final"][key], mine[1]["final"][key]), key
        torch.testing.assert_close(mine[0]["final"][key], value, rtol=0, atol=1e-6, msg=key)
    assert (ddp[0]["final"]["backbone.0.weight"] - ddp[1]["final"]["backbone.0.weight"]).abs().max() > 1e-3
    assert not torch.equal(replay["backbone.0.weight"], Finetuned(frozen=False).state_dict()["backbone.0.weight"])
