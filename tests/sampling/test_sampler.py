"""Samplers, sampler injection and epoch seeding, in one process (ranks are given explicitly)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    IterableDataset,
    Sampler,
    SequentialSampler,
    SubsetRandomSampler,
    TensorDataset,
    WeightedRandomSampler,
)
from torch.utils.data.distributed import DistributedSampler

from ddp_strategy.sampling.loaders import (
    inject_distributed_sampler,
    injected_sampler,
    warn_if_not_shardable,
)
from ddp_strategy.sampling.sampler import (
    EpochSeededDistributedSampler,
    Shard,
    ShardedBatchSampler,
    ShardedSampler,
    draw_epoch,
    shard_iterable,
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


def test_a_rank_outside_the_world_is_refused_by_torchs_check():
    """The sampler's docstring: rank outside [0, W) raises PyTorch's ValueError, before any sampling."""
    with pytest.raises(ValueError, match=r"Invalid rank 2, rank should be in the interval \[0, 1\]"):
        EpochSeededDistributedSampler(DATA, 2, 2)


def test_the_retired_drop_last_is_torchs_distributed_sampler_which_the_strategy_leaves_alone():
    """EpochSeededDistributedSampler(drop_last=True) is retired (docs/differences.md): torch's DistributedSampler with
    drop_last=True reads what it read, each rank's first N // W samples of the same epoch's stream, and a loader with
    it is left as it is (Lightning's loop calls its set_epoch)."""
    data = TensorDataset(torch.arange(11))
    for epoch in (0, 1):
        for r in range(2):
            torchs = DistributedSampler(data, num_replicas=2, rank=r, seed=3, drop_last=True)
            torchs.set_epoch(epoch)
            ours = EpochSeededDistributedSampler(data, 2, r, seed=3, epoch_fn=lambda e=epoch: e)
            assert list(torchs) == list(ours)[: 11 // 2]
    loader = DataLoader(data, sampler=DistributedSampler(data, num_replicas=2, rank=0, drop_last=True))
    assert inject_distributed_sampler(loader, Shard(2, 0)) is loader


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
    new = inject_distributed_sampler(loader, Shard(2, 1, 0))
    assert [b[0].tolist() for b in new] == [[1, 3], [5, 7]]


def test_injection_keeps_per_device_batch_size_and_shuffles_when_loader_did():
    """Injection keeps batch_size (per device) and other arguments, and shuffles when the loader did."""
    loader = DataLoader(TensorDataset(torch.arange(100)), batch_size=7, shuffle=True, drop_last=True)
    new = inject_distributed_sampler(loader, Shard(2, 0, 11))
    assert new.batch_size == 7 and new.drop_last
    assert isinstance(new.sampler, EpochSeededDistributedSampler) and new.sampler.shuffle
    assert [i for b in new for i in b[0].tolist()] == list(new.sampler)[: 7 * 7]


@pytest.mark.filterwarnings("ignore:Stream is an IterableDataset")
def test_user_distributed_sampler_and_iterable_datasets_are_left_alone():
    """A user's own DistributedSampler is respected; iterable data sets and non-loaders pass through."""
    data = TensorDataset(torch.arange(8))
    own = DataLoader(data, sampler=DistributedSampler(data, num_replicas=4, rank=3))

    class Stream(IterableDataset):
        def __iter__(self):
            return iter(range(3))

    stream = DataLoader(Stream())
    for obj in (own, stream, [1, 2, 3]):
        assert inject_distributed_sampler(obj, Shard(2, 0, 0)) is obj


def test_shared_seed_prefers_explicit_then_seed_everything(monkeypatch):
    """The shuffle seed is the explicit one, else PL_GLOBAL_SEED from seed_everything, else 0."""
    monkeypatch.delenv("PL_GLOBAL_SEED", raising=False)
    assert shared_seed() == 0
    monkeypatch.setenv("PL_GLOBAL_SEED", "42")
    assert shared_seed() == 42
    assert shared_seed(7) == 7


def _drawn(loader) -> list[int]:
    return [i for batch in loader for i in batch[0].tolist()]


def test_custom_samplers_are_sharded_from_one_shared_draw():
    """Weighted and subset samplers: the ranks' reads interleave into one draw of the original sampler."""
    data = TensorDataset(torch.arange(12))
    for source in (WeightedRandomSampler(torch.rand(12), num_samples=9), SubsetRandomSampler([1, 4, 5, 7, 9, 11])):
        loader = DataLoader(data, sampler=source, batch_size=2)
        shards = [_drawn(inject_distributed_sampler(loader, Shard(3, r, 4))) for r in range(3)]
        draw = draw_epoch(source, 4, 0)
        padded = draw + draw[: (-len(draw)) % 3]
        assert [padded[r::3] for r in range(3)] == shards
        assert draw_epoch(source, 4, 0) == draw != draw_epoch(source, 4, 1)  # reproducible, new per epoch


def test_user_sampler_class_gets_set_epoch_and_global_rng_is_untouched():
    """A user sampler with set_epoch and torch.randperm inside sees the epoch; training RNG is restored after."""

    class Mine(Sampler):
        def __init__(self):
            self.epochs = []

        def set_epoch(self, epoch):
            self.epochs.append(epoch)

        def __iter__(self):
            return iter(torch.randperm(6).tolist())

        def __len__(self):
            return 6

    mine = Mine()
    sharded = ShardedSampler(mine, Shard(2, 1, seed=0, epoch_fn=lambda: 5))
    state = torch.get_rng_state()
    first = list(sharded)
    assert torch.equal(state, torch.get_rng_state()) and mine.epochs == [5]
    assert first == list(ShardedSampler(mine, Shard(2, 1, seed=0, epoch_fn=lambda: 5)))


def test_custom_batch_sampler_is_sharded_by_whole_batches():
    """A custom batch sampler: rank r reads batches r, r + W, ... of one draw (padded with the first batches)."""

    class Buckets(Sampler):
        def __iter__(self):
            return iter([[0, 1], [2], [3, 4, 5], [6], [7, 8]])

        def __len__(self):
            return 5

    loader = DataLoader(TensorDataset(torch.arange(9)), batch_sampler=Buckets())
    shards = [[b[0].tolist() for b in inject_distributed_sampler(loader, Shard(2, r, 0))] for r in range(2)]
    assert shards == [[[0, 1], [3, 4, 5], [7, 8]], [[2], [6], [0, 1]]]
    # Unpadded (exact evaluation) rank 1 is one batch short and has no batch of 2+ to halve: it reads one again.
    with pytest.warns(UserWarning, match=r"\[rank 1\] .* one batch is evaluated twice"):
        unpadded = [
            [b[0].tolist() for b in inject_distributed_sampler(loader, Shard(2, r, 0, pad=False))] for r in range(2)
        ]
    assert unpadded == shards


def test_a_resumed_custom_batch_sampler_reads_the_rest_of_its_batches_whole():
    """Training (padded) whole-batch shards resumed after one batch per rank read the epoch's other batches as they
    are: 6 batches of 2 on 2 ranks, rank 0 reads [4, 5], [8, 9] (not halved to a full epoch's 3 batches)."""
    batches = [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11]]
    first = ShardedBatchSampler(batches, Shard(2, 0))
    assert list(first) == [[0, 1], [4, 5], [8, 9]]
    resumed = [ShardedBatchSampler(batches, Shard(2, r)) for r in range(2)]
    for s in resumed:
        s.resume_from(first.position(1))
    assert [list(s) for s in resumed] == [[[4, 5], [8, 9]], [[6, 7], [10, 11]]]
    assert [s.pending_resume_batches(0) for s in resumed] == [2, 2]


def test_plain_batch_sampler_keeps_batch_size_and_drop_last():
    """DataLoader(batch_sampler=BatchSampler(...)) keeps B and drop_last after injection."""
    data = TensorDataset(torch.arange(11))
    loader = DataLoader(data, batch_sampler=BatchSampler(SequentialSampler(data), 3, drop_last=True))
    new = inject_distributed_sampler(loader, Shard(2, 1, 0))
    assert [b[0].tolist() for b in new] == [[1, 3, 5], [7, 9, 0]]


def test_injection_happens_once():
    """A loader that already carries an injected sampler is returned unchanged."""
    loader = DataLoader(TensorDataset(torch.arange(8)), batch_size=2, shuffle=True)
    once = inject_distributed_sampler(loader, Shard(2, 0, 0))
    assert injected_sampler(once) is not None
    assert inject_distributed_sampler(once, Shard(2, 0, 0)) is once


def test_epoch_fn_with_persistent_workers_reshuffles_each_epoch():
    """Sampling happens in the main process: with persistent workers each epoch still gets its own order."""
    epoch = {"value": 0}
    data = TensorDataset(torch.arange(10))
    loader = DataLoader(data, batch_size=5, shuffle=True, num_workers=1, persistent_workers=True)
    new = inject_distributed_sampler(loader, Shard(2, 0, 1, epoch_fn=lambda: epoch["value"]))
    orders = []
    for e in range(2):
        epoch["value"] = e
        orders.append(_drawn(new))
        reference = EpochSeededDistributedSampler(data, 2, 0, seed=1)
        reference.set_epoch(e)
        assert orders[-1] == list(reference)
    assert orders[0] != orders[1]
    new._iterator._shutdown_workers()


def test_fewer_samples_than_ranks_are_padded_with_a_warning_as_lightning_pads_them():
    """1 sample, 2 ranks, padded shards: Lightning's DistributedSampler gives both ranks sample 0; so do we, and
    rank 0 is warned (a 1-sample sanity set on 2 devices runs under Lightning's ddp, so it is not refused)."""
    loader = DataLoader(TensorDataset(torch.arange(1)), batch_size=1)
    with pytest.warns(UserWarning, match=r"fewer samples \(1\) than ranks \(2\): the shards are padded with repeats"):
        shards = [inject_distributed_sampler(loader, Shard(2, r, 0, pad=True)) for r in range(2)]
    assert [[b[0].tolist() for b in shard] for shard in shards] == [[[0]], [[0]]]


def test_shard_iterable_by_rank_and_worker():
    """shard_iterable splits a stream by rank (and by DataLoader worker inside workers)."""
    assert [list(shard_iterable(range(10), r, 2)) for r in range(2)] == [[0, 2, 4, 6, 8], [1, 3, 5, 7, 9]]

    class Stream(IterableDataset):
        def __init__(self, rank):
            self.rank = rank

        def __iter__(self):
            return shard_iterable(range(12), rank=self.rank, world_size=2)

    # 2 ranks x 2 workers = 4 shards: rank 1 owns shards 2 and 3 (its workers 0 and 1).
    per_rank = [sorted(int(x) for x in DataLoader(Stream(r), batch_size=None, num_workers=2)) for r in range(2)]
    assert per_rank == [[0, 1, 4, 5, 8, 9], [2, 3, 6, 7, 10, 11]]


def test_iterable_dataset_is_not_sharded_and_warned_about():
    """An IterableDataset is left alone, with a warning that points to shard_iterable."""

    class Stream(IterableDataset):
        def __iter__(self):
            return iter(range(3))

    loader = DataLoader(Stream())
    assert inject_distributed_sampler(loader, Shard(2, 0, 0)) is loader
    with pytest.warns(UserWarning, match="shard_iterable"):
        warn_if_not_shardable(loader, 2)


def test_resume_position_same_and_other_world_sizes():
    """A position after 2 batches of 2 on 2 ranks: same W continues the shards; W=1 and W=3 split the rest."""
    data = TensorDataset(torch.arange(11))
    ranks = [EpochSeededDistributedSampler(data, 2, r, seed=5) for r in range(2)]
    for s in ranks:
        s.items_per_batch = 2
    full = [list(s) for s in ranks]
    position = ranks[0].position(2)
    assert position == ranks[1].position(2) and position["layers"] == [{"world_size": 2, "consumed": [4, 4]}]
    rest = full[0][4:] + full[1][4:]
    for world in (1, 2, 3):
        resumed = [EpochSeededDistributedSampler(data, world, r, seed=5) for r in range(world)]
        for s in resumed:
            s.items_per_batch = 2
            s.resume_from(position)
        pending = [s.pending_resume_batches(0) for s in resumed]
        shards = [list(s) for s in resumed]
        if world == 2:
            assert shards == [full[0][4:], full[1][4:]]
        got = [i for shard in shards for i in shard]
        assert set(got) >= set(rest[:-1]) and len(got) - len(set(rest[:-1])) < world  # 9 is padding at W=2
        assert {len(s) for s in shards} == {len(shards[0])}
        assert pending == [-(-len(shards[0]) // 2)] * world
    later = EpochSeededDistributedSampler(data, 2, 0, seed=5)
    later.resume_from(position)
    later.set_epoch(1)
    assert list(later) == list(EpochSeededDistributedSampler(data, 2, 0, seed=5, epoch_fn=lambda: 1))


def test_resume_from_a_position_of_another_length_warns_and_restarts_the_epoch():
    """A mid-epoch position written for 11 samples, resumed on a loader of 12: a warning, and the epoch's data starts
    from its beginning, as Lightning's DistributedSampler reads it (no position, nothing pending)."""
    old = EpochSeededDistributedSampler(TensorDataset(torch.arange(11)), 1, 0)
    list(old)
    position = old.position(3)
    resumed, fresh = (EpochSeededDistributedSampler(TensorDataset(torch.arange(12)), 2, 0) for _ in range(2))
    with pytest.warns(UserWarning, match="stream of 11 items of kind 'index', but the training loader now yields 12"):
        resumed.resume_from(position)
    assert resumed.pending_resume_batches(0) is None
    assert list(resumed) == list(fresh) == list(DistributedSampler(TensorDataset(torch.arange(12)), 2, 0))


class MisSized(Sampler[int]):
    """Yields ``range(n)`` but says its len() is ``length``."""

    def __init__(self, n: int, length: int) -> None:
        self.n, self.length = n, length

    def __iter__(self):
        return iter(range(self.n))

    def __len__(self) -> int:
        return self.length


def test_a_sampler_yielding_more_or_fewer_items_than_its_len_warns_and_is_read_as_lightning_reads_it():
    """7 items, len() 5: a warning, and each rank reads what Lightning's DistributedSamplerWrapper gives it (the first
    len() items); 3 items, len() 5: a warning, the 3 read (padded), where Lightning's wrapper raises IndexError."""
    from lightning.fabric.utilities.distributed import DistributedSamplerWrapper

    for r in range(2):
        with pytest.warns(UserWarning, match="yielded 7 items in an epoch but its len\\(\\) is 5. The items past"):
            mine = list(ShardedSampler(MisSized(7, 5), Shard(2, r)))
        assert mine == list(DistributedSamplerWrapper(MisSized(7, 5), num_replicas=2, rank=r, shuffle=False))
        with pytest.warns(UserWarning, match="yielded 3 items in an epoch but its len\\(\\) is 5. The epoch reads"):
            assert list(ShardedSampler(MisSized(3, 5), Shard(2, r))) == [[0, 2], [1, 0]][r]
    with pytest.raises(IndexError):
        list(DistributedSamplerWrapper(MisSized(3, 5), num_replicas=2, rank=0, shuffle=False))


def test_chained_elastic_resumes_cover_the_epoch():
    """2 ranks read 1 batch, resume on 3 that read 1 more batch, resume on 1: every sample read, repeats = padding."""
    data = TensorDataset(torch.arange(17))

    def make(world, rank):
        s = EpochSeededDistributedSampler(data, world, rank, seed=9)
        s.items_per_batch = 2
        return s

    first = [make(2, r) for r in range(2)]
    read = [i for s in first for i in list(s)[:2]]
    position = first[1].position(1)
    second = [make(3, r) for r in range(3)]
    for s in second:
        s.resume_from(position)
        s.batch_offset = 4  # what the strategy sets: Lightning's counter at the resumed epoch's start
    read += [i for s in second for i in list(s)[:2]]
    position = second[2].position(5)
    assert [layer["world_size"] for layer in position["layers"]] == [2, 3]
    last = make(1, 0)
    last.resume_from(position)
    read += list(last)
    assert set(read) == set(range(17)) and len(read) - 17 < 3  # at most the padding of the W=3 remainder
