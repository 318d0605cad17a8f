"""Sampling input errors and warnings (ddp_strategy/sampling/): what a loader, a batch size or a resumed sampler
position cannot give, raised (or warned) where the loader is sharded, and each fix the message suggests gives the
batches the user wanted. One process: the rank-agnostic helpers are called with ``num_replicas=2`` directly, and
``Trainer(devices=1)`` fits run here; what only 2 ranks raise is in tests/sampling/test_data_compat.py.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from ddp_testing import Regressor, loader, one_rank_trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from ddp_strategy.sampling.loaders import (
    inject_distributed_sampler,
    needs_padding,
    shard_for_evaluation,
    warn_if_not_shardable,
)
from ddp_strategy.sampling.sampler import Shard
from ddp_strategy.sampling.state import CHECKPOINT_KEY

pytestmark = pytest.mark.timeout(120)


def test_a_loader_that_is_not_a_dataloader_is_accepted_with_a_warning(recwarn):
    """A list of batches (Lightning accepts any iterable) is not refused: with 2 ranks a warning says every rank
    reads all of it; with 1 rank, for an empty list (Lightning's "no loader") and for a DataLoader, no warning."""
    batches = [torch.zeros(2, 64)]
    with pytest.warns(UserWarning, match="MyDDPStrategy got a list as a loader.*each of the 2 ranks iterates all"):
        warn_if_not_shardable(batches, world_size=2)
    recwarn.clear()
    warn_if_not_shardable(batches, world_size=1)
    warn_if_not_shardable([], world_size=2)
    warn_if_not_shardable(DataLoader(TensorDataset(torch.zeros(2))), world_size=2)
    assert not recwarn.list


def test_an_iterable_dataset_is_said_to_give_every_rank_the_same_batches_only_unless_it_splits_them(recwarn):
    """An IterableDataset's __iter__ may split the stream by rank (litdata, WebDataset, Hugging Face datasets,
    shard_iterable), which the strategy cannot see: its warning makes the same-batches claim conditional on that;
    the one for a list of batches, which every rank does read whole, stays unconditional."""

    class Stream(IterableDataset):
        def __iter__(self):
            return iter(range(3))

    with pytest.warns(UserWarning) as caught:
        warn_if_not_shardable(DataLoader(Stream()), world_size=2)
    message = str(caught[0].message)
    assert message.startswith("Stream is an IterableDataset, which has no indices to shard: each of the 2 ranks")
    assert "Unless __iter__ splits the data by rank itself (torch.distributed.get_rank(), as" in message
    assert message.endswith("split_dataset_by_node do), every rank sees the same batches.")
    with pytest.warns(UserWarning, match="so each of the 2 ranks iterates all of it") as caught:
        warn_if_not_shardable([torch.zeros(2, 64)], world_size=2)
    assert "Unless" not in str(caught[0].message)


def batches(dataloader: DataLoader, num_replicas: int, pad: bool = True) -> list[list[int]]:
    """Batch sizes each of ``num_replicas`` ranks reads from the injected loader, rank by rank."""
    return [
        [len(b[0]) for b in inject_distributed_sampler(dataloader, Shard(num_replicas, r, pad=pad))]
        for r in range(num_replicas)
    ]


def evaluated(dataloader: DataLoader, num_replicas: int) -> list[list[int]]:
    """Batch sizes each of ``num_replicas`` ranks reads from the evaluation loader the strategy builds, rank by rank."""
    return [
        [len(b[0]) for b in shard_for_evaluation(dataloader, Shard(num_replicas, r), "validation")]
        for r in range(num_replicas)
    ]


def test_drop_last_without_a_batch_error_suggestions_work():
    """5 samples, 2 ranks, batch_size=4, drop_last=True: no rank gets a batch. Lowering batch_size to 3,
    drop_last=False or one device each gives every rank a batch."""
    with pytest.raises(
        ValueError,
        match=r"drop_last=True with batch_size=4, but a rank's shard has only 3 sample\(s\) \(5 over 2 ranks\).*"
        "Lower batch_size to at most 3, set drop_last=False, or use fewer devices",
    ):
        batches(loader(5, 4, drop_last=True), 2)
    with pytest.raises(ValueError, match="drop_last=True with batch_size=6"):  # an unpadded (evaluation) shard
        batches(loader(10, 6, drop_last=True), 2, pad=False)
    assert batches(loader(5, 3, drop_last=True), 2) == [[3], [3]]
    assert batches(loader(5, 4, drop_last=False), 2) == [[3], [3]]
    assert batches(loader(5, 4, drop_last=True), 1) == [[4]]


def test_fewer_samples_than_ranks_are_evaluated_padded_as_under_lightning_and_the_suggestions_work():
    """An evaluation loader of 1 sample, or of 1 custom batch, on 2 ranks runs as under Lightning's ddp: padded, both
    ranks read it, with a warning; its suggestions (2 samples, or 1 device) read each sample once; an empty loader
    (drop_last or not, evaluation or training) gives every rank no batch, with no error and no warning (Lightning's
    ddp skips it)."""
    with pytest.warns(
        UserWarning, match=r"fewer samples \(1\) than ranks \(2\).* at least 2 samples, or fewer devices"
    ):
        assert evaluated(loader(1, 1), 2) == [[1], [1]]
    one_batch = DataLoader(TensorDataset(torch.arange(2)), batch_sampler=[[0, 1]])  # no batch_size: sharded whole
    with pytest.warns(UserWarning, match=r"The loader has fewer batches \(1\) than ranks \(2\)"):
        assert evaluated(one_batch, 2) == [[2], [2]]
    assert evaluated(loader(2, 1), 2) == [[1], [1]]
    assert evaluated(loader(1, 1), 1) == [[1]]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert evaluated(loader(0, 1), 2) == [[], []]
        # drop_last=True too (it was refused, advising batch_size "at most 0"); training shards likewise
        assert evaluated(loader(0, 1, drop_last=True), 2) == [[], []]
        assert batches(loader(0, 1, drop_last=True), 2) == [[], []]


def test_a_training_batch_larger_than_a_shard_runs_with_a_warning_whose_suggestion_removes_it():
    """10 samples, batch_size=6, 2 ranks: Lightning's ddp runs it (one batch of 5 per rank), so do we, and warn;
    batch_size=4 with 6 samples, and batch_size=2 with 2 (a shard of 1), warn likewise, and the suggested batch
    sizes, 3 and 1, give full batches, silently."""
    data = DataLoader(TensorDataset(torch.arange(10)), batch_size=6)
    with pytest.warns(UserWarning, match=r"batch_size=6 is per device.*only 5 sample\(s\) \(10 over 2 ranks\)"):
        new = inject_distributed_sampler(data, Shard(2, 1, 0, pad=True))
    assert [b[0].tolist() for b in new] == [[1, 3, 5, 7, 9]]
    with pytest.warns(UserWarning, match="Lower batch_size to at most 3"):
        assert batches(loader(6, 4), 2) == [[3], [3]]
    with pytest.warns(UserWarning, match=r"only 1 sample\(s\) \(2 over 2 ranks\).*Lower batch_size to at most 1 "):
        assert batches(loader(2, 2), 2) == [[1], [1]]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert batches(loader(6, 3), 2) == [[3], [3]]
        assert batches(loader(2, 1), 2) == [[1], [1]]


def test_padded_evaluation_warning_suggestions_give_exact_shards():
    """An evaluation loader that cannot be sharded exactly warns; each suggested change (batch_size >= 2 and
    drop_last=False with at least W samples, or a multiple of W samples) reads every sample exactly once."""
    for padded in (loader(5, 1), loader(5, 2, drop_last=True), loader(1, 4)):
        with pytest.warns(UserWarning, match="For exact metrics use batch_size >= 2 and drop_last=False with at"):
            shard_for_evaluation(padded, Shard(2, 0), "validation")
    for exact in (loader(5, 2), loader(6, 1), loader(2, 4)):
        assert needs_padding(exact, 2) is None
        shards = [[len(b[0]) for b in shard_for_evaluation(exact, Shard(2, r), "validation")] for r in (0, 1)]
        assert sum(map(sum, shards)) == len(exact.dataset)
        assert len(shards[0]) == len(shards[1])


# ---------------------------------------------------------------------------- resumed positions
def test_changed_data_resume_warning_suggestions_work(tmp_path):
    """Resuming mid-epoch with more data warns and restarts the epoch's data (as Lightning's ddp runs it: the
    side-by-side run is tests/sampling/test_stop_and_resume.py); the warning's suggestions work: the same data
    resumes mid-epoch without it, and a checkpoint saved at the end of an epoch resumes with the new data (8
    samples -> 10: epoch 1 takes 5 steps)."""
    mid_ck = ModelCheckpoint(dirpath=tmp_path / "mid", every_n_train_steps=2, save_top_k=-1)
    end_ck = ModelCheckpoint(dirpath=tmp_path / "end")
    one_rank_trainer(tmp_path, max_epochs=1, callbacks=[mid_ck, end_ck], enable_checkpointing=True).fit(
        Regressor(), loader(8)
    )
    mid, end = tmp_path / "mid" / "epoch=0-step=2.ckpt", tmp_path / "end" / "epoch=0-step=4.ckpt"
    changed = "written in the middle of epoch 0 for a training stream of 8 items.* now yields 10.* same training data"
    with pytest.warns(UserWarning, match=changed):
        one_rank_trainer(tmp_path, max_epochs=1).fit(Regressor(), loader(10), ckpt_path=mid)
    for data, ckpt_path, steps in ((8, mid, 4), (10, end, 4 + 5)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            run = one_rank_trainer(tmp_path, max_epochs=1 if ckpt_path == mid else 2)
            run.fit(Regressor(), loader(data), ckpt_path=ckpt_path)
        assert run.global_step == steps
        assert not any("cannot be found" in str(w.message) for w in caught)


def test_checkpoint_with_an_unknown_sampler_entry_loads_with_a_warning(tmp_path):
    """A sampler entry of another version (Lightning's ddp ignores unknown keys) warns and fits on; no refusal."""
    first = one_rank_trainer(tmp_path, max_epochs=1, enable_checkpointing=True)
    first.fit(Regressor(), loader(8))
    path = Path(first.checkpoint_callback.best_model_path)
    checkpoint = torch.load(path, weights_only=True)
    checkpoint[CHECKPOINT_KEY] = {"version": 99, "loaders": "elsewhere"}
    torch.save(checkpoint, tmp_path / "other.ckpt")
    resumed = one_rank_trainer(tmp_path, max_epochs=2)
    with pytest.warns(UserWarning, match="not a version-1 sampler position.* It is ignored"):
        resumed.fit(Regressor(), loader(8), ckpt_path=tmp_path / "other.ckpt")
    assert resumed.global_step == 8
