"""Scenarios of tests/process/test_failures.py that need no launcher of their own: several fits in one set of 2 ranks
started by the testing kit (tests/ddp_testing.py ``launch``), each rank recording what it saw."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import torch
from ddp_testing import quiet_trainer, save, state_copy
from lightning.pytorch.callbacks import ModelCheckpoint

from ddp_strategy import DigitsClassifier, DigitsDataModule, MyDDPStrategy


class CrashOnce(pl.Callback):
    """Raises at the start of epoch 1 when ``fail`` is set."""

    def __init__(self, fail: bool) -> None:
        self.fail = fail

    def on_train_epoch_start(self, trainer, pl_module):
        if self.fail and trainer.current_epoch == 1:
            raise RuntimeError("crash at the start of epoch 1")


def _fit(root: Path, ckpt_path: str | None = None, fail: bool = False) -> dict[str, torch.Tensor]:
    """2 epochs of 8 steps, saving last.ckpt after each; the final weights."""
    pl.seed_everything(11)
    model = DigitsClassifier()
    trainer = quiet_trainer(
        2,
        MyDDPStrategy(timeout=60),
        enable_checkpointing=True,
        max_epochs=2,
        limit_train_batches=8,
        default_root_dir=str(root),
        deterministic=True,
        callbacks=[ModelCheckpoint(dirpath=root / "ckpt", save_last=True), CrashOnce(fail)],
    )
    trainer.fit(model, DigitsDataModule(), ckpt_path=ckpt_path)
    return state_copy(model)


def crash_and_resume(out: Path) -> None:
    """An uninterrupted fit; the same fit crashing at the start of epoch 1; that run resumed from its last.ckpt."""
    reference = _fit(out / "reference")
    try:
        _fit(out / "crashed", fail=True)
        crash = "no error"
    except Exception as e:  # the traceback goes with the except block: the next fit holds nothing of this one
        crash = f"{type(e).__name__}: {e}"
    resumed = _fit(out / "crashed", ckpt_path=str(out / "crashed" / "ckpt" / "last.ckpt"))
    save(out, "crash_and_resume", {"reference": reference, "crash": crash, "resumed": resumed})


def resume_after_sigterm(out: Path) -> None:
    """failing_fit.py's fit (3 epochs of 6 steps) resumed from the checkpoint its SIGTERM saved (out/sigterm.ckpt)."""
    pl.seed_everything(3)
    trainer = quiet_trainer(
        2,
        MyDDPStrategy(timeout=60),
        max_epochs=3,
        limit_train_batches=6,
        limit_val_batches=3,
        default_root_dir=str(out),
    )
    trainer.fit(DigitsClassifier(), DigitsDataModule(), ckpt_path=str(out / "sigterm.ckpt"))
    save(out, "resumed", {"global_step": trainer.global_step})


class FailsOnRank0AtEpochEnd(pl.LightningModule):
    """A linear model with no collective of its own after training; rank 0 raises at the end of epoch 0, as a
    ModelCheckpoint whose old file cannot be removed would, so rank 1 next waits in epoch 1's barrier."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        return self.net(batch[0]).pow(2).mean()

    def on_train_epoch_end(self):
        if self.global_rank == 0:
            raise PermissionError("rank 0 cannot remove the previous checkpoint (on purpose)")

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def rank_0_fails_between_epochs(out: Path) -> None:
    """Rank 0 fails at epoch 0's end while rank 1 goes on to epoch 1's barrier; each rank records its error."""
    from torch.utils.data import DataLoader, TensorDataset

    trainer = quiet_trainer(2, MyDDPStrategy(timeout=60), max_epochs=2)
    try:
        trainer.fit(FailsOnRank0AtEpochEnd(), DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=2))
        error = "no error"
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
    save(out, "between_epochs", {"error": error})


class DecidedAlike(DigitsClassifier):
    """Ends epoch 0 at batch 3 by returning -1 from ``on_train_batch_start`` and stops the fit at epoch 1's batch 2 by
    ``trainer.should_stop``, each decided on rank 1 alone and made every rank's as the strategy's errors advise:
    ``reduce_boolean_decision(..., all=False)`` and ``broadcast`` from rank 1."""

    def on_train_batch_start(self, batch, batch_idx):
        skip = self.trainer.strategy.reduce_boolean_decision(
            self.global_rank == 1 and self.current_epoch == 0 and batch_idx == 3, all=False
        )
        stop = self.trainer.strategy.broadcast(self.current_epoch == 1 and batch_idx == 2, src=1)
        self.trainer.should_stop = self.trainer.should_stop or stop
        return -1 if skip else None


def decided_alike(out: Path) -> None:
    """The fit of :class:`DecidedAlike` (3 epochs of 6 steps, the progress bar on) under MyDDPStrategy and ddp."""
    results = {}
    for name, strategy in (("ours", MyDDPStrategy(timeout=60)), ("ddp", "ddp")):
        pl.seed_everything(3)
        model = DecidedAlike()
        trainer = quiet_trainer(
            2, strategy, max_epochs=3, limit_train_batches=6, limit_val_batches=2, enable_progress_bar=True
        )
        trainer.fit(model, DigitsDataModule())
        results[name] = {"steps": trainer.global_step, "epoch": trainer.current_epoch, "weights": state_copy(model)}
    save(out, "decided_alike", results)
