"""The main job: ``python -m ddp_strategy fit`` (or the ``ddp-strategy`` console script).

A :class:`~lightning.pytorch.cli.LightningCLI` over the reference digits model and data. Its defaults train
on 2 CPU processes with ``MyDDPStrategy`` (``strategy="my_ddp"``) for 20 epochs, log to CSV under
``lightning_logs/``, and save a checkpoint; every default is a flag (``--trainer.devices=1``,
``--data.batch_size=64``, ``--print_config``) or YAML (``--config my.yaml``) in the usual Lightning way.
This is the only place logging is configured.
"""

from __future__ import annotations

import logging
from typing import Any

from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.utilities.rank_zero import rank_zero_info

import ddp_strategy  # noqa: F401  (registers "my_ddp" with Lightning)
from ddp_strategy.data import DigitsDataModule
from ddp_strategy.model import DigitsClassifier

TRAINER_DEFAULTS: dict[str, Any] = {
    "accelerator": "cpu",
    "devices": 2,
    "strategy": "my_ddp",
    "max_epochs": 20,
    "logger": {"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": "."}},
    "log_every_n_steps": 10,
}


class DigitsCLI(LightningCLI):
    """LightningCLI that reports the final metrics and checkpoint after ``fit`` (on rank 0)."""

    def after_fit(self) -> None:
        """Log final validation metrics and the checkpoint path."""
        metrics = {k: round(float(v), 4) for k, v in self.trainer.callback_metrics.items()}
        ckpt = self.trainer.checkpoint_callback.best_model_path if self.trainer.checkpoint_callback else None
        rank_zero_info(f"Final metrics: {metrics}")
        rank_zero_info(f"Checkpoint: {ckpt}")


def main(args: list[str] | None = None) -> DigitsCLI:
    """Run the CLI; ``args`` replaces ``sys.argv[1:]`` (e.g. ``["fit", "--trainer.max_epochs=1"]``)."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("ddp_strategy").setLevel(logging.INFO)
    return DigitsCLI(
        DigitsClassifier,
        DigitsDataModule,
        trainer_defaults=TRAINER_DEFAULTS,
        seed_everything_default=42,
        save_config_kwargs={"overwrite": True},
        args=args,
    )


if __name__ == "__main__":
    main()
