"""The main job: ``python -m ddp_strategy fit`` (or the ``ddp-strategy`` console script), the
:mod:`ddp_strategy.cli` ``LightningCLI``; every default is a flag or YAML. The only place logging is configured.
"""

from __future__ import annotations

import logging
import sys


def main(args: list[str] | None = None) -> None:
    """Log to stdout (``> log`` gets the epoch lines) and run the CLI; ``args`` replaces ``sys.argv[1:]``."""
    logging.basicConfig(stream=sys.stdout, level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("ddp_strategy").setLevel(logging.WARNING)  # per-rank details (joining the group) stay out
    logging.getLogger("ddp_strategy.cli").setLevel(logging.INFO)
    from ddp_strategy.cli import build_cli

    build_cli(args)


if __name__ == "__main__":
    main()
