"""A 2-process fit written as a user of one Lightning namespace would write it.

Usage: python namespace_fit.py NAMESPACE OUT_DIR EPOCHS START_METHOD [CKPT]. NAMESPACE is ``lightning`` (``import
lightning.pytorch as pl``) or ``pytorch_lightning`` (``import pytorch_lightning as pl``); the script imports
``ddp_strategy`` *first*, as an alphabetical import order does, and only then the user's namespace. It trains
DigitsClassifier for EPOCHS epochs (10 batches each) with ``MyDDPStrategy(start_method=START_METHOD)``, saving
a checkpoint per epoch under OUT_DIR/ckpts, resuming from CKPT if given. Each rank writes
OUT_DIR/rank{global_rank}.pt: its final weights, epoch, step, validation accuracy, the namespace of its
strategy, model, data module and checkpoint IO, and which namespaces were imported.
"""

import importlib
import sys
from pathlib import Path

import torch

from ddp_strategy import DDPCheckpointIO, DigitsClassifier, DigitsDataModule, MyDDPStrategy
from ddp_strategy._compat import namespace as _namespace

# The user's namespace, at module level so that spawned ranks (which re-import this module) have it too.
pl = importlib.import_module("lightning.pytorch" if sys.argv[1] == "lightning" else "pytorch_lightning")


class Record(pl.Callback):
    """At the end of fit, on every rank: write what this rank ended with to OUT_DIR/rank{global_rank}.pt."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_end(self, trainer, pl_module) -> None:
        torch.save({"weights": {k: v.detach().clone() for k, v in pl_module.state_dict().items()},
                    "epoch": trainer.current_epoch, "step": trainer.global_step,
                    "val_acc": float(trainer.callback_metrics["val_acc"]),
                    "namespaces": {name: _namespace.namespace_of(obj) for name, obj in
                                   (("strategy", trainer.strategy), ("model", pl_module),
                                    ("data", trainer.datamodule), ("checkpoint_io", trainer.strategy.checkpoint_io))},
                    "imported": sorted(m for m in ("lightning", "pytorch_lightning") if m in sys.modules)},
                   self.out / f"rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    out, epochs, start_method = Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    ckpt = sys.argv[5] if len(sys.argv) > 5 else None
    pl.seed_everything(321)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=MyDDPStrategy(timeout=60, start_method=start_method),
        plugins=[DDPCheckpointIO()],
        max_epochs=epochs, logger=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=str(out), limit_train_batches=10, limit_val_batches=2,
        callbacks=[pl.callbacks.ModelCheckpoint(dirpath=out / "ckpts", filename="{epoch}", save_top_k=-1),
                   Record(out)],
    )
    trainer.fit(DigitsClassifier(), DigitsDataModule(batch_size=32), ckpt_path=ckpt)
