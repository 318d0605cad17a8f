"""The collectives of ddp_strategy/process/collectives.py: the shape check of an uneven ``all_gather`` (one
process), and ``all_gather_rows`` on 2 real gloo ranks (the testing kit). The strategy's ``all_gather`` under
uneven evaluation shards, against Lightning's, is in tests/sampling/test_evaluation_compat.py."""

from __future__ import annotations

import pytest
import torch

from ddp_strategy import all_gather_rows
from ddp_strategy.process.collectives import check_gatherable
from ddp_strategy.testing import run_on_ranks


def test_all_gather_shape_error_names_every_shape_and_its_suggestion_works():
    """Only the first dimension may differ: anything else is refused with every rank's shape; padded to a common
    trailing shape they pass."""
    check_gatherable([(3, 2), (1, 2)], 0)
    with pytest.raises(ValueError, match=r"\[rank 1\].*rank 0: \(3, 2\), rank 1: \(3, 4\)"):
        check_gatherable([(3, 2), (3, 4)], 1)
    with pytest.raises(ValueError, match="rank 0: \\(\\)"):
        check_gatherable([(), ()], 0)
    with pytest.raises(ValueError, match="Pad or reshape them to a common shape"):
        check_gatherable([(3, 4), (2, 5)], 0)
    check_gatherable([(3, 5), (2, 5)], 0)


def gather_dealt_rows(rank: int, world_size: int) -> list[list[int]]:
    """5 samples dealt to 2 ranks as a DistributedSampler without padding deals them (rank 0: 0, 2, 4; rank 1: 1,
    3): each rank's rows ``[i, 10 * i]``, gathered."""
    rows = torch.tensor([[i, 10 * i] for i in range(rank, 5, world_size)])
    return all_gather_rows(rows).tolist()


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_all_gather_rows_gives_every_row_once_in_the_data_sets_order():
    """Ranks holding 3 and 2 rows get all 5 rows, each once, in the data set's order, on both ranks; without a
    process group the tensor comes back as it is."""
    expected = [[i, 10 * i] for i in range(5)]
    assert run_on_ranks(gather_dealt_rows, 2, timeout_s=60) == [expected, expected]
    alone = torch.arange(6).reshape(3, 2)
    assert torch.equal(all_gather_rows(alone), alone)
