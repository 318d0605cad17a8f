"""Sampler positions as plain data: padding, remainders after one or more runs, merging, checking."""

from __future__ import annotations

import io

import pytest
import torch

from ddp_strategy.sampling.state import (
    check_position,
    checkpoint_entry,
    gather_positions,
    loader_positions,
    merge_rank_positions,
    pad_cyclic,
    remaining_positions,
    shard_positions,
)


def test_pad_cyclic_repeats_the_head_like_distributed_sampler():
    """Padding repeats the head, cycling when more than one round is needed."""
    assert pad_cyclic([5, 6, 7], 2, [0, 1]) == [5, 6, 7, 0]
    assert pad_cyclic([5], 4, [0, 1]) == [5, 0, 1, 0]
    assert pad_cyclic([], 3, [0]) == []


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


def test_shard_positions_pads_for_training_only():
    """Training shards are padded with the head; evaluation shards are not."""
    assert shard_positions([4, 5, 6], list(range(7)), 2, 1, pad=True) == [5, 0]
    assert shard_positions([4, 5, 6], list(range(7)), 2, 1, pad=False) == [5]


def test_merge_and_gather_without_process_group_and_weights_only_roundtrip():
    """Per-rank reports merge into one new layer; the entry survives torch.save/torch.load(weights_only=True)."""
    report = {"epoch": 2, "seed": 1, "length": 9, "kind": "index", "layers": [], "consumed": 3}
    merged = merge_rank_positions([report, {**report, "consumed": 3}])
    assert merged["layers"] == [{"world_size": 2, "consumed": [3, 3]}]
    assert gather_positions([report]) == [merge_rank_positions([report])]
    buffer = io.BytesIO()
    torch.save({"x": checkpoint_entry([merged])}, buffer)
    buffer.seek(0)
    assert loader_positions(torch.load(buffer, weights_only=True)["x"]) == [merged]


def test_disagreeing_ranks_and_bad_entries_raise():
    """Ranks reporting different epochs, an unknown entry version, another length or kind: clear errors."""
    report = {"epoch": 2, "seed": 1, "length": 9, "kind": "index", "layers": [], "consumed": 3}
    with pytest.raises(RuntimeError, match="rank 1 on 'epoch'"):
        merge_rank_positions([report, {**report, "epoch": 3}])
    with pytest.raises(ValueError, match="version-1"):
        loader_positions({"version": 99, "loaders": []})
    position = merge_rank_positions([report])
    with pytest.raises(ValueError, match="stream of 9 items, but the training loader now yields 10"):
        check_position(position, 10, "index")
    with pytest.raises(ValueError, match="'index' sampler"):
        check_position(position, 9, "batch")
