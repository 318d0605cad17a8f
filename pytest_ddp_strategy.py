"""pytest plugin of ``ddp_strategy`` (entry point ``pytest11: ddp_strategy``): the ``ddp_ranks`` fixture and marker.

A module of its own, outside the ``ddp_strategy`` package, so that pytest can load it without importing torch
or Lightning: nothing heavy is imported until a test asks for the fixture (disable it with
``-p no:ddp_strategy``). The kit itself is :mod:`ddp_strategy.testing`.

    @pytest.mark.ddp(world_size=2, timeout_s=60)          # or @pytest.mark.ddp(2)
    def test_my_metric(ddp_ranks):
        per_rank = ddp_ranks(my_rank_function)   # run_on_ranks with the marker's settings
"""

from __future__ import annotations

from typing import Any

import pytest


def pytest_configure(config: pytest.Config) -> None:
    """Register the ``ddp`` marker."""
    config.addinivalue_line(
        "markers",
        "ddp(world_size=2, timeout_s=60, **run_on_ranks_options): defaults for the ddp_ranks fixture;"
        " the world size may also be the one positional argument, ddp(3)",
    )


def _marker_options(marker: pytest.Mark | None) -> dict[str, Any]:
    """The ``run_on_ranks`` options a ``@pytest.mark.ddp(...)`` marker gives (``{}`` without a marker).

    ``ddp(3)`` and ``ddp(world_size=3)`` mean the same; every keyword is a ``run_on_ranks`` keyword.

    Raises:
        ValueError: more than one positional argument, the world size given both ways, or a keyword that is
            not a ``run_on_ranks`` option; the message shows how to write the marker.
    """
    import inspect

    from ddp_strategy.testing import run_on_ranks

    if marker is None:
        return {}
    usage = "write it as @pytest.mark.ddp(3) or @pytest.mark.ddp(world_size=3, timeout_s=60, ...)"
    options = dict(marker.kwargs)
    if len(marker.args) > 1:
        raise ValueError(
            f"@pytest.mark.ddp takes at most one positional argument, the world size; got {marker.args!r}: {usage}."
        )
    if marker.args and "world_size" in options:
        raise ValueError(
            f"@pytest.mark.ddp got the world size both as {marker.args[0]!r} and as"
            f" world_size={options['world_size']!r}: {usage}."
        )
    if marker.args:
        options["world_size"] = marker.args[0]
    accepted = [name for name in inspect.signature(run_on_ranks).parameters if name != "fn"]
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise ValueError(
            f"@pytest.mark.ddp got {unknown}, which run_on_ranks does not take; its options are {accepted}: {usage}."
        )
    return options


@pytest.fixture
def ddp_ranks(request: pytest.FixtureRequest) -> Any:
    """``run_on_ranks`` with the defaults of the test's ``@pytest.mark.ddp(...)`` (world size 2, 60 s deadline).

    Call it with the per-rank function (defined at module level) and any ``run_on_ranks`` argument, which
    overrides the marker's (``ddp_ranks(fn, 4)`` runs 4 ranks whatever the marker says); it returns every rank's
    value. No rank process, no process a rank started, and no temporary file outlives the call.

    Raises:
        ValueError: a malformed ``ddp`` marker (see :func:`_marker_options`), when the fixture is set up.
    """
    from ddp_strategy.testing import run_on_ranks

    defaults = _marker_options(request.node.get_closest_marker("ddp"))

    def run(fn: Any, world_size: int | None = None, **options: Any) -> list[Any]:
        if world_size is not None:
            options["world_size"] = world_size
        return run_on_ranks(fn, **{**defaults, **options})

    return run
