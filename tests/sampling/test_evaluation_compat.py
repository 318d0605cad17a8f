"""Drop-in compatibility with Lightning's ddp, evaluation part (issue 12): real 2-process gloo runs.

Two launches: the evaluation-collective patterns on 3, 21, 17 and 5 validation samples (the same module
also under Lightning's ``strategy="ddp"``), and a per-step ``torch.distributed`` collective (torchmetrics) on
uneven predict shards, under the uneven-inputs join. See tests/sampling/evaluation_workers.py; BatchNorm buffers
during validation are in tests/sync/test_broadcast_buffers.py.
"""

from __future__ import annotations

import collections
import math
from pathlib import Path

import pytest
import torch
from ddp_testing import launch, load
from evaluation_workers import Samples, score

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(400)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """All launches; returns the folder holding every rank's records."""
    out = tmp_path_factory.mktemp("compat")
    launch("evaluation_workers:scenario_collectives", 2, out)
    return out


def scores(n: int) -> torch.Tensor:
    return score(Samples(n).x)


def flat_steps(records: list[dict], key: str) -> list:
    """Every row of every per-step all_gather (the usual ``flatten(0, 1)``), on rank 0."""
    rows: list = []
    for gathered in records[0]["step_gathers"]:
        value = gathered["idx"] if key == "idx" else gathered["score"][0]
        rows += value.flatten(0, 1).tolist()
    return rows


@pytest.mark.parametrize(("n", "batch"), [(3, 4), (21, 4), (17, 4)])
def test_exact_shards_have_equal_batch_counts_and_each_sample_once(runs, n, batch):
    """Every rank takes ceil(ceil(N/W)/B) steps (Lightning's count), and every sample is evaluated exactly once."""
    records = load(runs, f"mine_{n}_{batch}", 2)
    steps = math.ceil(math.ceil(n / 2) / batch)
    assert [len(r["batches"]) for r in records] == [steps, steps]
    assert sorted(i for r in records for b in r["batches"] for i in b) == list(range(n))
    assert records[0]["batches"][0] == list(range(0, 2 * batch, 2))[: -(-n // 2)]  # rank 0 batches as usual
    assert len(records[1]["batches"][0]) == min(batch, n // 2) - (n % 2 if n // 2 >= batch else 0)


@pytest.mark.parametrize(("n", "batch"), [(3, 4), (21, 4), (17, 4)])
def test_per_step_collectives_meet_with_exact_values(runs, n, batch):
    """reduce, broadcast, barrier, on_step sync_dist and dist_sync_on_step torchmetrics in every step: right values."""
    records = load(runs, f"mine_{n}_{batch}", 2)
    s = scores(n)
    for k, (b0, b1) in enumerate(zip(records[0]["batches"], records[1]["batches"], strict=True)):
        for rec in records:
            assert rec["reduced"][k] == len(b0) + len(b1)  # strategy.reduce(sum) met the other rank's step
            assert rec["broadcast"][k] == b0  # rank 0's object
            # torchmetrics with dist_sync_on_step=True: this step's batches of both ranks, each sample once.
            assert rec["step_metric"][k] == pytest.approx(s[b0 + b1].mean().item(), abs=1e-6)
    for rec in records:
        assert rec["step_metric_epoch"] == pytest.approx(s.mean().item(), abs=1e-6)  # exact: no duplicate
        assert rec["epoch_metric"] == pytest.approx(s.mean().item(), abs=1e-6)
        assert rec["metrics"]["mean_epoch"] == pytest.approx(s.mean().item(), abs=1e-6)  # sample-weighted


@pytest.mark.parametrize(("n", "batch"), [(3, 4), (21, 4), (17, 4)])
def test_uneven_all_gather_pads_as_lightnings_sampler_and_warns_once(runs, n, batch):
    """all_gather with first dims differing: (W, max, ...), padding = the samples Lightning's sampler repeats."""
    records = load(runs, f"mine_{n}_{batch}", 2)
    s = scores(n)
    half = -(-n // 2)
    # Epoch end, per-sample outputs: exactly Lightning's padded shards [0, 2, ...] and [1, 3, ..., 0].
    lightning_shards = [list(range(0, n, 2)), list(range(1, n, 2)) + [0]]
    for rec in records:
        assert rec["epoch_gather"].shape == (2, half)
        torch.testing.assert_close(rec["epoch_gather"], s[torch.tensor(lightning_shards)])
        torch.testing.assert_close(rec["epoch_rows"], s)  # all_gather_rows: each sample once, data set order
    # Per step (a nested collection): flatten(0, 1) over the epoch = every sample once + Lightning's repeat of 0.
    expected = collections.Counter(range(n)) + collections.Counter([0])
    assert collections.Counter(flat_steps(records, "idx")) == expected
    torch.testing.assert_close(
        torch.tensor(sorted(flat_steps(records, "score"))),
        torch.sort(s[torch.tensor(sorted(expected.elements()))]).values,
    )
    warned = [w for w in records[0]["warnings"] if "all_gather got first dimensions" in w]
    assert len(warned) == 1 and "all_gather_rows" in warned[0]
    assert not any("all_gather got" in w for w in records[1]["warnings"])  # rank 0 only


def test_uneven_all_gather_keeps_sync_grads_and_refuses_other_dimensions(runs):
    """sync_grads: each row's gradient counts its copies on every rank; (2, 1) vs (2, 2): ValueError on both ranks."""
    records = load(runs, "mine_3_4", 2)
    # Result [[a0, a1], [b0, a0]] on both ranks; d(sum)/d(row) = W x copies of the row.
    assert records[0]["gather_grad"] == [4.0, 2.0] and records[1]["gather_grad"] == [2.0]
    for rank, rec in enumerate(records):
        assert f"[rank {rank}] all_gather needs tensors" in rec["bad_shape"]
        assert "rank 0: (2, 1), rank 1: (2, 2)" in rec["bad_shape"]


def test_equal_shapes_give_lightnings_stack(runs):
    """A step whose batches are equal on both ranks returns torch.stack of them, shape (W, B), as Lightning's."""
    records = load(runs, "mine_17_4", 2)
    gathered = records[0]["step_gathers"][1]["idx"]
    assert gathered.tolist() == [records[0]["batches"][1], records[1]["batches"][1]]


def test_same_values_as_lightnings_ddp_where_lightning_pads(runs):
    """17 samples: gathers equal Lightning's ddp; our epoch metrics are exact where Lightning's count sample 0 twice."""
    mine, theirs = load(runs, "mine_17_4", 2), load(runs, "lightning_17_4", 2)
    s = scores(17)
    for a, b in zip(mine, theirs, strict=True):
        torch.testing.assert_close(a["epoch_gather"], b["epoch_gather"])
        assert len(a["batches"]) == len(b["batches"])  # the same number of steps
    assert sorted(flat_steps(mine, "idx")) == sorted(flat_steps(theirs, "idx"))
    padded_mean = torch.cat([s, s[:1]]).mean().item()
    assert theirs[0]["metrics"]["mean_epoch"] == pytest.approx(padded_mean, abs=1e-6)
    assert theirs[0]["step_metric_epoch"] == pytest.approx(padded_mean, abs=1e-6)
    assert mine[0]["metrics"]["mean_epoch"] == pytest.approx(s.mean().item(), abs=1e-6)
    assert abs(padded_mean - s.mean().item()) > 1e-3


def test_no_exact_layout_pads_like_lightning_with_one_warning(runs):
    """5 samples, batch_size=1: shards padded as Lightning's, every value equal to Lightning's, rank 0 warns once."""
    mine, theirs = load(runs, "mine_5_1", 2), load(runs, "lightning_5_1", 2)
    for a, b in zip(mine, theirs, strict=True):
        assert a["batches"] == b["batches"] == ([[0], [2], [4]] if a is mine[0] else [[1], [3], [0]])
        torch.testing.assert_close(a["epoch_gather"], b["epoch_gather"])
        for key in ("step_metric_epoch", "epoch_metric"):
            assert a[key] == pytest.approx(b[key], abs=1e-6)
        assert a["metrics"]["mean_epoch"] == pytest.approx(b["metrics"]["mean_epoch"], abs=1e-6)
    warned = [w for w in mine[0]["warnings"] if "are padded" in w]
    assert len(warned) == 1 and "batch_size=1" in warned[0] and "1 sample(s) are evaluated twice" in warned[0]
    assert not any("are padded" in w for w in mine[1]["warnings"])


def test_a_per_step_metric_sync_on_uneven_predict_shards_gives_the_ranks_holding_the_step(tmp_path):
    """torchmetrics SumMetric(dist_sync_on_step=True) in predict_step, 9 samples, batch 4 (Lightning's predict shards:
    rank 0 [0 2 4 6] [8], rank 1 [1 3 5 7]): step 0 returns the sum over both ranks' batches, rank 0's second step
    (rank 1 is out of data) its own batch's, not a hang (the uneven-inputs join)."""
    launch("evaluation_workers:scenario_predict_metric", 2, tmp_path)
    records, s = load(tmp_path, "predict_metric", 2), scores(9)
    assert records[0]["predictions"] == pytest.approx([s[:8].sum().item(), s[8].item()], abs=1e-5)
    assert records[1]["predictions"] == pytest.approx([s[:8].sum().item()], abs=1e-5)


def test_process_dataloader_is_no_collective_as_lightnings(runs):
    """Rank 1 alone calls process_dataloader in validation and it returns: our shards are built on the rank (11
    samples, batch 4: 2 batches for a plain loader and the user's BatchSampler class, kept); the user's
    DistributedSampler loader comes back as it was, its counts left to the stage's start."""
    rank0, rank1 = load(runs, "one_rank_process_dataloader", 2)
    assert rank0 == {}
    assert rank1 == {
        "batches": [2, 2, 2],
        "kept": ["EqualCountBatchSampler", "Mine", "BatchSampler"],
        "own_unchanged": True,
    }


def test_exact_evaluation_false_gives_lightnings_batches_and_values(runs):
    """MyDDPStrategy(exact_evaluation=False): Lightning's padded batches, gathers and metrics, no padding warning."""
    mine, theirs = load(runs, "mine_lightning_layout_17_4", 2), load(runs, "lightning_17_4", 2)
    for a, b in zip(mine, theirs, strict=True):
        assert a["batches"] == b["batches"] and a["batches"][-1] == ([16] if a is mine[0] else [0])
        torch.testing.assert_close(a["epoch_gather"], b["epoch_gather"])
        assert a["metrics"]["mean_epoch"] == pytest.approx(b["metrics"]["mean_epoch"], abs=1e-6)
        assert a["step_metric"] == pytest.approx(b["step_metric"], abs=1e-6)
        assert not any("are padded" in w or "all_gather got" in w for w in a["warnings"])
