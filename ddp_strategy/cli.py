"""The main job's ``LightningCLI``: the digits model and data with ``MyDDPStrategy`` on 2 CPU processes.

Kept out of ``__main__`` so that ``start_method="spawn"`` can pickle the CLI's objects: a class defined in
a module run with ``python -m`` cannot be found again by a spawned process.
"""

from __future__ import annotations

from typing import Any

import ddp_strategy  # noqa: F401  (registers "my_ddp" with Lightning)
from ddp_strategy._compat import namespace as _namespace
from ddp_strategy._compat.namespace import rank_zero_info
from ddp_strategy.reference import DigitsClassifier, DigitsDataModule

#: The CLI runs on the default namespace (``DDP_STRATEGY_LIGHTNING`` chooses; else ``lightning`` if installed).
_LIGHTNING = _namespace.default
LightningCLI = _LIGHTNING.get("pytorch.cli:LightningCLI")

#: Trainer defaults of the main job; each is a flag (``--trainer.devices=1``) or a YAML entry.
TRAINER_DEFAULTS: dict[str, Any] = {
    "accelerator": "cpu",
    "devices": 2,
    "strategy": "my_ddp",
    "max_epochs": 20,
    "logger": {"class_path": f"{_LIGHTNING.pytorch_name}.loggers.CSVLogger", "init_args": {"save_dir": "."}},
    "log_every_n_steps": 10,
}


class DigitsCLI(LightningCLI):
    """LightningCLI that reports the final metrics and checkpoint after ``fit`` (on rank 0)."""

    def instantiate_classes(self) -> None:
        """Build the model, data and trainer; a bad value found only now ends as a usage error, like a bad flag.

        jsonargparse checks types while parsing, but values are checked by the classes themselves (e.g.
        ``--trainer.strategy.timeout=-5``, ``--data.batch_size=0``). Their ``ValueError``/``TypeError`` is
        reported through the parser: the usage line, ``error: <message>`` and exit status 2, no traceback.
        """
        try:
            super().instantiate_classes()
        except (ValueError, TypeError) as e:
            self.parser.error(str(e))

    def after_fit(self) -> None:
        """Log final validation metrics and the checkpoint path."""
        metrics = {k: round(float(v), 4) for k, v in self.trainer.callback_metrics.items()}
        ckpt = self.trainer.checkpoint_callback.best_model_path if self.trainer.checkpoint_callback else None
        rank_zero_info(f"Final metrics: {metrics}")
        rank_zero_info(f"Checkpoint: {ckpt}")


def build_cli(args: list[str] | None = None) -> DigitsCLI:
    """Parse ``args`` (default ``sys.argv[1:]``) and run the chosen subcommand; return the CLI object."""
    return DigitsCLI(
        DigitsClassifier.for_namespace(_LIGHTNING.name),
        DigitsDataModule.for_namespace(_LIGHTNING.name),
        trainer_defaults=TRAINER_DEFAULTS,
        seed_everything_default=42,
        save_config_kwargs={"overwrite": True},
        args=args,
    )
