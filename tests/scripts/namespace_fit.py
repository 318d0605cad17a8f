"""A 2-process fit written as a user of one Lightning namespace would write it.

Usage: python namespace_fit.py OUT_DIR; tests/_compat/test_namespace.py runs a copy importing pytorch_lightning
for the standalone namespace. The script imports ``ddp_strategy`` *first*, as an alphabetical import order does,
and the user's namespace after it (the process's namespace follows this script's imports:
``ddp_strategy._compat.namespace.resolve``). It trains DigitsClassifier for 2 epochs of 10 batches under
``start_method="spawn"`` (which pickles the trainer), saving a checkpoint per epoch under OUT_DIR/ckpts. Each rank
writes OUT_DIR/rank{global_rank}.pt: its final weights, epoch, step, validation accuracy, and the namespace of the
Lightning classes its strategy, model, data module and checkpoint IO derive from.
"""

import sys
from pathlib import Path

import torch

# ddp_strategy first, as an alphabetical order of `from` imports puts it
# isort: off
from ddp_strategy import DDPCheckpointIO, DigitsClassifier, DigitsDataModule, MyDDPStrategy
import lightning.pytorch as pl  # tests/_compat/test_namespace.py runs a copy importing pytorch_lightning too
# isort: on


def namespace_of(obj: object) -> str:
    """The namespace of the Lightning classes ``obj``'s class derives from."""
    tops = {c.__module__.split(".")[0] for c in type(obj).__mro__}
    return (
        "lightning"
        if "lightning" in tops
        else "pytorch_lightning"
        if tops & {"pytorch_lightning", "lightning_fabric"}
        else "?"
    )


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
                "namespaces": {
                    name: namespace_of(obj)
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
    out = Path(sys.argv[1])
    pl.seed_everything(321)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=MyDDPStrategy(timeout=60, start_method="spawn"),
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
    trainer.fit(DigitsClassifier(), DigitsDataModule(batch_size=32))
