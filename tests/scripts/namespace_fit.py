"""A 2-process fit written as a user of one Lightning namespace would write it, with a strategy built elsewhere.

Usage: python namespace_fit.py NAMESPACE STRATEGY_FOR OUT_DIR. NAMESPACE is ``lightning`` (``import
lightning.pytorch as pl``) or ``pytorch_lightning`` (``import pytorch_lightning as pl``). The script imports
``ddp_strategy`` *first*, as an alphabetical import order does, then builds the strategy at import time, as a config
module would: ``MyDDPStrategy.for_namespace(STRATEGY_FOR)(...)``, or with STRATEGY_FOR ``unnamed``
``MyDDPStrategy(...)`` where no namespace is named yet (``lightning``'s where both are installed); only then it
imports the user's namespace, whose Trainer gets that strategy. It trains DigitsClassifier for 2 epochs of 10
batches under ``start_method="spawn"`` (which pickles the trainer), saving a checkpoint per epoch under
OUT_DIR/ckpts. Each rank writes OUT_DIR/rank{global_rank}.pt: its final weights, epoch, step, validation accuracy,
the namespace the strategy was built for, and the namespace of its strategy, model, data module and checkpoint IO.
"""

import importlib
import sys
from pathlib import Path

import torch

from ddp_strategy import DDPCheckpointIO, DigitsClassifier, DigitsDataModule, MyDDPStrategy
from ddp_strategy._compat import namespace as _namespace

STRATEGY_CLASS = MyDDPStrategy if sys.argv[2] == "unnamed" else MyDDPStrategy.for_namespace(sys.argv[2])
STRATEGY = STRATEGY_CLASS(timeout=60, start_method="spawn")
BUILT_FOR = _namespace.namespace_of(STRATEGY)

# The user's namespace, at module level as a user imports it (spawned ranks re-import this module).
pl = importlib.import_module("lightning.pytorch" if sys.argv[1] == "lightning" else "pytorch_lightning")


class Record(pl.Callback):
    """At the end of fit, on every rank: write what this rank ended with to OUT_DIR/rank{global_rank}.pt."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_end(self, trainer, pl_module) -> None:
        torch.save(
            {
                "weights": {k: v.detach().clone() for k, v in pl_module.state_dict().items()},
                "epoch": trainer.current_epoch,
                "step": trainer.global_step,
                "val_acc": float(trainer.callback_metrics["val_acc"]),
                "built_for": BUILT_FOR,
                "namespaces": {
                    name: _namespace.namespace_of(obj)
                    for name, obj in (
                        ("strategy", trainer.strategy),
                        ("model", pl_module),
                        ("data", trainer.datamodule),
                        ("checkpoint_io", trainer.strategy.checkpoint_io),
                    )
                },
            },
            self.out / f"rank{trainer.global_rank}.pt",
        )


if __name__ == "__main__":
    out = Path(sys.argv[3])
    pl.seed_everything(321)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=STRATEGY,
        plugins=[DDPCheckpointIO()],
        max_epochs=2,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(out),
        limit_train_batches=10,
        limit_val_batches=2,
        callbacks=[pl.callbacks.ModelCheckpoint(dirpath=out / "ckpts", filename="{epoch}", save_top_k=-1), Record(out)],
    )
    assert trainer.strategy is STRATEGY
    trainer.fit(DigitsClassifier(), DigitsDataModule(batch_size=32))
