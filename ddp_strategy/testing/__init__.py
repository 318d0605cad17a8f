"""A testing kit for DDP code: run a function or a ``Trainer.fit`` on N CPU ranks from pytest, and check the result.

Owns: starting ranks from a prepared parent (:func:`run_on_ranks`, :mod:`~ddp_strategy.testing.ranks`), the
assertions DDP tests need (:mod:`~ddp_strategy.testing.checks`) and the pytest plugin that gives them to
tests (the top-level module ``pytest_ddp_strategy``, registered as the ``pytest11`` entry point ``ddp_strategy``).
Must not touch: the strategy's internals, or any other part of the package: it uses torch, the standard library
and Lightning's ``find_free_network_port`` (``ddp_strategy.process.free_port``) only, as a user's test would.
"""

from ddp_strategy.testing.checks import (
    assert_each_sample_once,
    assert_matches_single_process,
    assert_same_on_every_rank,
)
from ddp_strategy.testing.ranks import RankError, run_on_ranks

__all__ = [
    "RankError",
    "assert_each_sample_once",
    "assert_matches_single_process",
    "assert_same_on_every_rank",
    "run_on_ranks",
]
