"""The main job's ``LightningCLI``: the digits model and data with ``MyDDPStrategy`` on 2 CPU processes.

Kept out of ``__main__`` so that ``start_method="spawn"`` can pickle the CLI's objects: a class defined in
a module run with ``python -m`` cannot be found again by a spawned process.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import TYPE_CHECKING, Any

from typing_extensions import override

from ddp_strategy._compat import namespace as _namespace  # importing the package registers "my_ddp" with Lightning
from ddp_strategy.reference import DigitsClassifier, DigitsDataModule

if TYPE_CHECKING:
    from lightning.pytorch.callbacks import ProgressBar
    from lightning.pytorch.cli import LightningCLI
else:  # the CLI runs on the process's namespace (``DDP_STRATEGY_LIGHTNING`` chooses; else ``lightning`` if installed)
    LightningCLI, ProgressBar = (
        _namespace.get("pytorch.cli:LightningCLI"),
        _namespace.get("pytorch.callbacks:ProgressBar"),
    )

log = logging.getLogger(__name__)

#: Trainer defaults of the main job; each is a flag (``--trainer.devices=1``) or a YAML entry.
TRAINER_DEFAULTS: dict[str, Any] = {
    "accelerator": "cpu",
    "devices": 2,
    "strategy": "my_ddp",
    "max_epochs": 20,
    "logger": {"class_path": f"{_namespace.get('pytorch').__name__}.loggers.CSVLogger", "init_args": {"save_dir": "."}},
    "log_every_n_steps": 10,
}


class EpochLines(ProgressBar):
    """A progress bar of one log line per epoch, on rank 0: ``Epoch 3: train_loss 0.2145, val_acc 0.9499 (0.8 s)``."""

    _enabled, _start = True, 0.0

    @override
    def disable(self) -> None:  # Lightning calls it on every rank but global rank 0
        self._enabled = False

    @override
    def enable(self) -> None:
        self._enabled = True

    @override
    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        self._start = time.monotonic()

    @override
    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        if self._enabled:
            metrics = ", ".join(f"{k} {v:.4f}" for k, v in sorted(trainer.progress_bar_metrics.items()))
            log.info(f"Epoch {trainer.current_epoch}: {metrics} ({time.monotonic() - self._start:.1f} s)")


class DigitsCLI(LightningCLI):
    """LightningCLI that reports the final metrics and checkpoint after ``fit`` (on rank 0)."""

    def instantiate_classes(self) -> None:
        """Build the model, data and trainer; a ``ValueError``/``TypeError`` of the classes (``--data.batch_size=0``:
        jsonargparse checks only types) ends as for a bad flag: the usage line, ``error: <message>``, exit status 2."""
        try:
            super().instantiate_classes()
        except (ValueError, TypeError) as e:
            self.parser.error(str(e))

    @override
    def instantiate_trainer(self, **kwargs: Any) -> Any:
        """The trainer; :class:`EpochLines` is its progress bar if stdout is no terminal and the config chose none."""
        config = (self.config_init[self.subcommand] if self.subcommand else self.config_init).trainer
        callbacks = config.callbacks if isinstance(config.callbacks, list) else [c for c in [config.callbacks] if c]
        if (
            config.enable_progress_bar is None
            and not any(isinstance(c, ProgressBar) for c in callbacks)
            and not sys.stdout.isatty()
        ):
            kwargs.setdefault("callbacks", [*callbacks, EpochLines()])
        return super().instantiate_trainer(**kwargs)

    def after_fit(self) -> None:
        """Log final validation metrics and the checkpoint path."""
        metrics = {k: round(float(v), 4) for k, v in self.trainer.callback_metrics.items()}
        ckpt = self.trainer.checkpoint_callback.best_model_path if self.trainer.checkpoint_callback else None
        if self.trainer.is_global_zero:
            log.info(f"Final metrics: {metrics}")
            log.info(f"Checkpoint: {ckpt}")


def build_cli(args: list[str] | None = None, run: bool = True) -> DigitsCLI:
    """Parse ``args`` (default ``sys.argv[1:]``), run the chosen subcommand (``run=False``: none, nor subcommands)."""
    return DigitsCLI(
        DigitsClassifier,
        DigitsDataModule,
        trainer_defaults=TRAINER_DEFAULTS,
        seed_everything_default=42,
        save_config_kwargs={"overwrite": True},
        args=args,
        run=run,
    )
