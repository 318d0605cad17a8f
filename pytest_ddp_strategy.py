"""pytest plugin of ``ddp_strategy`` (entry point ``pytest11: ddp_strategy``): the ``ddp_ranks`` fixture and marker.

A module of its own, outside the ``ddp_strategy`` package, so that pytest can load it without importing torch
or Lightning: nothing heavy is imported until a test asks for the fixture (disable it with
``-p no:ddp_strategy``). The kit itself is :mod:`ddp_strategy.testing`.

    @pytest.mark.ddp(world_size=2, timeout_s=60)
    def test_my_metric(ddp_ranks):
        per_rank = ddp_ranks(my_rank_function)   # run_on_ranks with the marker's settings
"""

from __future__ import annotations

from typing import Any

import pytest


def pytest_configure(config: pytest.Config) -> None:
    """Register the ``ddp`` marker."""
    config.addinivalue_line(
        "markers", "ddp(world_size=2, timeout_s=60, **run_on_ranks_options): defaults for the ddp_ranks fixture")


@pytest.fixture
def ddp_ranks(request: pytest.FixtureRequest) -> Any:
    """``run_on_ranks`` with the defaults of the test's ``@pytest.mark.ddp(...)`` (world size 2, 60 s deadline).

    Call it with the per-rank function (defined at module level) and any ``run_on_ranks`` argument; it returns
    every rank's value. No rank process or temporary file outlives the call.
    """
    import functools

    from ddp_strategy.testing import run_on_ranks

    marker = request.node.get_closest_marker("ddp")
    defaults = dict(marker.kwargs) if marker else {}
    return functools.partial(run_on_ranks, **defaults)
