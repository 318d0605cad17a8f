"""BatchNorm buffers during validation in ``fit`` (ddp_strategy/sync/): with ``broadcast_buffers=True`` both ranks
validate with rank 0's running statistics, as under Lightning's ``strategy="ddp"``; with False each keeps its own.

One launch of 2 real gloo processes (tests/sync/sync_workers.py: ``scenario_batchnorm``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from ddp_testing import launch, load

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(400)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """The launch; returns the folder holding every rank's records."""
    out = tmp_path_factory.mktemp("batchnorm")
    launch("sync_workers:scenario_batchnorm", 2, out)
    return out


def test_batchnorm_buffers_are_rank_zeros_inside_validation_step(runs):
    """broadcast_buffers=True: inside validation_step both ranks hold rank 0's running_mean, as under Lightning."""
    # Lightning's ddp always shuffles training data, so its numbers differ from ours; the rule is the same.
    for records in (load(runs, "bn_true", 2), load(runs, "bn_lightning", 2)):
        for epoch in range(2):
            before0, before1 = records[0]["before"][epoch], records[1]["before"][epoch]
            assert (before0 - before1).abs().max() > 1e-2  # the ranks drifted apart in training
            for rec in records:
                torch.testing.assert_close(rec["during"][epoch], before0, rtol=0, atol=0)


def test_batchnorm_buffers_stay_per_rank_without_broadcast_buffers(runs):
    """broadcast_buffers=False: each rank validates with its own running statistics."""
    records = load(runs, "bn_false", 2)
    for epoch in range(2):
        for rec in records:
            torch.testing.assert_close(rec["during"][epoch], rec["before"][epoch], rtol=0, atol=0)
        assert (records[0]["during"][epoch] - records[1]["during"][epoch]).abs().max() > 1e-2
