"""Ranks with different numbers of training batches (issue 27, ``ddp_strategy/sampling/uneven.py``): every policy.

Real gloo processes (see tests/sampling/uneven_workers.py): two launches of 2 processes share the fits. The
weights are checked against a single-process reference computed here with the documented rule: at step ``s`` the
gradient is ``(1 / W) * sum`` over the ranks that have a batch at ``s`` of the gradient of their batch's mean loss
(``divide_by_initial_world_size=True``, the default), or that sum divided by the number of those ranks (False).
Unit tests of the arguments come first.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from ddp_testing import launch, load
from uneven_workers import (
    BN_COUNTS,
    BN_MOMENTUM,
    CLIP,
    EMA_DECAY,
    EPOCHS,
    EVAL,
    EVAL_BATCH,
    EVAL_SALT,
    GAMMA,
    ITERABLE,
    ITERABLE_BATCH,
    LR,
    MAP,
    MAP_BATCH,
    MOMENTUM,
    PRECISION_COUNTS,
    PRECISIONS,
    TRAIN_SALT,
    VAL,
    VAL_BATCH,
    VAL_SALT,
    Probed,
    loss_of,
    make_layer,
    samples,
    scenario_direct_collective,
    scenario_evaluation_ddp,
    scenario_join,
    scenario_policies,
    scenario_precisions,
)

from ddp_strategy import MyDDPStrategy, UnevenInputsError
from ddp_strategy.testing import assert_same_on_every_rank

TIGHT = dict(atol=1e-6, rtol=1e-6)  # float32 sums in another order
UNEVEN_MODULES = ("uneven.py", "join.py")  # ddp_strategy/sampling/: the policies and the join


# ------------------------------------------------------------------------------------------ one process
def test_an_unknown_policy_is_refused_naming_the_values():
    """MyDDPStrategy(uneven_inputs="bogus") raises ValueError naming the argument and the three values."""
    with pytest.raises(ValueError, match=r"uneven_inputs='bogus'\) is not one of \['join', 'stop', 'error'\]"):
        MyDDPStrategy(uneven_inputs="bogus")


def test_a_divisor_flag_that_is_not_a_bool_is_refused():
    """MyDDPStrategy(divide_by_initial_world_size="yes") raises TypeError naming the argument and the value."""
    with pytest.raises(TypeError, match=r"divide_by_initial_world_size=\.\.\.\) must be True or False, got 'yes'"):
        MyDDPStrategy(divide_by_initial_world_size="yes")


def test_uneven_inputs_error_is_a_runtime_error_exported_at_the_top():
    """UnevenInputsError is importable from ddp_strategy and a RuntimeError (what a collective failure raises)."""
    from ddp_strategy.sampling.uneven import UnevenInputsError as core

    assert UnevenInputsError is core and issubclass(UnevenInputsError, RuntimeError)


# ------------------------------------------------------------------------------------ the reference
def rank_batches(counts: tuple[int, ...], batch_size: int, salt: int = TRAIN_SALT) -> list[list[tuple]]:
    """Per rank, its batches ``(x, y, idx)`` in order, as its loader gives them."""
    per_rank = []
    for r, n in enumerate(counts):
        x, y, idx = samples(r, n, salt)
        per_rank.append(
            [(x[s : s + batch_size], y[s : s + batch_size], idx[s : s + batch_size]) for s in range(0, n, batch_size)]
        )
    return per_rank


def reference(
    counts: tuple[int, ...],
    batch_size: int,
    by_world_size: bool = True,
    steps: int | None = None,
    epochs: int = EPOCHS,
    accumulate: int = 1,
    clip: float | None = None,
    gamma: float = 1.0,
    precision: str = "32-true",
) -> SimpleNamespace:
    """One process, the documented rule: ``layer`` (final), ``after_step`` (the weights after each step), ``val``
    (after each epoch, the loss over all of ``VAL``'s samples) and ``val_of_batch_means`` (the mean of its batches'
    means, which weighs the one-sample batch more). ``steps``: batches per epoch (default: the most of any rank);
    ``accumulate``: batches per optimizer step (Lightning divides each loss by it; the epoch's last step may hold
    fewer); ``clip``: the gradient's norm is clipped to it before each step; ``gamma``: the learning rate's factor
    after each step; ``precision``: Lightning's (a "-true" one: weights and inputs in its dtype; a "-mixed" one: the
    losses under CPU autocast, bfloat16). ``optimizer``: the final SGD."""
    dtype = {"64-true": torch.float64, "bf16-true": torch.bfloat16, "16-true": torch.float16}.get(precision)
    layer = make_layer().to(dtype)
    optimizer = torch.optim.SGD(layer.parameters(), lr=LR, momentum=MOMENTUM)
    per_rank, world_size = rank_batches(counts, batch_size), len(counts)
    val_batches = [b for batches in rank_batches(VAL, VAL_BATCH, VAL_SALT) for b in batches]
    val_x, val_y = (torch.cat([b[i] for b in val_batches]).to(dtype) for i in (0, 1))
    result = SimpleNamespace(layer=layer, optimizer=optimizer, after_step=[], val=[], val_of_batch_means=[])
    for _ in range(epochs):
        n = steps or max(map(len, per_rank))
        for first in range(0, n, accumulate):
            optimizer.zero_grad()
            for s in range(first, min(first + accumulate, n)):
                active = [batches[s] for batches in per_rank if s < len(batches)]
                with torch.autocast("cpu", torch.bfloat16, enabled=precision.endswith("-mixed")):
                    total = sum(loss_of(layer, x.to(dtype), y.to(dtype)) for x, y, _ in active) / accumulate
                (total / (world_size if by_world_size else len(active))).backward()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(layer.parameters(), clip)
            optimizer.step()
            for group in optimizer.param_groups:
                group["lr"] *= gamma
            result.after_step.append({f"layer.{k}": v.detach().clone() for k, v in layer.state_dict().items()})
        with torch.no_grad():
            result.val.append(loss_of(layer, val_x, val_y).item())
            means = [loss_of(layer, x.to(dtype), y.to(dtype)).item() for x, y, _ in val_batches]
            result.val_of_batch_means.append(sum(means) / len(means))
    return result


def assert_weights(records: list[dict], expected: torch.nn.Module) -> None:
    """Bitwise-identical weights on every rank, equal to ``expected``'s (tight tolerance), and moved."""
    assert_same_on_every_rank([r["weights"] for r in records], "parameters")
    for k, v in expected.state_dict().items():
        assert torch.allclose(records[0]["weights"][f"layer.{k}"], v, **TIGHT), (k, records[0]["weights"], v)
        assert not torch.equal(records[0]["weights"][f"layer.{k}"], records[0]["initial"][k])


def indices(counts: tuple[int, ...], batch_size: int, steps: int | None = None) -> list[list[list[int]]]:
    """Per rank, the indices of its batches in one epoch (the first ``steps``)."""
    return [[b[2].tolist() for b in batches][:steps] for batches in rank_batches(counts, batch_size)]


def ema(after_step: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """EMAWeightAveraging's average (``EMA_DECAY``) of the weights after each step (the first: a copy)."""
    average = after_step[0]
    for weights in after_step[1:]:
        average = {k: EMA_DECAY * v + (1 - EMA_DECAY) * weights[k] for k, v in average.items()}
    return average


# ------------------------------------------------------------------------------------------ processes
@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """Both 2-process launches; returns the folder holding every rank's records."""
    out = tmp_path_factory.mktemp("uneven")
    launch(scenario_join, 2, out, timeout_s=180)
    launch(scenario_policies, 2, out, timeout_s=180)
    return out


@pytest.fixture(scope="module")
def precisions(tmp_path_factory) -> Path:
    """The launch of :func:`scenario_precisions`; returns the folder holding every rank's records."""
    out = tmp_path_factory.mktemp("precisions")
    launch(scenario_precisions, 2, out, timeout_s=180)
    return out


#: Per precision: the weights' dtype and the tolerance against the one-process reference (its own rounding: the
#: ranks sum their gradients, the reference its losses).
PRECISION_CHECKS = {
    "64-true": (torch.float64, dict(atol=1e-12, rtol=1e-12)),
    "bf16-true": (torch.bfloat16, dict(atol=2e-2, rtol=2e-2)),
    "16-true": (torch.float16, dict(atol=2e-3, rtol=2e-3)),
    "bf16-mixed": (torch.float32, dict(atol=1e-2, rtol=1e-2)),
    "16-mixed": (torch.float32, dict(atol=1e-2, rtol=1e-2)),  # bf16-mixed on CPU (Lightning warns)
}


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
@pytest.mark.parametrize("precision", PRECISIONS)
def test_every_cpu_precision_trains_uneven_inputs_with_the_reference_weights(precisions, precision):
    """Trainer(precision=...) on 5 and 3 batches under the default join, each step logging, reducing, deciding,
    barriering and broadcasting: no gloo abort in the tail steps (until 2026-12-06 the shadow of DDP's forward made its
    flag in float32 while the training rank's "64-true"/"bf16-true" forward made it in float64/bfloat16: "8 vs 4"),
    both ranks end with identical weights of the precision's dtype, equal to the one-process reference in it, and the
    tail steps' reductions give rank 0's values. Under "64-true" on even streams the same user code trains under
    strategy="ddp" to the bitwise same weights as under MyDDPStrategy (on uneven ones ddp hangs)."""
    records = load(precisions, f"precision_{precision}", 2)
    dtype, tolerance = PRECISION_CHECKS[precision]
    assert [(rec["error"], rec["steps"]) for rec in records] == [(None, 5)] * 2
    assert [[got["sum"] for got in rec["results"]] for rec in records] == [[30, 32, 34, 13, 14], [30, 32, 34]]
    assert_same_on_every_rank([r["weights"] for r in records], "parameters")
    expected = reference(PRECISION_COUNTS, ITERABLE_BATCH, epochs=1, precision=precision).layer
    for k, v in expected.state_dict().items():
        assert records[0]["weights"][f"layer.{k}"].dtype == dtype
        assert torch.allclose(records[0]["weights"][f"layer.{k}"], v, **tolerance), (k, records[0]["weights"], v)
        assert not torch.equal(records[0]["weights"][f"layer.{k}"], records[0]["initial"][k].to(dtype))
    ours, ddp = load(precisions, "precision_even_ours", 2), load(precisions, "precision_even_ddp", 2)
    assert [rec["error"] for rec in ours + ddp] == [None] * 4
    assert_same_on_every_rank([r["weights"] for r in ours + ddp], "parameters")
    assert ours[0]["weights"]["layer.weight"].dtype == torch.float64


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_join_trains_every_iterable_batch_once_per_epoch_with_the_reference_weights(runs):
    """IterableDataset, 5 and 4 batches of 2, 2 epochs with validation, SGD with momentum: each rank trains each of
    its samples once per epoch, both take 10 optimizer steps and end with identical weights equal to the reference
    (the 5th step's gradient is rank 0's alone, halved); the counts per epoch are recorded."""
    records = load(runs, "join_iterable", 2)
    expected = indices(ITERABLE, ITERABLE_BATCH)
    for r, rec in enumerate(records):
        assert rec["error"] is None
        assert rec["seen"] == {e: expected[r] for e in range(EPOCHS)}
        assert rec["steps"] == 10 and rec["epochs"] == {0: (5, 4), 1: (5, 4)}
    assert_weights(records, reference(ITERABLE, ITERABLE_BATCH).layer)


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_join_trains_every_presharded_map_style_batch_once_per_epoch_with_the_reference_weights(runs):
    """use_distributed_sampler=False, 13 and 11 samples in batches of 4 (4 and 3 batches), 2 epochs with validation:
    each rank trains its own shard once per epoch, 8 steps on both, identical weights equal to the reference."""
    records = load(runs, "join_map", 2)
    expected = indices(MAP, MAP_BATCH)
    for r, rec in enumerate(records):
        assert rec["error"] is None and rec["seen"] == {e: expected[r] for e in range(EPOCHS)}
        assert rec["steps"] == 8 and rec["epochs"] == {0: (4, 3), 1: (4, 3)}
    assert_weights(records, reference(MAP, MAP_BATCH).layer)


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_divide_by_initial_world_size_false_divides_a_tail_step_by_its_ranks(runs):
    """MyDDPStrategy(divide_by_initial_world_size=False): the 4th step's gradient is rank 0's in full (divided by 1
    active rank), matching that reference and not the default's weights."""
    records, default = load(runs, "join_map_active", 2), load(runs, "join_map", 2)
    for rec in records:
        assert rec["error"] is None and rec["steps"] == 8 and rec["epochs"] == {0: (4, 3), 1: (4, 3)}
    assert_weights(records, reference(MAP, MAP_BATCH, by_world_size=False).layer)
    assert not torch.allclose(records[0]["weights"]["layer.weight"], default[0]["weights"]["layer.weight"])


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_collectives_of_a_tail_step_are_shadowed_with_the_active_ranks_values(runs):
    """In rank 0's 5th step, which rank 1 (out of data) only shadows: self.log(on_step=True, sync_dist=True) and
    strategy.reduce (mean, sum, max, min) give rank 0's value (not one mixed with a joined rank's 0),
    reduce_boolean_decision decides over rank 0 alone, barrier returns and broadcast(src=0) gives rank 0's object;
    in the steps both take, both ranks' values. With the progress bar on, whose epoch-end read of an epoch-level
    sync_dist value is a collective on rank 0 alone, the fit ends without waiting, with that value equal on both
    ranks (until 2026-12-03 an uneven epoch's end started a flag round there, and both ranks waited 30 s)."""
    records = load(runs, "join_iterable", 2)
    assert [len(rec["results"]) for rec in records] == [10, 8]
    assert records[0]["error"] is None and records[1]["error"] is None
    assert records[0]["metrics"]["x_epoch"] == records[1]["metrics"]["x_epoch"]
    for rec in records:
        for got in rec["results"]:
            both = got["batch"] < 4
            v0 = 10.0 + got["batch"]  # rank 0's value; rank 1's is 10 more
            assert got["log"] == got["mean"] == (v0 + 5 if both else v0), got
            assert (got["sum"], got["max"], got["min"]) == ((2 * v0 + 10, -v0, v0) if both else (v0, -v0, v0)), got
            assert (got["all"], got["any"]) == ((False, True) if both else (True, False)), got  # rank 0's decision
            assert got["barrier"] and got["broadcast"] == "from rank 0"


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_what_makes_its_own_collectives_in_a_step_is_refused_at_the_epoch_start_and_trains_under_stop(runs):
    """On pre-sharded 5 and 4 batches (known, unequal counts) under uneven_inputs="join": a ZeroRedundancyOptimizer
    (its step broadcasts each rank's shard), Trainer(sync_batchnorm=True)'s SyncBatchNorm layer and a torchmetrics
    metric with dist_sync_on_step=True (their forward syncs), which a rank out of data cannot take part in, each raise
    ValueError on both ranks at the first epoch's start, before any step (the collective timeout is 60 s), naming it
    and uneven_inputs='stop' (on unknown counts, a stream, a warning: the even-stream test below). What the error
    suggests, uneven_inputs="stop" on the same data, trains: 4 steps an epoch on both ranks, the
    ZeroRedundancyOptimizer with gradient clipping and a per-step StepLR to identical weights equal to the reference
    over those steps (clipped, decayed), and the SyncBatchNorm to the same running statistics on both ranks (synced: a
    BatchNorm's differ, each rank's own batches)."""
    for name, what in (
        ("refuse_zero", "optimizer 0 (a ZeroRedundancyOptimizer)"),
        ("refuse_sync_batchnorm", "the SyncBatchNorm layer 'norm'"),
        ("refuse_metric", "the metric 'metric' (dist_sync_on_step=True)"),
    ):
        records = load(runs, name, 2)
        assert_refused(
            records,
            "ValueError",
            "the ranks' numbers of training batches in epoch 0 differ ({0: 5, 1: 4}),",
            f"not in the collectives these make in a step of their own: {what}.",
            "Pass MyDDPStrategy(uneven_inputs='stop')",
        )
        assert [(rec["steps"], rec["seen"]) for rec in records] == [(0, {})] * 2, name
    for name in ("stop_zero", "stop_syncs"):
        records = load(runs, name, 2)
        assert [(rec["error"], rec["steps"], rec["epochs"]) for rec in records] == [
            (None, 8, {0: (4, 4), 1: (4, 4)})
        ] * 2
    assert_weights(
        load(runs, "stop_zero", 2), reference(ITERABLE, ITERABLE_BATCH, steps=4, clip=CLIP, gamma=GAMMA).layer
    )
    normed, x = load(runs, "stop_syncs", 2), [samples(r, n, TRAIN_SALT)[0] for r, n in enumerate(ITERABLE)]
    running = torch.zeros(3)
    for _ in range(EPOCHS):  # over the global batch of each of the first 4 steps: both ranks' samples
        for s in range(0, 4 * ITERABLE_BATCH, ITERABLE_BATCH):
            batch = torch.cat([rows[s : s + ITERABLE_BATCH] for rows in x])
            running = (1 - BN_MOMENTUM) * running + BN_MOMENTUM * batch.mean(0)
    assert_same_on_every_rank([rec["weights"] for rec in normed], "parameters and buffers")
    assert torch.allclose(normed[0]["weights"]["norm.running_mean"], running, **TIGHT)
    assert normed[0]["weights"]["norm.num_batches_tracked"] == 8


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_an_ema_callback_and_clipping_by_norm_hold_the_reference_average_of_every_step_on_every_rank(runs):
    """EMAWeightAveraging (decay 0.5, after each optimizer step; no collective) with gradient_clip_val (by norm, each
    rank clips the all-reduced gradient it holds: no collective) on 5 and 4 batches: rank 1, out of data in rank 0's
    5th steps, takes rank 0's average with the module at each epoch's end, so after fit (the average swapped in)
    both ranks hold bitwise the same weights, the average over the clipped reference's 10 steps (where rank 1's
    average missed steps 5 and 10); on 5 and 5 batches the same user code gives bitwise the same weights under
    strategy="ddp", the reference's average."""
    records = load(runs, "ema", 2)
    assert [(rec["error"], rec["steps"], rec["epochs"]) for rec in records] == [(None, 10, {0: (5, 4), 1: (5, 4)})] * 2
    assert_same_on_every_rank([rec["weights"] for rec in records], "parameters")
    after_step = reference(ITERABLE, ITERABLE_BATCH, clip=CLIP).after_step
    for k, v in ema(after_step).items():
        assert torch.allclose(records[0]["weights"][k], v, **TIGHT), (k, records[0]["weights"][k], v)
    assert not torch.allclose(ema(after_step)["layer.weight"], after_step[-1]["layer.weight"])  # not the last
    assert not torch.allclose(after_step[-1]["layer.weight"], reference(ITERABLE, ITERABLE_BATCH).layer.weight)
    ours, lightning = load(runs, "ema_even_ours", 2), load(runs, "ema_even_ddp", 2)  # 5 and 5 batches
    assert [rec["error"] for rec in ours + lightning] == [None] * 4
    assert_same_on_every_rank([rec["weights"] for rec in ours + lightning], "parameters")
    even = ema(reference((ITERABLE[0],) * 2, ITERABLE_BATCH, clip=CLIP).after_step)
    assert all(torch.allclose(ours[0]["weights"][k], v, **TIGHT) for k, v in even.items())


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_refused_collectives_raise_uneven_inputs_error_on_every_rank_without_waiting(runs):
    """In rank 0's 5th step while rank 1 is out of data, self.all_gather, a broadcast from rank 1 and a reduce by
    ReduceOp.BAND (in the steps both ranks take, as under ddp) each raise UnevenInputsError on both ranks within
    seconds (the collective timeout is 60 s), naming the collective, the batch and the rank without data, with what
    to do."""
    kinds = {  # name: what, the fix, rank 0's batches seen and optimizer steps
        "refuse_all_gather": ("an all_gather", "gather at the epoch's end", 5, 4),
        "refuse_broadcast": ("a broadcast from a rank that has no data left", "broadcast from a rank that still", 5, 4),
        "refuse_reduce_op": (
            "a collective on a process group other than the world, or a reduction",
            "epoch's end",
            5,
            4,
        ),
    }
    for name, (kind, fix, batches_of_rank_0, steps_of_rank_0) in kinds.items():
        for r, rec in enumerate(load(runs, name, 2)):
            assert rec["error"] is not None, name
            error_type, message, seconds = rec["error"]
            assert error_type == UnevenInputsError.__name__ and seconds < 20, (name, rec["error"])
            assert message.startswith(
                f"[rank {r}] training batch 5 (batch_idx 4) of epoch 0 on ranks [0] makes {kind}"
            ), message
            assert "in which ranks [1], out of training data, cannot take part" in message
            assert fix in message and "uneven_inputs='stop'" in message
            assert (rec["steps"], len(rec["seen"][0])) == ((steps_of_rank_0, batches_of_rank_0) if r == 0 else (4, 4))


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_a_checkpoint_each_step_saves_the_tail_steps_while_rank_0_has_more(runs):
    """ModelCheckpoint(every_n_train_steps=1, save_top_k=-1) while rank 0 has 5 batches and rank 1 has 4: a file
    for every global step 1..10, the tail steps 5 and 10 included, each loading with that step's reference weights."""
    folder = runs / "ckpt_more"
    assert sorted(p.name for p in folder.iterdir()) == sorted(f"step={s}.ckpt" for s in range(1, 11))
    after_step = reference(ITERABLE, ITERABLE_BATCH).after_step
    for step in (4, 5, 10):
        checkpoint = torch.load(folder / f"step={step}.ckpt", weights_only=True)
        assert checkpoint["global_step"] == step
        for k, v in checkpoint["state_dict"].items():
            assert torch.allclose(v, after_step[step - 1][k], **TIGHT), (step, k)
    loaded = Probed.load_from_checkpoint(folder / "step=10.ckpt")  # what a user does with the last tail step's file
    assert torch.equal(loaded.layer.weight, checkpoint["state_dict"]["layer.weight"])


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_a_checkpoint_in_a_tail_step_while_rank_0_has_fewer_raises_naming_rank_0(runs):
    """The same checkpoint while rank 0 (which writes checkpoints) has 4 batches and rank 1 has 5: rank 1's 5th
    step's save raises UnevenInputsError on both ranks within seconds, naming rank 0; steps 1-4 were saved."""
    for r, rec in enumerate(load(runs, "ckpt_fewer", 2)):
        assert rec["error"] is not None
        error_type, message, seconds = rec["error"]
        assert error_type == UnevenInputsError.__name__ and seconds < 20, rec["error"]
        assert message.startswith(
            f"[rank {r}] training batch 5 (batch_idx 4) of epoch 0 on ranks [1] makes a"
            " checkpoint save, which rank 0 writes"
        )
        assert "in which ranks [0], out of training data" in message and "give rank 0 the longest shard" in message
    assert sorted(p.name for p in (runs / "ckpt_fewer").iterdir()) == [f"step={s}.ckpt" for s in range(1, 5)]


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_uneven_validation_logs_the_single_process_value_over_all_samples(runs):
    """Validation loaders the strategy does not shard, 3 and 2 batches (6 and 3 samples: the last batch holds one):
    an IterableDataset and pre-sharded map-style data; each epoch's self.log(sync_dist=True) value is the single
    process's mean over all 9 samples (weighted by batch size, as Lightning's epoch mean), on both ranks, not the
    mean of the 5 batch means. With a per-step self.log(sync_dist=True) too (join_map_val_steps), every validation
    run of the fit runs under the join (until 2026-12-06 only the first agreed the counts: the later ones paired the
    longer rank's last step's reduce with the other's epoch-end one: a gloo abort, found by a fresh-user tryout)."""
    for name, counts, batch_size in (
        ("join_iterable", ITERABLE, ITERABLE_BATCH),
        ("join_map", MAP, MAP_BATCH),
        ("join_map_val_steps", MAP, MAP_BATCH),
    ):
        expected = reference(counts, batch_size)
        for rec in load(runs, name, 2):
            assert rec["error"] is None and len(rec["val"]) == EPOCHS, (name, rec["error"], rec["val"])
            for got, want, unweighted in zip(rec["val"], expected.val, expected.val_of_batch_means, strict=True):
                assert abs(got - want) <= 1e-6 * abs(want) and abs(got - unweighted) > 1e-3, (name, rec["val"])


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_stop_trains_every_rank_the_shortest_ranks_batches(runs):
    """uneven_inputs="stop": an IterableDataset (per-step flags) and pre-sharded map-style data (the epoch cut at
    its start, every epoch) train each rank its first min(count) batches per epoch, recorded per epoch, with
    identical weights equal to DDP's average over those steps."""
    cases = (("stop_iterable", ITERABLE, ITERABLE_BATCH, 4), ("stop_map", MAP, MAP_BATCH, 3))
    for name, counts, batch_size, steps in cases:
        records = load(runs, name, 2)
        expected = indices(counts, batch_size, steps)
        for r, rec in enumerate(records):
            assert rec["error"] is None and rec["steps"] == EPOCHS * steps, name
            assert rec["seen"] == {e: expected[r] for e in range(EPOCHS)}, name
        assert_weights(records, reference(counts, batch_size, steps=steps).layer)
        assert all(rec["epochs"] == {0: (steps, steps), 1: (steps, steps)} for rec in records), name


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_buffers_keep_every_tail_batch_when_rank_0_has_run_out(runs):
    """A BatchNorm (momentum 0.5) on the inputs, rank 0 with 1 batch and rank 1 with 3: rank 1's running mean, which
    both ranks end with, holds all 3 of its batches (the tail steps' buffers come from an active rank, as under
    DDP's own join), not rank 0's stale one with rank 1's last batch."""
    x = samples(1, BN_COUNTS[1], TRAIN_SALT)[0]
    running = torch.zeros(3)
    for s in range(0, BN_COUNTS[1], ITERABLE_BATCH):
        running = (1 - BN_MOMENTUM) * running + BN_MOMENTUM * x[s : s + ITERABLE_BATCH].mean(0)
    records = load(runs, "buffers", 2)
    assert_same_on_every_rank([r["weights"] for r in records], "parameters and buffers")
    assert records[0]["error"] is None and records[0]["epochs"] == {0: (1, 3)}
    assert torch.allclose(records[0]["weights"]["norm.running_mean"], running, **TIGHT)
    assert records[0]["weights"]["norm.num_batches_tracked"] == 3


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_error_refuses_known_counts_at_the_epoch_start_and_unknown_ones_where_a_rank_ends(runs):
    """uneven_inputs="error": pre-sharded map-style data raises ValueError with the counts before any step, an
    IterableDataset UnevenInputsError at rank 1's last (4th) batch, on both ranks, within seconds."""
    for r, rec in enumerate(load(runs, "error_map", 2)):
        error_type, message, seconds = rec["error"]
        assert error_type == "ValueError" and seconds < 20 and rec["steps"] == 0 and rec["seen"] == {}
        assert message.startswith(
            f"[rank {r}] ranks have different numbers of training batches in epoch 0:"
            " {0: 4, 1: 3}, refused by MyDDPStrategy(uneven_inputs='error')"
        ), message
    for r, rec in enumerate(load(runs, "error_iterable", 2)):
        error_type, message, seconds = rec["error"]
        assert error_type == UnevenInputsError.__name__ and seconds < 20 and rec["steps"] == 3
        assert message.startswith(
            f"[rank {r}] ranks [1] reach the end of their training data at batch 4 of"
            " epoch 0 while the others have more"
        ), message


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_even_inputs_train_bitwise_as_under_lightning_ddp_and_sharded_loaders_are_untouched(runs):
    """An IterableDataset with 5 batches on each rank: MyDDPStrategy() and strategy="ddp" (same user code) give
    bitwise the same weights, per-step logged values and validation values; a loader the strategy shards runs no
    uneven-inputs logic (no epoch recorded)."""
    ours, lightning = load(runs, "even_ours", 2), load(runs, "even_ddp", 2)
    for r in range(2):
        assert ours[r]["error"] is None and lightning[r]["error"] is None
        assert ours[r]["seen"] == lightning[r]["seen"] and ours[r]["steps"] == lightning[r]["steps"] == 10
        assert_same_on_every_rank([ours[r]["weights"], lightning[r]["weights"]], "parameters")
        assert ours[r]["results"] == lightning[r]["results"] and ours[r]["val"] == lightning[r]["val"]
    assert not torch.equal(ours[0]["weights"]["layer.weight"], ours[0]["initial"]["weight"])
    for rec in load(runs, "sharded", 2):
        assert rec["error"] is None and rec["steps"] == 5 and rec["epochs"] == {}


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_steps_every_rank_takes_agree_asynchronously_and_a_step_a_rank_lacks_notifies_the_join(runs):
    """Under uneven_inputs="join" whether this rank has a next batch rides in each step's asynchronous all-reduces of
    the SIGTERM flags (boundaries.py, on the gloo side group: at the step's start and before its backward pass), read
    at the next step: on an even stream (5 and 5 batches, 2 epochs) those two are the only side-group all-reduces a
    step makes (beside the barriers, made of one), as on even data, and the policy's
    world-group all-reduces (each one blocking) come only with the epochs' first steps (the epoch start's count, the
    join's first notify) and ends; on 5 and 4 batches also in the step rank 1 lacks (rank 0's 5th: the join's
    notify, its announcements), which rank 1 answers after its 4th."""
    for rec in load(runs, "even_ours", 2):
        side = [(step, module) for step, module, _, world in rec["all_reduces"] if not world]
        # (Lightning's barriers; and the join's one all-reduce that connects the side group's ring, before the fit)
        rounds = [(step, module) for step, module in side if module not in ("boundaries.py:barrier", "group.py")]
        epochs = [(0, "boundaries.py:on_train_epoch_start"), (5, "boundaries.py:on_train_epoch_start")]
        fit_end = [(10, "boundaries.py:on_train_epoch_start")]  # (each epoch's start and the fit's end: one more)
        assert sorted(rounds) == sorted([(step, "boundaries.py:start") for step in range(10)] * 2 + epochs + fit_end)
        calls = [(step, world) for step, module, _, world in rec["all_reduces"] if module in UNEVEN_MODULES]
        assert {step for step, world in calls if world} == {0, 5, 10}
    records = load(runs, "join_iterable", 2)
    for rec, expected in zip(records, ({0, 4, 5, 9, 10}, {0, 4, 8}), strict=True):
        calls = [(step, world) for step, module, _, world in rec["all_reduces"] if module in UNEVEN_MODULES]
        assert {step for step, world in calls if world} == expected


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_only_epochs_whose_counts_differ_are_recorded_and_logged(runs):
    """An even stream (5 and 5 batches) under "join" and "stop": no epoch recorded, no "Uneven inputs" line, and
    the fit summary says a stream's batches and optimizer steps are unknown (not "inf"); 5 and 4 batches still log
    the counts of each epoch on rank 0, "stop" what every rank trained."""
    for name in ("even_ours", "stop_even"):
        records = load(runs, name, 2)
        assert [rec["epochs"] for rec in records] == [{}, {}], name
        assert not [m for rec in records for m in rec["messages"] if m.startswith("Uneven inputs")], name
        (summary,) = [m for m in records[0]["messages"] if m.startswith("DDP fit summary")]
        assert "data: training samples: ?, batches and optimizer steps per epoch unknown (streaming loader)" in summary
    assert (
        "Uneven inputs (uneven_inputs='join'; a step's gradient sum divided by W): batches trained per rank,"
        " epoch 0: [5, 4], epoch 1: [5, 4]" in load(runs, "join_iterable", 2)[0]["messages"]
    )
    assert (
        "Uneven inputs (uneven_inputs='stop'; the longer ranks' later batches not trained): batches trained per"
        " rank, epoch 0: [4, 4], epoch 1: [4, 4]" in load(runs, "stop_iterable", 2)[0]["messages"]
    )


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_a_zero_redundancy_optimizer_on_even_inputs_trains_bitwise_as_under_lightning_ddp(runs):
    """The same ZeroRedundancyOptimizer module, clipping and scheduler on 5 batches per rank: MyDDPStrategy() on
    pre-sharded shards (equal known counts: nothing uneven, nothing said), MyDDPStrategy() on the stream (its counts
    unknown: rank 0 warns that an uneven one would fail at the first step a rank lacks, and names the optimizer and
    uneven_inputs='stop', but runs it) and strategy="ddp" on the stream give bitwise the same weights after 10 steps,
    equal to the reference."""
    ours, stop, lightning = (load(runs, f"zero_even_{name}", 2) for name in ("ours", "join", "ddp"))
    warned = [
        [w for w in rec[r]["warnings"] if w.startswith("The ranks' numbers of training batches are unknown")]
        for rec in (stop, ours)
        for r in range(2)
    ]
    assert [len(w) for w in warned] == [2, 0, 0, 0]  # rank 0 of the stream's fit, at each epoch's start
    assert "optimizer 0 (a ZeroRedundancyOptimizer)" in warned[0][0] and "uneven_inputs='stop'" in warned[0][0]
    for r in range(2):
        assert [rec[r]["error"] for rec in (ours, stop, lightning)] == [None] * 3
        assert ours[r]["steps"] == stop[r]["steps"] == lightning[r]["steps"] == 10
        assert_same_on_every_rank([ours[r]["weights"], stop[r]["weights"], lightning[r]["weights"]], "parameters")
    assert_weights(ours, reference((ITERABLE[0],) * 2, ITERABLE_BATCH, clip=CLIP, gamma=GAMMA).layer)


def assert_refused(records: list[dict], error_type: str, *parts: str) -> None:
    """Every rank raised ``error_type`` within seconds (the collective timeout is 60 s), its message naming its rank
    and holding each of ``parts``."""
    for r, rec in enumerate(records):
        assert rec["error"] is not None
        got_type, message, seconds = rec["error"]
        assert got_type == error_type and seconds < 20 and message.startswith(f"[rank {r}] "), rec["error"]
        assert all(part in message for part in parts), (parts, message)


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_accumulation_that_a_shorter_ranks_last_batch_ends_is_refused_on_every_rank(runs):
    """accumulate_grad_batches=3 on an IterableDataset, 5 and 4 batches: rank 1's last batch would end an
    accumulation alone, so both ranks raise UnevenInputsError at batch 4's start (after 3 batches, one optimizer
    step), naming k and rank 1; pre-sharded 4 and 3 batches with k=2 (known counts): ValueError at the epoch's
    start, before any step."""
    accumulation = "on ranks with different numbers of training batches (epoch 0): the last batch of ranks [1] ends"
    records = load(runs, "accumulate_3", 2)
    assert_refused(
        records, UnevenInputsError.__name__, f"accumulate_grad_batches=3 {accumulation}", "a multiple of 3 batches"
    )
    assert [rec["steps"] for rec in records] == [1, 1] and [len(rec["seen"][0]) for rec in records] == [3, 3]
    records = load(runs, "accumulate_map", 2)
    assert_refused(records, "ValueError", f"accumulate_grad_batches=2 {accumulation}", "a multiple of 2 batches")
    assert all(rec["steps"] == 0 and rec["seen"] == {} for rec in records)


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_accumulation_that_every_shorter_rank_ends_trains_every_batch_once_with_the_reference_weights(runs):
    """accumulate_grad_batches=2 on an IterableDataset, 5 and 4 batches: rank 1's last batch ends an accumulation,
    so the epoch trains under join: every batch once per epoch, 3 optimizer steps (the 3rd rank 0's 5th batch alone),
    identical weights equal to the reference with each loss divided by 2."""
    records = load(runs, "accumulate_2", 2)
    expected = indices(ITERABLE, ITERABLE_BATCH)
    for r, rec in enumerate(records):
        assert rec["error"] is None and rec["seen"] == {e: expected[r] for e in range(EPOCHS)}
        assert rec["steps"] == 6 and rec["epochs"] == {0: (5, 4), 1: (5, 4)}
    assert_weights(records, reference(ITERABLE, ITERABLE_BATCH, accumulate=2).layer)


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_validation_inside_an_uneven_epoch_is_refused_on_every_rank(runs):
    """val_check_interval=2 on an IterableDataset (5 and 4 batches: rank 1's 4th, its last, would validate alone
    after the shared run at batch 2; counted across epochs or per epoch, where the steps agree asynchronously) and
    val_check_interval=0.5 on pre-sharded 4 and 3 batches (rank 1 validates after batch 1, rank 0 after 2):
    UnevenInputsError on both ranks within seconds, naming the validation run and val_check_interval."""
    for name in ("val_every_2", "val_every_2_per_epoch"):  # per epoch: the steps both take agree asynchronously
        records = load(runs, name, 2)
        assert_refused(records, UnevenInputsError.__name__, "validation run", "val_check_interval")
        assert [rec["steps"] for rec in records] == [4, 4] and [len(rec["val"]) for rec in records] == [1, 1], name
    records = load(runs, "val_half_map", 2)
    assert_refused(
        records,
        UnevenInputsError.__name__,
        "start a validation run while 1 train a batch",
        "Trainer(val_check_interval=0.5) counts each rank's own batches",
    )
    assert [rec["val"] for rec in records] == [[], []]


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_an_iterable_datasets_limit_or_length_is_a_hint_and_trains_under_join(runs):
    """An IterableDataset of 5 and 4 batches under limit_train_batches=5, and one whose __len__ says 5 batches on
    both ranks: each trains like the plain case (every batch once per epoch, 10 steps, counts (5, 4) recorded,
    the reference weights on both ranks), not a hang waiting for rank 1's 5th batch."""
    expected = indices(ITERABLE, ITERABLE_BATCH)
    for name in ("limit_5", "length_hint"):
        records = load(runs, name, 2)
        for r, rec in enumerate(records):
            assert rec["error"] is None and rec["seen"] == {e: expected[r] for e in range(EPOCHS)}, name
            assert rec["steps"] == 10 and rec["epochs"] == {0: (5, 4), 1: (5, 4)}, name
        assert_weights(records, reference(ITERABLE, ITERABLE_BATCH).layer)


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_a_rank_without_any_batch_stops_every_rank_or_is_refused(runs):
    """An IterableDataset where rank 1 yields nothing: uneven_inputs="stop" ends both epochs before any batch on
    every rank (no step, the initial weights, counts (0, 0) recorded on rank 0), without a hang; uneven_inputs=
    "error" raises UnevenInputsError on both ranks within seconds."""
    records = load(runs, "stop_none", 2)
    for rec in records:
        assert rec["error"] is None and rec["steps"] == 0 and rec["seen"] == {}
        assert torch.equal(rec["weights"]["layer.weight"], rec["initial"]["weight"])
    assert records[0]["epochs"] == {0: (0, 0), 1: (0, 0)}
    records = load(runs, "error_none", 2)
    assert_refused(records, UnevenInputsError.__name__, "uneven_inputs='error'")
    assert "ranks [1] reach the end of their training data at batch 1 of epoch 0" in records[0]["error"][1]
    assert "this rank has no training batch in epoch 0 while others have some" in records[1]["error"][1]
    assert all(rec["steps"] == 0 for rec in records)


# ----------------------------------------------------------------------------- evaluation (issue 38 item 1)
def evaluation_reference() -> SimpleNamespace:
    """One process over ``EVAL``'s batches: per step ``s``, the ``x`` logged (the mean over the ranks holding step
    ``s`` of ``10 * (rank + 1) + s``) and the metric's value (their batches' target sum); the epoch's loss over all
    samples and the metric's total; every sample's index."""
    per_rank = rank_batches(EVAL, EVAL_BATCH, EVAL_SALT)
    layer, steps = make_layer(), []
    for s in range(max(map(len, per_rank))):
        holding = [r for r, batches in enumerate(per_rank) if s < len(batches)]
        x = sum(10 * (r + 1) + s for r in holding) / len(holding)
        steps.append({"batch": s, "x": x, "metric": sum(per_rank[r][s][1].sum().item() for r in holding)})
    xs, ys, idx = (torch.cat([b[i] for batches in per_rank for b in batches]) for i in range(3))
    with torch.no_grad():
        loss = loss_of(layer, xs, ys).item()
    return SimpleNamespace(steps=steps, loss=loss, total=ys.sum().item(), indices=sorted(idx.tolist()))


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_uneven_evaluation_streams_run_under_the_join_with_the_single_process_values(runs):
    """validate and test (a __len__ that is a wrong hint: 5 batches on both ranks) on streams of 5 and 4 batches, with
    self.log("x", on_step=True, sync_dist=True) and a torchmetrics SumMetric(dist_sync_on_step=True) in every step:
    each rank's step values are those of the ranks holding the step (rank 0's 5th: its own), and on both ranks the
    epoch's loss and the metric's compute() equal one process over all 18 samples; predict with the same metric gives
    a BasePredictionWriter every sample exactly once."""
    expected = evaluation_reference()
    for stage in ("validate", "test", "predict"):
        for r, rec in enumerate(load(runs, f"eval_{stage}", 2)):
            assert rec["error"] is None, (stage, rec["error"])
            want = expected.steps[: len(rank_batches(EVAL, EVAL_BATCH, EVAL_SALT)[r])]
            assert [s["batch"] for s in rec["steps"]] == [s["batch"] for s in want], stage
            for got, step in zip(rec["steps"], want, strict=True):
                assert got["metric"] == pytest.approx(step["metric"], abs=1e-5), (stage, got, step)
                assert stage == "predict" or got["x"] == step["x"], (stage, got, step)
            assert rec["computed"] == pytest.approx(expected.total, abs=1e-5), stage
            assert stage == "predict" or rec["loss"] == pytest.approx(expected.loss, rel=1e-6), stage
    written = [i for rec in load(runs, "eval_predict", 2) for i in rec["written"]]
    assert sorted(written) == expected.indices


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_an_all_gather_in_an_evaluation_tail_step_is_refused_on_every_rank(runs):
    """self.all_gather in validation_step on streams of 5 and 4 batches: rank 0's 5th step, which rank 1 (out of data)
    only shadows, raises UnevenInputsError on both ranks within seconds, naming the validation batch and what to do."""
    assert_refused(
        load(runs, "eval_refuse", 2),
        UnevenInputsError.__name__,
        "validation batch 5 (batch_idx 4) of epoch 0 on ranks [0] makes an all_gather",
        "in which ranks [1], out of validation data, cannot take part",
        "gather at the epoch's end",
    )


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_a_refusal_is_the_only_error_where_a_loaders_length_reads_the_rank(runs):
    """A map-style data set whose __len__ calls torch.distributed.get_rank() (WebDataset's split_by_node style), 4 and
    3 batches under uneven_inputs="error": the refusal is the error on both ranks, not "Default process group has not
    been initialized" from Lightning's loop teardown reading the length after the group is gone."""
    assert_refused(load(runs, "rank_sized", 2), "ValueError", "ranks have different numbers of training batches")
    assert not any("process group" in rec["error"][1] for rec in load(runs, "rank_sized", 2))


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_lightnings_ddp_goes_wrong_on_the_same_uneven_evaluation_streams(tmp_path):
    """The same validation under Lightning's ddp (a 10 s collective timeout): a rank fails at the timeout or returns
    values that are not the single process's, where MyDDPStrategy gives them (the test above)."""
    launch(scenario_evaluation_ddp, 2, tmp_path, timeout_s=180)
    expected = evaluation_reference()
    records = load(tmp_path, "eval_ddp_validate", 2)
    assert any(
        rec["error"] is not None
        or rec["loss"] != pytest.approx(expected.loss, rel=1e-6)
        or rec["computed"] != pytest.approx(expected.total, abs=1e-5)
        for rec in records
    ), records


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_a_direct_torch_distributed_call_in_a_tail_step_is_named_on_the_rank_left(tmp_path):
    """A training_step's own torch.distributed.all_reduce (not through the strategy, so not shadowed): in the 4 steps
    both ranks take it sums both ranks' values, as under ddp; in rank 0's 5th, while rank 1 is out of data, it meets
    the join's message and gloo aborts rank 0 (its C++ check, "Received data size doesn't match expected size": no
    Python error there), and rank 1's error comes within seconds naming the direct call as the likely cause and what
    to do (the fix it names, strategy.reduce, gives the single process's values in a tail step: the test of the
    shadowed collectives)."""
    with pytest.raises(AssertionError, match="rank 0 exited with code -6"):
        launch(scenario_direct_collective, 2, tmp_path, timeout_s=180)
    record = torch.load(tmp_path / "direct.rank1.pt", weights_only=True)
    assert [got["torch_distributed"] for got in record["results"]] == [30.0 + 2 * i for i in range(4)]
    error_type, message, seconds = record["error"]
    assert error_type == "RuntimeError" and seconds < 20, record["error"]
    assert (
        "[rank 1] a collective failed because another rank did not take part. A likely cause: the ranks hold" in message
    )
    assert "a collective that a step or callback makes with torch.distributed directly meets the join's" in message
    assert "Make it through self.log(..., sync_dist=True) or trainer.strategy.reduce, barrier or broadcast" in message
    assert "or pass MyDDPStrategy(uneven_inputs='stop')" in message and "Cause: rank 0" in message
