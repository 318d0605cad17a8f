"""The main job: ``python -m ddp_strategy fit`` (or the ``ddp-strategy`` console script).

A :class:`~lightning.pytorch.cli.LightningCLI` (:mod:`ddp_strategy.cli`) over the reference digits model
and data. Its defaults train on 2 CPU processes with ``MyDDPStrategy`` (``strategy="my_ddp"``) for 20 epochs,
log to CSV under ``lightning_logs/``, and save a checkpoint; every default is a flag
(``--trainer.devices=1``, ``--data.batch_size=64``, ``--print_config``) or YAML (``--config my.yaml``) in
the usual Lightning way. This is the only place logging is configured.
"""

from __future__ import annotations

import logging


def main(args: list[str] | None = None) -> None:
    """Configure logging and run the CLI; ``args`` replaces ``sys.argv[1:]``. Returns None (exit status 0)."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("ddp_strategy").setLevel(logging.INFO)
    from ddp_strategy.cli import build_cli

    build_cli(args)


if __name__ == "__main__":
    main()
