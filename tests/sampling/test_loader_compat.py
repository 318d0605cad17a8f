"""What the user asked of a loader survives under MyDDPStrategy as under Lightning's ddp (issue 26): ``drop_last``
on evaluation loaders, and the user's own ``BatchSampler`` subclass in ``trainer.*_dataloaders``, in every stage.

One launch each of 1 and 2 gloo processes runs the same user code under both strategies (tests/sampling/
loader_workers.py): a fit with validation, then validate, test and predict.
"""

from __future__ import annotations

import pytest
from ddp_testing import launch, load
from loader_workers import BATCH, N

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(400)]


@pytest.fixture(scope="module", params=[1, 2], ids=["1-process", "2-processes"])
def runs(request, tmp_path_factory) -> tuple[list[dict], list[dict], int]:
    """(ours, Lightning's ddp, W): every rank's records of one launch on W processes."""
    out = tmp_path_factory.mktemp(f"loaders_{request.param}")
    launch("loader_workers:scenario", request.param, out)
    return load(out, "mine", request.param), load(out, "lightning", request.param), request.param


def test_drop_last_evaluation_loaders_read_lightnings_samples_in_its_steps(runs):
    """10 samples, batch 4, drop_last=True, in fit's validation, validate and test: every rank evaluates the samples
    Lightning's ddp evaluates, in as many steps (1 process: 8 in 2; 2 processes: 4 each, in 1 step each)."""
    mine, lightning, world = runs
    per_rank = -(-N // world) // BATCH
    for a, b in zip(mine, lightning, strict=True):
        for stage in ("fit_val", "val", "test"):
            assert a[stage][0] == b[stage][0], stage
            assert len(a[stage][0]) == per_rank and all(len(batch) == BATCH for batch in a[stage][0])
    assert sum(len(batch) for rec in mine for batch in rec["val"][0]) == per_rank * BATCH * world


def test_the_users_batch_sampler_class_survives_in_every_stage(runs):
    """A Labelled(BatchSampler) built in the hooks is, in trainer.train_dataloader, val_dataloaders, test_dataloaders
    and predict_dataloaders, the user's class with its label, method, batch size and drop_last (predict: inside
    Lightning's index wrapper, drop_last=False), exactly as under Lightning's ddp; its batches are Lightning's."""
    mine, lightning, _ = runs
    for a, b in zip(mine, lightning, strict=True):
        assert a["train_loader"] == b["train_loader"]
        train = a["train_loader"]
        assert train["labelled"] and train["distributed"] and train["describe"] == f"train/{BATCH}/True"
        for key in ("fit_val_loaders", "val_loaders", "test_loaders", "predict_loaders"):
            assert a[key] == b[key], key
            assert a[key][1]["labelled"] and a[key][1]["label"] == key.split("_")[-2], key
        for stage in ("train", "fit_val", "val", "test", "predict"):
            assert a[stage] == b[stage], stage
        assert a["steps"] == b["steps"]


def test_the_users_batch_sampler_class_is_exact_where_its_counts_agree_else_lightnings_with_a_warning(runs):
    """Ready-made Labelled loaders, drop_last=False: 11 samples on 2 ranks make 2 batches on each exact shard, so
    each sample is evaluated once (Lightning's ddp: sample 0 twice) in Lightning's steps; 9 make 2 and 1, so the
    shards are Lightning's padded ones and rank 0 warns once; 1 process: Lightning's batches, no warning."""
    mine, lightning, world = runs
    for r, (a, b) in enumerate(zip(mine, lightning, strict=True)):
        assert a["uneven_val"][0] == b["uneven_val"][0]  # 9 samples
        assert len(a["uneven_val"][1]) == len(b["uneven_val"][1])  # 11 samples: Lightning's number of steps
        assert len(a["padded_warnings"]) == (1 if world == 2 and r == 0 else 0)
    if world == 1:
        assert mine[0]["uneven_val"] == lightning[0]["uneven_val"]
        return
    assert [rec["uneven_val"][1] for rec in mine] == [[[0, 2, 4, 6], [8, 10]], [[1, 3, 5, 7], [9]]]
    assert [rec["uneven_val"][1] for rec in lightning] == [[[0, 2, 4, 6], [8, 10]], [[1, 3, 5, 7], [9, 0]]]
    assert "Labelled makes [2, 1] batches of the exact shards" in mine[0]["padded_warnings"][0]
