"""Equal-count evaluation batches and the batch-count agreement, in one process."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from ddp_strategy.sampling.loaders import LoaderSharding, needs_padding
from ddp_strategy.sampling.sampler import (
    EpochSeededDistributedSampler,
    EqualCountBatchSampler,
    Shard,
    ShardedBatchSampler,
)


def test_counts_that_need_the_peers_are_agreed_at_the_stage_start_only_where_a_loader_is_not_ours():
    """agree_counts (the strategy's on_*_start), without a process group, on the counts prepare took for loaders that
    are not ours: a sized loader's and a list of batches' (uneven: no), an IterableDataset's length is only a hint
    (uneven: yes, at every run: the counts stay until teardown); nothing pending: no."""
    sharding, trainer = LoaderSharding(), SimpleNamespace(state=SimpleNamespace(stage="validate", fn="validate"))
    sharding._injecting = False  # (use_distributed_sampler=False: the user's loaders, as prepared)
    assert sharding.agree_counts() is False
    for loader in (DataLoader(TensorDataset(torch.arange(9)), batch_size=4), [1, 2]):
        sharding.prepare(loader, trainer, 1, 0, 0)
    assert sharding._pending == [3, 2] and sharding.agree_counts() is False
    sharding.prepare(DataLoader(_Stream()), trainer, 1, 0, 0)
    assert sharding.agree_counts() is True and sharding.agree_counts() is True


class _Stream(IterableDataset):
    def __iter__(self):
        return iter(range(3))

    def __len__(self) -> int:
        return 3


def _layout(n: int, batch: int, world: int) -> list[list[list[int]]]:
    """Every rank's batches of an unshuffled evaluation loader of ``n`` samples."""
    return [
        list(
            EqualCountBatchSampler(
                EpochSeededDistributedSampler(list(range(n)), world, r, shuffle=False, pad=False), batch
            )
        )
        for r in range(world)
    ]


def test_equal_count_batches_match_the_documented_example():
    """17 samples, batch 4, 2 ranks: the layout in EqualCountBatchSampler's docstring."""
    assert _layout(17, 4, 2) == [[[0, 2, 4, 6], [8, 10, 12, 14], [16]], [[1, 3, 5], [7, 9, 11, 13], [15]]]


@pytest.mark.parametrize(
    ("n", "batch", "world"), [(3, 4, 2), (21, 4, 2), (9, 4, 2), (10, 3, 3), (23, 2, 3), (8, 2, 4), (7, 5, 3)]
)
def test_equal_count_batches_keep_every_sample_once_in_lightnings_number_of_steps(n, batch, world):
    """Every rank makes ceil(ceil(N/W)/B) non-empty batches of at most B, and the samples are covered once."""
    layout = _layout(n, batch, world)
    steps = math.ceil(math.ceil(n / world) / batch)
    assert all(len(batches) == steps and all(1 <= len(b) <= batch for b in batches) for batches in layout)
    assert sorted(i for batches in layout for b in batches for i in b) == list(range(n))


def test_needs_padding_only_where_no_exact_layout_exists():
    """Multiples of W and B >= 2 are exact; batch_size=1, batch_size=None, drop_last, N < W are padded."""
    data = TensorDataset(torch.arange(5))
    assert needs_padding(DataLoader(TensorDataset(torch.arange(6)), batch_size=1), 2) is None
    assert needs_padding(DataLoader(data, batch_size=2), 2) is None
    assert "batch_size=1" in needs_padding(DataLoader(data, batch_size=1), 2)
    assert "batch_size=None" in needs_padding(DataLoader(data, batch_size=None), 2)
    assert "drop_last=True" in needs_padding(DataLoader(data, batch_size=2, drop_last=True), 2)
    assert "fewer samples (5) than ranks (8)" in needs_padding(DataLoader(data, batch_size=2), 8)


def test_custom_batch_sampler_shards_get_equal_counts_by_halving_a_batch():
    """5 user batches on 2 ranks: rank 1 holds 2 and halves its first batch of 2+ samples; every index once."""
    batches = [[0, 1, 2], [3], [4, 5], [6, 7], [8]]
    layout = [list(ShardedBatchSampler(batches, Shard(2, r, pad=False))) for r in range(2)]
    assert layout == [[[0, 1, 2], [4, 5], [8]], [[3], [6], [7]]]
