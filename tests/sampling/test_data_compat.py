"""Code that runs under Lightning's ``strategy="ddp"`` runs under ``MyDDPStrategy()``: the user's data and settings.

Real gloo processes (see tests/sampling/data_workers.py): two launches of 2 processes share the fits. One-process
tests of the same kinds come first.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import pytest
import torch
from data_workers import (
    N_BUCKETS,
    N_ORDER,
    N_REVERSED,
    ORDER_BATCH,
    Batches,
    Buckets,
    N,
    Reversed,
    TaggedLoader,
    flat,
    scenario_data,
    scenario_models,
)
from ddp_testing import launch, load
from sampling_workers import Indexed
from torch.utils.data import BatchSampler, DataLoader, SequentialSampler, WeightedRandomSampler
from torch.utils.data.distributed import DistributedSampler

from ddp_strategy.sampling.loaders import ORDER_KEPT_WARNING, inject_distributed_sampler, warn_if_order_kept
from ddp_strategy.sampling.sampler import Shard


# ------------------------------------------------------------------------------------------ one process
def batches_of(loader: DataLoader) -> list[list[int]]:
    return [b[3].tolist() for b in loader]


@pytest.mark.parametrize("pad", [True, False])
def test_dataloader_subclasses_with_custom_batch_samplers_are_sharded_by_whole_batches(pad):
    """A DataLoader subclass with its own __init__ argument, around a custom batch sampler with its own arguments
    (a plain Sampler, or a BatchSampler subclass with an extra required argument): re-created with its class and
    argument, rank r reads batches r, r + 2, ... of the user's batches (training pads with the first ones,
    evaluation halves a batch of the rank one batch short)."""
    loaders = [
        TaggedLoader(Indexed(N_BUCKETS, 0), tag="t", batch_sampler=Buckets(N_BUCKETS, (2, 3))),
        TaggedLoader(
            Indexed(N_REVERSED, 0),
            tag="t",
            batch_sampler=Reversed(SequentialSampler(range(N_REVERSED)), 4, False, reverse=True),
        ),
    ]
    user_batches = [
        Buckets(N_BUCKETS, (2, 3)).batches,  # 8 batches of 2 and 3
        list(Reversed(SequentialSampler(range(N_REVERSED)), 4, False, reverse=True)),
    ]  # 5 batches
    for loader, user in zip(loaders, user_batches, strict=True):
        shards = []
        for r in range(2):
            new = inject_distributed_sampler(loader, Shard(2, r, pad=pad))
            assert type(new) is TaggedLoader and new.tag == "t"
            shards.append(batches_of(new))
        padded = user + user[:1] if pad and len(user) % 2 else user
        expected = [padded[0::2], padded[1::2]]
        if not pad and len(user) % 2:  # exact evaluation: the rank one batch short halves its first batch
            first = expected[1][0]
            expected[1][:1] = [first[: len(first) // 2], first[len(first) // 2 :]]
        assert shards == expected


def test_a_lightning_captured_batch_sampler_subclass_in_a_loader_subclass():
    """Built inside a hook (Lightning captures the arguments), the loader subclass and the user's BatchSampler
    subclass are re-created with them, the batch sampler around this rank's shard (as Lightning's ddp does)."""
    from lightning.fabric.utilities.data import _replace_dunder_methods  # what Lightning wraps hooks in

    with _replace_dunder_methods(DataLoader, "dataset"), _replace_dunder_methods(BatchSampler):
        loader = TaggedLoader(
            Indexed(N_REVERSED, 0),
            "hooked",
            batch_sampler=Reversed(SequentialSampler(range(N_REVERSED)), 4, False, reverse=False),
        )
    assert hasattr(loader, "__pl_saved_args")
    new = inject_distributed_sampler(loader, Shard(2, 1, pad=False))
    assert type(new) is TaggedLoader and new.tag == "hooked"
    assert type(new.batch_sampler) is Reversed and new.batch_sampler.reverse is False
    assert batches_of(new) == [[1, 3, 5, 7], [9, 11, 13, 15], [17]]


def test_a_training_order_lightning_would_shuffle_is_warned_about_once_with_what_to_do(recwarn):
    """shuffle=False, a sampler of the user's and a custom batch sampler (whose order MyDDPStrategy keeps and
    Lightning's ddp shuffles) each get the warning, naming the sampler, the shards and what gives Lightning's
    batches; shuffle=True, overfit_batches (Lightning keeps the order too), a user's DistributedSampler and a list of
    batches get none; the warning's filterwarnings silences it."""
    data = Indexed(6, 0)
    cases = [
        (
            DataLoader(data, batch_size=2),
            2,
            r"sampler is a SequentialSampler, .*: rank r of 2 reads positions"
            r" r, r \+ 2, r \+ 4, .*shuffle=True\).*pass shuffle=True to the training DataLoader",
        ),
        (DataLoader(data, batch_size=2), 1, "the one process reads every position"),
        (
            DataLoader(data, sampler=WeightedRandomSampler([1.0] * 6, 6)),
            2,
            "WeightedRandomSampler, drawn once per epoch.*DistributedSamplerWrapper.*no setting",
        ),
        (
            TaggedLoader(data, tag="t", batch_sampler=Buckets(6, (2, 3))),
            3,
            r"batch sampler is a Buckets.*rank r of 3 reads positions r, r \+ 3, r \+ 6",
        ),
    ]
    for loader, world_size, match in cases:
        with pytest.warns(UserWarning, match=f"^{ORDER_KEPT_WARNING}: .*{match}") as caught:
            warn_if_order_kept(loader, world_size)
        assert len(caught) == 1 and "trained weights, differ from a run with strategy='ddp'" in str(caught[0].message)
    recwarn.clear()
    warn_if_order_kept(DataLoader(data, batch_size=2, shuffle=True), 2)
    warn_if_order_kept(DataLoader(data, batch_size=2), 2, overfit_batches=2)
    warn_if_order_kept(DataLoader(data, batch_size=2), 2, overfit_batches=0.5)
    warn_if_order_kept(DataLoader(data, sampler=DistributedSampler(data, num_replicas=2, rank=0, shuffle=False)), 2)
    warn_if_order_kept([torch.zeros(2, 4)], 2)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=ORDER_KEPT_WARNING)  # what the warning suggests
        warn_if_order_kept(DataLoader(data, batch_size=2), 2)
    assert not recwarn.list


# ------------------------------------------------------------------------------------------ processes
@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """Both 2-process launches; returns the folder holding every rank's records."""
    out = tmp_path_factory.mktemp("compat_data")
    launch(scenario_data, 2, out)
    launch(scenario_models, 2, out)
    return out


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_use_distributed_sampler_false_keeps_the_users_split_in_every_stage(runs):
    """Trainer(use_distributed_sampler=False), data split by rank: train, val, test and predict each read
    exactly this rank's own 12 of 24 samples (not 6 of them, as when sharded again); the union is all 24."""
    records = load(runs, "user_split", 2)
    for r, rec in enumerate(records):
        own = list(range(r, N, 2))
        for stage in ("train", "val", "test", "predict"):
            assert sorted(i for b in rec[stage] for i in b) == own, (r, stage)
        assert sorted(i for p in rec["predictions"] for i in p) == own
    assert sorted(i for rec in records for b in rec["train"] for i in b) == list(range(N))


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_torch_distributed_works_after_fit_as_under_lightning_ddp(runs):
    """Code after trainer.fit calls torch.distributed (get_rank, all_reduce) as under Lightning's ddp, whose
    group outlives the run; the next stages (test, predict) then rendezvous anew and read the right data."""
    for rec in load(runs, "user_split", 2):
        assert rec["after_fit"] == {"rank": rec["trainer_rank"], "world": 2, "sum": 3.0}


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_uneven_user_shards_train_by_default_or_fail_clearly_before_a_step_and_each_suggested_fix_trains(runs):
    """use_distributed_sampler=False, 12 and 8 samples (3 and 2 training batches): by default each rank trains its
    own shard whole (uneven_inputs="join"); under uneven_inputs="error" every rank raises the counts at the epoch's
    start and names the flag, instead of hanging in DDP's all-reduce; letting the strategy shard the whole data set,
    or equal user shards, trains every rank the same number of steps over every sample."""
    records = load(runs, "uneven", 2)
    assert [flat(rec["joined"]) for rec in records] == [list(range(0, N, 2)), list(range(1, N - 8, 2))]
    for rec in records:
        assert rec["error"] is not None and "{0: 3, 1: 2}" in rec["error"], rec["error"]
        assert "use_distributed_sampler" in rec["error"] and rec["steps"] == 0
        assert "let MyDDPStrategy shard the data" in rec["error"]
        assert "Trainer(use_distributed_sampler=True)" in rec["error"]
    sharded = [[i for batch in r["sharded"] for i in batch] for r in records]
    assert [len(r["sharded"]) for r in records] == [3, 3]
    assert sorted(sharded[0] + sharded[1]) == list(range(20))
    equal = [[i for batch in r["equal"] for i in batch] for r in records]
    assert equal == [list(range(0, 24, 2)), list(range(1, 24, 2))]


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_any_iterable_is_read_whole_by_every_rank_as_under_lightning_ddp(runs):
    """trainer.test(model, [rows]) and a custom iterable of batches: every rank reads all of it, exactly what
    Lightning's ddp gives each rank (no less data); fit on the iterable trains every rank on all batches, with
    identical weights; rank 0 warns that it is not sharded, rank 1 does not."""
    ours, lightning = load(runs, "iterables", 2), load(runs, "iterables_lightning", 2)
    batches = [b[3].tolist() for b in Batches(9, 4)]
    expected = [[i] for i in range(6)] + batches
    for r in range(2):
        assert ours[r]["test"] == expected == lightning[r]["test"]
        assert ours[r]["train"] == batches
    for name, value in ours[0]["weights"].items():
        assert torch.equal(value, ours[1]["weights"][name])
    assert any("got a Tensor" in w for w in ours[0]["warnings"])
    assert any("got a Batches" in w for w in ours[0]["warnings"])
    assert ours[1]["warnings"] == []


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_a_stream_that_splits_itself_by_rank_is_not_said_to_be_read_whole(runs):
    """An IterableDataset that splits itself by rank in __iter__ (torch.distributed.get_rank(), as litdata, WebDataset
    and Hugging Face datasets do): each rank trains its own half, as under Lightning's ddp; rank 0's warning says the
    ranks see the same batches only unless __iter__ splits the data by rank, and names the libraries that do."""
    ours, lightning = load(runs, "split_by_rank", 2), load(runs, "split_by_rank_lightning", 2)
    for r in range(2):
        assert flat(ours[r]["train"]) == list(range(r, N, 2)) == flat(lightning[r]["train"])
    assert ours[1]["warnings"] == [] and len(ours[0]["warnings"]) == 1
    assert ours[0]["warnings"][0] == (
        "SplitByRank is an IterableDataset, which has no indices to shard: each of the 2 ranks reads what its"
        " __iter__ yields there (as under Lightning's ddp). Unless __iter__ splits the data by rank itself"
        " (torch.distributed.get_rank(), as ddp_strategy.shard_iterable, litdata's StreamingDataset, WebDataset's"
        " split_by_node and Hugging Face's split_dataset_by_node do), every rank sees the same batches."
    )


def epochs_of(record: dict) -> list[list[list[int]]]:
    """The training batches of an order fit, per epoch (4 per epoch: 11 samples per rank in batches of 3)."""
    per_epoch = math.ceil(math.ceil(N_ORDER / 2) / ORDER_BATCH)
    return [record["train"][e * per_epoch : (e + 1) * per_epoch] for e in range(2)]


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_a_shuffled_fit_is_lightnings_ddp_fit_to_the_bit(runs):
    """seed_everything, then the same 2-epoch fit with shuffle=True (21 samples: one padded; batches of 3; dropout;
    validation and sanity steps) under strategy="ddp" and MyDDPStrategy(): each rank reads the same indices in
    each epoch, reshuffled between epochs, both take 8 steps and end with bitwise-equal weights; no order warning."""
    ours, lightning = load(runs, "order_shuffled", 2), load(runs, "order_shuffled_lightning", 2)
    for r in range(2):
        assert ours[r]["train"] == lightning[r]["train"] and ours[r]["val"] == lightning[r]["val"]
        assert ours[r]["steps"] == lightning[r]["steps"] == 8
        assert ours[r]["weights"].keys() == lightning[r]["weights"].keys()
        for name, value in ours[r]["weights"].items():
            assert torch.equal(value, lightning[r]["weights"][name]), (r, name)
        assert ours[r]["warnings"] == []
    for epoch in range(2):
        read = flat(epochs_of(ours[0])[epoch]) + flat(epochs_of(ours[1])[epoch])
        assert len(read) == N_ORDER + 1 and set(read) == set(range(N_ORDER))  # all once, one padded
    assert epochs_of(ours[0])[0] != epochs_of(ours[0])[1] and epochs_of(ours[0])[0] != [
        [0, 2, 4],
        [6, 8, 10],
        [12, 14, 16],
        [18, 20],
    ]
    assert not torch.equal(ours[0]["weights"]["layer.weight"], ours[0]["initial"]["layer.weight"])  # it trained


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_an_unshuffled_fit_keeps_its_order_warns_and_shuffle_true_gives_lightnings_fit(runs):
    """shuffle=False: MyDDPStrategy gives rank r samples r, r + 2, ... in order every epoch (other weights than
    Lightning's) and rank 0 warns once; Lightning's ddp shuffles that loader anyway (its batches and weights equal
    its shuffle=True ones), and the warning's suggestion, shuffle=True under MyDDPStrategy, gives exactly those."""
    kept, lightning_kept = load(runs, "order_kept", 2), load(runs, "order_kept_lightning", 2)
    shuffled, lightning_shuffled = load(runs, "order_shuffled", 2), load(runs, "order_shuffled_lightning", 2)
    in_order = [[[0, 2, 4], [6, 8, 10], [12, 14, 16], [18, 20]], [[1, 3, 5], [7, 9, 11], [13, 15, 17], [19, 0]]]
    for r in range(2):
        assert epochs_of(kept[r]) == [in_order[r], in_order[r]] and kept[r]["steps"] == 8
        assert lightning_kept[r]["train"] == lightning_shuffled[r]["train"] == shuffled[r]["train"]
        for name, value in lightning_kept[r]["weights"].items():
            assert torch.equal(value, shuffled[r]["weights"][name]), (r, name)
        assert not torch.equal(kept[r]["weights"]["layer.weight"], lightning_kept[r]["weights"]["layer.weight"])
    assert len(kept[0]["warnings"]) == 1 and kept[1]["warnings"] == []  # rank 0, once per fit
    assert "its sampler is a SequentialSampler" in kept[0]["warnings"][0]
    assert "pass shuffle=True to the training DataLoader" in kept[0]["warnings"][0]


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_dataloader_subclass_with_custom_batch_sampler_fits(runs):
    """A fit with TaggedLoader(batch_sampler=Buckets(...)) built in the hook and a ready TaggedLoader with a
    Reversed batch sampler for validation: each rank reads its whole batches; validation covers all once, in as
    many steps on each rank (the rank one batch short splits its first batch in two, see evaluation.py)."""
    records = load(runs, "subclass", 2)
    train = Buckets(N_BUCKETS, (2, 3)).batches
    val = list(Reversed(SequentialSampler(range(N_REVERSED)), 4, False, reverse=True))
    assert len(val) == 5  # rank 0 holds 3 whole batches, rank 1 holds 2
    expected_val = [val[0::2], [val[1][:2], val[1][2:], val[3]]]
    for r, rec in enumerate(records):
        assert rec["train"] == train[r::2] and rec["val"] == expected_val[r]
        assert rec["loaders"] == [("TaggedLoader", "train"), ("TaggedLoader", "val")]


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_fast_dev_run_leaves_default_root_dir_untouched(runs):
    """fast_dev_run=True saves nothing, and the checkpoint-folder check leaves no empty checkpoints/ behind."""
    for rec in load(runs, "fast_dev_run", 2):
        assert rec["left"] == []


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_a_compiled_model_fits_like_the_plain_one(runs):
    """trainer.fit(torch.compile(model, backend="eager")) on 2 processes: dynamo traced the steps, and the weights
    equal the uncompiled fit's on both ranks (and moved from the initial ones); the group outlives the fit (as
    under Lightning's ddp), and once the next run releases it nothing listens on MASTER_PORT (no reference cycle
    keeps the store alive), so that run can rendezvous there."""
    for rec in load(runs, "compile", 2):
        assert rec["compiler_ctx"] and rec["frames"] > 0 and rec["kept"] and rec["port_free"]
        for name, value in rec["plain"].items():
            assert torch.allclose(rec["compiled"][name], value, atol=1e-6), name
            assert not torch.equal(value, rec["initial"][name])


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_lr_finder_restores_its_own_checkpoint_holding_a_module(runs):
    """Tuner.lr_find on 2 processes, hyper-parameters holding an nn.MSELoss: its temporary checkpoint (ours) is
    restored (weights back to the initial ones), 20 learning rates tried and one suggested, the file removed."""
    for rec in load(runs, "lr_find", 2):
        assert rec["lrs"] == 20 and rec["left"] == [] and rec["lr"] == rec["suggestion"] is not None
        for name, value in rec["before"].items():
            assert torch.equal(rec["after"][name], value), name


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_unsafe_checkpoint_error_suggestions_work_where_raised(runs):
    """ckpt_path="best" (our own file) restores; the same file in a new run is refused with a message whose three
    suggestions (fit(..., weights_only=False), DDPCheckpointIO(weights_only=False), add_safe_globals) each resume."""
    for rec in load(runs, "unsafe", 2):
        assert torch.isfinite(torch.tensor(rec["best_test_loss"]))
        message = rec["error"]
        assert message is not None and "last.ckpt" in message
        assert "trainer.fit(model, ckpt_path=..., weights_only=False)" in message
        assert "MyDDPStrategy(checkpoint_io=DDPCheckpointIO(weights_only=False))" in message
        assert "torch.serialization.add_safe_globals([torch.nn.modules.loss.MSELoss])" in message
        assert rec["weights_only_false_step"] == rec["checkpoint_io_step"] == rec["safe_globals_step"] == 3
