"""Sampler injection and epoch seeding, in one process (ranks are given explicitly)."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, IterableDataset, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from ddp_strategy.sampler import (
    EpochSeededDistributedSampler,
    inject_distributed_sampler,
    needs_distributed_sampler,
    shared_seed,
)

DATA = TensorDataset(torch.arange(5))


def test_docstring_example_padded_and_unpadded_indices():
    """The docstring's example: 5 samples on 2 ranks, padded for training and unpadded for evaluation."""
    padded = [list(EpochSeededDistributedSampler(DATA, 2, r, shuffle=False)) for r in range(2)]
    exact = [list(EpochSeededDistributedSampler(DATA, 2, r, shuffle=False, pad=False)) for r in range(2)]
    assert padded == [[0, 2, 4], [1, 3, 0]]
    assert exact == [[0, 2, 4], [1, 3]]
    assert [len(EpochSeededDistributedSampler(DATA, 2, r, shuffle=False, pad=False)) for r in range(2)] == [3, 2]


def test_unpadded_shuffled_shards_cover_each_sample_once():
    """Without padding, 3 ranks over 10 shuffled samples see each sample exactly once, in the padded order."""
    data = TensorDataset(torch.arange(10))
    shards = [list(EpochSeededDistributedSampler(data, 3, r, seed=5, pad=False)) for r in range(3)]
    assert sorted(sum(shards, [])) == list(range(10))
    padded_rank0 = list(EpochSeededDistributedSampler(data, 3, 0, seed=5))
    assert shards[0] == padded_rank0[: len(shards[0])]


def test_epoch_fn_reseeds_each_epoch_and_matches_set_epoch():
    """The sampler asks for the epoch when iterated: new order per epoch, equal to DistributedSampler.set_epoch."""
    epoch = {"value": 0}
    data = TensorDataset(torch.arange(20))
    ours = EpochSeededDistributedSampler(data, 2, 1, seed=3, epoch_fn=lambda: epoch["value"])
    reference = DistributedSampler(data, num_replicas=2, rank=1, seed=3)
    orders = []
    for e in range(3):
        epoch["value"] = e
        reference.set_epoch(e)
        orders.append(list(ours))
        assert orders[-1] == list(reference)
    assert orders[0] != orders[1] != orders[2]


def test_shuffle_false_keeps_dataset_order():
    """A loader built with shuffle=False keeps its order on each rank."""
    loader = DataLoader(TensorDataset(torch.arange(8)), batch_size=2, shuffle=False)
    new = inject_distributed_sampler(loader, num_replicas=2, rank=1, seed=0)
    assert [b[0].tolist() for b in new] == [[1, 3], [5, 7]]


def test_injection_keeps_per_device_batch_size_and_shuffles_when_loader_did():
    """Injection keeps batch_size (per device) and other arguments, and shuffles when the loader did."""
    loader = DataLoader(TensorDataset(torch.arange(100)), batch_size=7, shuffle=True, drop_last=True)
    new = inject_distributed_sampler(loader, num_replicas=2, rank=0, seed=11)
    assert new.batch_size == 7 and new.drop_last
    assert isinstance(new.sampler, EpochSeededDistributedSampler) and new.sampler.shuffle
    assert [i for b in new for i in b[0].tolist()] == list(new.sampler)[: 7 * 7]


def test_user_distributed_sampler_and_iterable_datasets_are_left_alone():
    """A user's own DistributedSampler is respected; iterable data sets and non-loaders pass through."""
    data = TensorDataset(torch.arange(8))
    own = DataLoader(data, sampler=DistributedSampler(data, num_replicas=4, rank=3))

    class Stream(IterableDataset):
        def __iter__(self):
            return iter(range(3))

    stream = DataLoader(Stream())
    for obj in (own, stream, [1, 2, 3]):
        assert not needs_distributed_sampler(obj)
        assert inject_distributed_sampler(obj, 2, 0, 0) is obj


def test_shared_seed_prefers_explicit_then_seed_everything(monkeypatch):
    """The shuffle seed is the explicit one, else PL_GLOBAL_SEED from seed_everything, else 0."""
    monkeypatch.delenv("PL_GLOBAL_SEED", raising=False)
    assert shared_seed() == 0
    monkeypatch.setenv("PL_GLOBAL_SEED", "42")
    assert shared_seed() == 42
    assert shared_seed(7) == 7
