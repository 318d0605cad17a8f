"""Sampler positions as plain data: padding, remainders after one or more runs, merging, reading, checking."""

from __future__ import annotations

import io
import warnings
from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import DataLoader

from ddp_strategy._compat.namespace import TrainerFn
from ddp_strategy.sampling.loaders import LoaderSharding, inject_distributed_sampler, injected_sampler
from ddp_strategy.sampling.sampler import EpochSeededDistributedSampler, Shard, ShardedBatchSampler, remaining_positions
from ddp_strategy.sampling.state import (
    CHECKPOINT_KEY,
    LIGHTNING_NOT_RESUMABLE_WARNING,
    read_positions,
    restore_batch_counter,
    save_positions,
)


def test_padding_repeats_the_head_like_distributed_sampler():
    """Padding repeats the stream's head, cycling when more than one round is needed; nothing pads nothing."""
    assert [list(EpochSeededDistributedSampler(range(3), 2, r, shuffle=False)) for r in range(2)] == [[0, 2], [1, 0]]
    assert [list(EpochSeededDistributedSampler(range(2), 5, r, shuffle=False)) for r in range(5)] == [
        [0],
        [1],
        [0],
        [1],
        [0],
    ]
    assert [list(EpochSeededDistributedSampler(range(0), 3, r)) for r in range(3)] == [[], [], []]


def test_remaining_positions_the_docstring_example_and_uneven_consumption():
    """N = 10, 2 ranks that each took 2: positions 4..9 are left; uneven counts remove exactly their positions."""
    assert remaining_positions(10, [{"world_size": 2, "consumed": [2, 2]}]) == [4, 5, 6, 7, 8, 9]
    assert remaining_positions(10, [{"world_size": 2, "consumed": [3, 1]}]) == [3, 5, 6, 7, 8, 9]
    # padded positions (>= N) that were consumed are ignored
    assert remaining_positions(5, [{"world_size": 2, "consumed": [3, 3]}]) == []


def test_layers_compose_across_elastic_resumes():
    """A second run (W=3) on the remainder of a first (W=2) removes positions of that remainder."""
    layers = [{"world_size": 2, "consumed": [2, 2]}, {"world_size": 3, "consumed": [1, 1, 1]}]
    assert remaining_positions(10, layers) == [7, 8, 9]


def test_a_resumed_remainder_is_padded_for_training_only():
    """The rest of an epoch (positions 4..6 of 7) is padded with the stream's head in training, not in evaluation."""
    position = {"epoch": 0, "seed": 0, "length": 7, "kind": "index", "layers": [{"world_size": 2, "consumed": [2, 2]}]}
    shards = {}
    for pad in (True, False):
        sampler = EpochSeededDistributedSampler(range(7), 2, 1, shuffle=False, pad=pad)
        sampler.resume_from(position)
        shards[pad] = list(sampler)
    assert shards == {True: [5, 0], False: [5]}


def _fitting(loader) -> SimpleNamespace:
    """The parts of a fitting Trainer that save_positions reads: training loaders, 3 of 9 batches done
    (processed)."""
    progress = SimpleNamespace(current=SimpleNamespace(ready=4, processed=3))  # batch 4 interrupted
    return SimpleNamespace(
        state=SimpleNamespace(fn=TrainerFn.FITTING),
        train_dataloader={"a": [loader]},
        num_training_batches=9,
        fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace(batch_progress=progress)),
    )


def test_save_and_read_positions_without_process_group_and_weights_only_roundtrip():
    """Without a process group the one rank's position is merged alone; the entry survives
    torch.save/torch.load(weights_only=True) and reads back; a checkpoint without it has no positions."""
    loader = inject_distributed_sampler(DataLoader(list(range(9)), batch_size=1), Shard(1, 0, seed=1))
    next(iter(loader))  # starts epoch 0
    checkpoint: dict = {}
    save_positions(_fitting(loader), checkpoint)
    expected = {"epoch": 0, "seed": 1, "length": 9, "kind": "index", "layers": [{"world_size": 1, "consumed": [3]}]}
    assert checkpoint[CHECKPOINT_KEY] == {"version": 1, "loaders": [expected]}
    buffer = io.BytesIO()
    torch.save(checkpoint, buffer)
    buffer.seek(0)
    assert read_positions(torch.load(buffer, weights_only=True)) == [expected]
    assert read_positions({}) == []


def test_every_rank_computes_every_ranks_position_after_earlier_layers():
    """Each rank computes the same entry without a collective: one new layer after the layers its epoch resumed
    from, each rank's count capped at its shard (a resumed remainder of 5 padded to 6, 3 per rank)."""
    start = {"epoch": 0, "seed": 1, "length": 9, "kind": "index", "layers": [{"world_size": 2, "consumed": [2, 2]}]}
    ranks = [EpochSeededDistributedSampler(range(9), 2, r, seed=1) for r in range(2)]
    for s in ranks:
        s.items_per_batch = 2
        s.resume_from(start)
        assert len(list(s)) == 3
    positions = [s.position(2) for s in ranks]
    assert positions[0] == positions[1]
    assert positions[0]["layers"] == [*start["layers"], {"world_size": 2, "consumed": [3, 3]}]
    assert EpochSeededDistributedSampler(range(9), 3, 0).position(5)["layers"] == [
        {"world_size": 3, "consumed": [0, 0, 0]}
    ]  # no epoch started: nothing consumed


def test_bad_entries_are_ignored_with_a_warning():
    """An unknown entry version, a position of another length or kind (the data changed): ignored, with a warning
    saying what is lost (the epoch's data restarts, as under Lightning's ddp)."""
    with pytest.warns(UserWarning, match="not a version-1 sampler position.*It is ignored"):
        assert read_positions({CHECKPOINT_KEY: {"version": 99, "loaders": []}}) == []
    position = {"epoch": 2, "seed": 1, "length": 9, "kind": "index", "layers": [{"world_size": 1, "consumed": [3]}]}
    for sampler, match in (
        (EpochSeededDistributedSampler(range(10), 1, 0), "stream of 9 items of kind 'index', but .* yields 10 "),
        (ShardedBatchSampler([[i] for i in range(9)], Shard(1, 0)), "yields 9 of kind 'batch'.* restarts"),
    ):
        with pytest.warns(UserWarning, match=match):
            sampler.resume_from(position)
        assert sampler.pending_resume_batches(2) is None


def test_a_mid_epoch_resume_sets_lightnings_batch_counter_and_silences_its_warning_until_teardown():
    """6 of 10 samples left (batch 2, one rank): Lightning's counter becomes 5 - 3 = 2 batches done; its 'not
    resumable' warning, which does not apply, is filtered only until teardown (later fits still see it)."""
    loader = inject_distributed_sampler(DataLoader(list(range(10)), batch_size=2), Shard(1, 0))
    injected_sampler(loader).resume_from(
        {"epoch": 0, "seed": 0, "length": 10, "kind": "index", "layers": [{"world_size": 1, "consumed": [4]}]}
    )
    counters = {"ready": 1, "started": 1, "processed": 1, "completed": 1}
    progress = SimpleNamespace(current=SimpleNamespace(**counters), total=SimpleNamespace(**counters))
    trainer = SimpleNamespace(
        train_dataloader=[loader],
        limit_train_batches=1.0,
        num_training_batches=5,
        current_epoch=0,
        world_size=1,
        fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace(batch_progress=progress)),
    )
    sharding, before = LoaderSharding(), list(warnings.filters)
    restore_batch_counter(trainer, sharding.until_teardown)
    assert progress.current.ready == progress.total.completed == 2 and injected_sampler(loader).batch_offset == 2
    assert warnings.filters[0][0] == "ignore" and warnings.filters[0][1].match(LIGHTNING_NOT_RESUMABLE_WARNING)
    assert [i for b in loader for i in b.tolist()] == [4, 5, 6, 7, 8, 9]
    sharding.hand_back(None)
    assert warnings.filters == before
