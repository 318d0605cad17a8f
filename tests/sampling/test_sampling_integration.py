"""Sampling guarantees with real gloo processes, checked by recorded indices (see tests/sampling/sampling_workers.py).

Four launches (2, 1, 3 and 2 processes) run all the fits: an uninterrupted 2-process fit that writes a
checkpoint in the middle of epoch 1, its resume on 2, 1 and 3 processes, an uninterrupted 1-process fit and
its resume on 2 processes, custom samplers, test, predict, per-step sync and per-step collectives on uneven
predict shards.
"""

from __future__ import annotations

import collections
import math
from pathlib import Path

import pytest
import torch
from ddp_testing import launch, load
from sampling_workers import (
    BATCH,
    CKPT_STEP,
    EPOCHS,
    N_TEST,
    N_TRAIN,
    N_VAL,
    SEED,
    Indexed,
    fixed_prediction,
)
from torch.utils.data import WeightedRandomSampler

from ddp_strategy.checkpoint.io import load_file
from ddp_strategy.sampling.sampler import EpochSeededDistributedSampler, draw_epoch
from ddp_strategy.sampling.state import CHECKPOINT_KEY

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(400)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """All launches, in dependency order; returns the folder holding every rank's records."""
    out = tmp_path_factory.mktemp("sampling")
    launch("sampling_workers:scenario_two", 2, out)
    launch("sampling_workers:scenario_one", 1, out)
    launch("sampling_workers:scenario_three", 3, out)
    launch("sampling_workers:scenario_one_to_two", 2, out)
    return out


def epoch_shard(world_size: int, rank: int, epoch: int) -> list[int]:
    """What an uninterrupted run's rank reads in ``epoch`` (the seed-everything seed is the shuffle seed)."""
    sampler = EpochSeededDistributedSampler(Indexed(N_TRAIN, 0), world_size, rank, seed=SEED)
    sampler.set_epoch(epoch)
    return list(sampler)


def steps_per_epoch(world_size: int) -> int:
    return math.ceil(math.ceil(N_TRAIN / world_size) / BATCH)


def test_shards_are_disjoint_cover_the_data_and_reshuffle_each_epoch(runs):
    """Uninterrupted 2-process fit: each epoch the ranks' indices are disjoint up to padding and cover all samples."""
    full = load(runs, "full2", 2)
    for epoch in range(EPOCHS):
        r0, r1 = full[0]["train"][epoch], full[1]["train"][epoch]
        assert r0 == epoch_shard(2, 0, epoch) and r1 == epoch_shard(2, 1, epoch)
        assert len(r0) == len(r1) == N_TRAIN // 2 and set(r0).isdisjoint(r1)
        assert set(r0) | set(r1) == set(range(N_TRAIN))
    assert full[0]["train"][0] != full[0]["train"][1] != full[0]["train"][2]


def test_checkpoint_holds_every_ranks_position_and_loads_weights_only(runs):
    """The mid-epoch checkpoint stores both ranks' positions as plain data, readable with weights_only=True."""
    checkpoint = load_file(runs / "full2_ckpt" / f"step={CKPT_STEP}.ckpt", weights_only=True)
    done = CKPT_STEP - steps_per_epoch(2)  # batches finished in epoch 1
    assert checkpoint[CHECKPOINT_KEY] == {
        "version": 1,
        "loaders": [
            {
                "epoch": 1,
                "seed": SEED,
                "length": N_TRAIN,
                "kind": "index",
                "layers": [{"world_size": 2, "consumed": [done * BATCH, done * BATCH]}],
            }
        ],
    }


def test_mid_epoch_resume_equals_the_uninterrupted_run(runs):
    """Resuming on 2 processes reads exactly the unseen rest of epoch 1, then identical epochs; same weights."""
    full, resumed = load(runs, "full2", 2), load(runs, "resume2to2", 2)
    done = (CKPT_STEP - steps_per_epoch(2)) * BATCH
    for rank in range(2):
        assert resumed[rank]["train"][1] == full[rank]["train"][1][done:]
        assert resumed[rank]["train"][2] == full[rank]["train"][2]
        assert resumed[rank]["global_step"] == full[rank]["global_step"]
        for name, value in full[rank]["weights"].items():
            torch.testing.assert_close(resumed[rank]["weights"][name], value, rtol=0, atol=1e-6)


def _check_elastic(full: list[dict], resumed: list[dict], epoch: int, done: int, new_world: int) -> None:
    """The resumed epoch covers exactly the old ranks' unseen samples (plus < W' padding); the next is normal."""
    old_world = len(full)
    seen = [i for r in range(old_world) for i in full[r]["train"][epoch][:done]]
    remaining = collections.Counter(range(N_TRAIN)) - collections.Counter(seen)
    got = collections.Counter(i for r in range(new_world) for i in resumed[r]["train"][epoch])
    assert not remaining - got  # every unseen sample is read
    assert sum((got - remaining).values()) < new_world  # anything else is padding: fewer than W' repeats
    assert len({len(resumed[r]["train"][epoch]) for r in range(new_world)}) == 1  # equal steps on every rank
    for r in range(new_world):
        assert resumed[r]["train"][epoch + 1] == epoch_shard(new_world, r, epoch + 1)


def test_elastic_resume_two_to_one_and_two_to_three(runs):
    """The 2-process mid-epoch checkpoint resumed on 1 and on 3 processes covers the rest of epoch 1 exactly once."""
    full = load(runs, "full2", 2)
    done = (CKPT_STEP - steps_per_epoch(2)) * BATCH
    _check_elastic(full, load(runs, "resume2to1", 1), 1, done, 1)
    _check_elastic(full, load(runs, "resume2to3", 3), 1, done, 3)


def test_elastic_resume_one_to_two(runs):
    """The 1-process checkpoint (mid epoch 0) resumed on 2 processes covers the rest of epoch 0 exactly once."""
    full1 = load(runs, "full1", 1)
    assert full1[0]["train"][0] == epoch_shard(1, 0, 0)
    _check_elastic(full1, load(runs, "resume1to2", 2), 0, CKPT_STEP * BATCH, 2)


def test_validation_metrics_are_exact_for_one_two_and_three_processes(runs):
    """torchmetrics accuracy and a sync_dist epoch mean equal the single-process values, for W = 1, 2, 3."""
    data = Indexed(N_VAL, 1)
    exact_acc = (fixed_prediction(data.x) == data.y).float().mean().item()
    exact_value = data.v.mean().item()
    # Lightning's weighting matters here: the unweighted mean of the 2 ranks' means is measurably different.
    naive = (data.v[0::2].mean() + data.v[1::2].mean()).item() / 2
    assert abs(naive - exact_value) > 1e-3
    for name, world in (("full1", 1), ("full2", 2), ("resume2to3", 3), ("resume1to2", 2)):
        records = load(runs, name, world)
        for epoch in records[0]["val"]:
            every = sorted(i for r in range(world) for i in records[r]["val"][epoch])
            assert every == list(range(N_VAL)), (name, epoch)  # each validation sample exactly once
        for rec in records:
            for metrics in rec["val_metrics"]:
                assert metrics["val_acc"] == pytest.approx(exact_acc, abs=1e-6)
                assert metrics["val_value"] == pytest.approx(exact_value, abs=1e-5)


def test_test_and_predict_see_each_sample_once_with_lightning_batch_indices(runs):
    """Test shards (5 and 4 samples, 2 batches each) do not hang, metrics are exact, predict batch indices are right."""
    records = load(runs, "eval", 2)
    assert sorted(records[0]["test"] + records[1]["test"]) == list(range(N_TEST))
    data = Indexed(N_TEST, 2)
    assert records[0]["test_metrics"]["test_value"] == pytest.approx(data.v.mean().item(), abs=1e-5)
    assert records[0]["test_metrics"]["test_acc"] == pytest.approx(
        (fixed_prediction(data.x) == data.y).float().mean().item(), abs=1e-6
    )
    predicted = []
    for rec in records:
        for batch_indices, values in rec["pairs"]:
            assert batch_indices == values  # Lightning's batch_indices name the samples predicted
            predicted += values
    assert sorted(predicted) == list(range(N_TEST))


def test_per_step_sync_dist_in_test_step_meets_and_the_epoch_value_stays_exact(runs):
    """self.log(on_step=True, sync_dist=True) in test_step, 9 samples: 2 batches per rank, each sample once, exact."""
    records = load(runs, "step_sync", 2)
    assert sorted(records[0]["test"] + records[1]["test"]) == list(range(N_TEST))
    data = Indexed(N_TEST, 2)
    for rec in records:
        assert rec["test_metrics"]["test_value_epoch"] == pytest.approx(data.v.mean().item(), abs=1e-5)


def test_per_step_collective_on_uneven_predict_shards_meets_under_the_join(runs):
    """strategy.barrier() in predict_step with 2 vs 1 batches (Lightning's predict sampler): no hang, no error (the
    uneven-inputs join shadows it on the rank out of data), and every sample predicted once."""
    records = load(runs, "step_barrier", 2)
    assert sorted(records[0]["predicted"] + records[1]["predicted"]) == list(range(N_TEST))


def test_weighted_sampler_is_sharded_from_one_shared_draw(runs):
    """WeightedRandomSampler: ranks read interleaved parts of one draw per epoch (injected once, not twice)."""
    records = load(runs, "weighted", 2)
    for epoch in range(2):
        draw = draw_epoch(WeightedRandomSampler(torch.linspace(1, 3, N_TRAIN), num_samples=20), SEED, epoch)
        assert records[0]["train"][epoch] == draw[0::2] and records[1]["train"][epoch] == draw[1::2]
    assert records[0]["train"][0] != records[0]["train"][1]


def test_shuffle_false_keeps_order(runs):
    """A training loader built with shuffle=False reads the data set in order on every rank."""
    records = load(runs, "ordered", 2)
    assert records[0]["train"][0] == list(range(0, N_TRAIN, 2)) and records[1]["train"][0] == list(range(1, N_TRAIN, 2))
