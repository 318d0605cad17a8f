"""The main job: ``python -m ddp_strategy fit`` (or the ``ddp-strategy`` console script), the
:mod:`ddp_strategy.cli` ``LightningCLI``; every default is a flag or YAML. The only place logging is configured.
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
