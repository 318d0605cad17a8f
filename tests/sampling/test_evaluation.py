"""Equal-count evaluation batches, the evaluation-step guard and batch-count agreement, in one process."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from ddp_strategy.sampling.loaders import BATCH_COUNTS_ATTR, EvaluationStepGuard, LoaderSharding, needs_padding
from ddp_strategy.sampling.sampler import (
    EpochSeededDistributedSampler,
    EqualCountBatchSampler,
    Shard,
    ShardedBatchSampler,
)


def test_counts_that_need_the_peers_are_agreed_at_the_stage_start_without_process_group_the_local_length():
    """agree_counts (the strategy's on_*_start) keeps this rank's length on each loader prepare left pending."""
    sharding, loader = LoaderSharding(), DataLoader(TensorDataset(torch.arange(9)), batch_size=4)
    sharding._pending = [loader, [1, 2]]
    sharding.agree_counts()
    assert getattr(loader, BATCH_COUNTS_ATTR) == (3,) and sharding._pending == []


def _trainer(val, limit=1.0, sanity=False, sanity_steps=2):
    """The parts of a Trainer the guard reads."""
    return type(
        "Trainer",
        (),
        {
            "val_dataloaders": val,
            "limit_val_batches": limit,
            "sanity_checking": sanity,
            "num_sanity_val_steps": sanity_steps,
        },
    )()


def test_guard_refuses_collectives_only_inside_steps_on_uneven_loaders():
    """Uneven [2, 1]: a collective in the step raises with the counts; outside steps and on even loaders it passes."""
    guard = EvaluationStepGuard()
    uneven, even = DataLoader(range(3)), DataLoader(range(4))
    setattr(uneven, BATCH_COUNTS_ATTR, (2, 1))
    setattr(even, BATCH_COUNTS_ATTR, (2, 2))
    guard.check("reduce", 0)
    with guard.step(_trainer(even), "validation_step", ("batch", 0), {}):
        guard.check("reduce", 0)
    with guard.step(_trainer(uneven, limit=1), "validation_step", ("batch", 0), {}):  # capped at 1 batch each: even
        guard.check("reduce", 0)
    with guard.step(_trainer(uneven, sanity=True, sanity_steps=1), "validation_step", ("batch", 0), {}):
        guard.check("reduce", 0)  # the sanity check's num_sanity_val_steps=1 caps it too
    assert guard.describe_uneven() is None
    with guard.step(_trainer(uneven), "validation_step", ("b", 0), {}):
        with pytest.raises(RuntimeError, match=r"\[rank 1\].*\[2, 1\]"):
            guard.check("reduce", 1)
    guard.check("reduce", 0)  # the step ended
    assert "[2, 1]" in guard.describe_uneven()
    guard.end_stage()
    assert guard.describe_uneven() is None


def test_guard_follows_lightning_limits_and_the_dataloader_index():
    """An int limit caps each rank's batches, a float takes a share, 1.0 or -1 keep them; with several loaders
    (Lightning passes dataloader_idx third, or as a keyword) the guard judges the step's own loader."""
    guard = EvaluationStepGuard()
    even, uneven = DataLoader(range(4)), DataLoader(range(3))
    setattr(even, BATCH_COUNTS_ATTR, (4, 4))
    setattr(uneven, BATCH_COUNTS_ATTR, (4, 2))

    def refuses(trainer, *args, **kwargs) -> bool:
        with guard.step(trainer, "validation_step", args, kwargs):
            try:
                guard.check("reduce", 0)
            except RuntimeError:
                return True
            return False

    assert not refuses(_trainer(uneven, limit=2), "b", 0)
    assert refuses(_trainer(uneven, limit=0.5), "b", 0)  # (2, 1)
    assert refuses(_trainer(uneven, limit=-1), "b", 0)
    assert refuses(_trainer([even, uneven]), "b", 0, 1) and not refuses(_trainer([even, uneven]), "b", 0, 0)
    assert refuses(_trainer({"x": even, "y": uneven}), "b", 0, dataloader_idx=1)
    assert not refuses(_trainer(None), "b", 0)


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
