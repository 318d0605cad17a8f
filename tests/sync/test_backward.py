"""The strategy's backward hooks (``post_backward``, ``block_backward_sync``; ddp_strategy/sync/wrapping.py) side by
side with Lightning's ``"ddp"``, on 2 real gloo ranks: manual optimization under ``static_graph`` all-reduces the first
step as ``"ddp"`` does, ``static_graph`` with gradient accumulation trains (``"ddp"`` fails in torch), a parameter
unused on one rank only is named on every rank within seconds, and a graph that changes under ``static_graph`` says
so. Fits: tests/sync/backward_workers.py; weights and gradients are checked against a single-process replay.
"""

from __future__ import annotations

import backward_workers as bw
import pytest
import torch
from ddp_testing import launch, load

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

NAMED = "2 parameter(s) received no gradient in backward: ['aux.weight', 'aux.bias']"
LIGHTNING_UNUSED = "It looks like your LightningModule has parameters that were not used in producing the loss"


@pytest.fixture(scope="module")
def records(tmp_path_factory) -> tuple[object, dict]:
    """Run :func:`backward_workers.scenario_backward` once; return the folder and a loader of one fit's records."""
    out = tmp_path_factory.mktemp("backward")
    launch(bw.scenario_backward, 2, out, timeout_s=240)
    return out, lambda name: load(out, name, 2)


def _replay(
    ranks: list[dict], accumulate: int = 1, aux_steps: tuple[int, ...] | None = None
) -> tuple[list[dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    """One process from rank 0's initial weights, fed the union of both ranks' batches (2B) with the loss scaled by
    1/accumulate: the gradient after each backward and the final weights."""
    model = bw.AuxNet(aux_steps=aux_steps)
    model.load_state_dict(ranks[0]["initial"])
    opt = torch.optim.SGD(model.parameters(), lr=bw.LR)
    x, _ = bw.data().tensors
    grads = []
    batches = list(zip(ranks[0]["batches"], ranks[1]["batches"], strict=True))
    for start in range(0, len(batches), accumulate):
        opt.zero_grad()
        for step, (b0, b1) in enumerate(batches[start : start + accumulate], start):
            (model.loss(x[torch.tensor(b0 + b1)], step) / accumulate).backward()
            grads.append(model.gradients())
        opt.step()
    return grads, model.state_dict()


def _assert_replayed(
    ranks: list[dict],
    steps: int,
    accumulate: int = 1,
    synced_every: int = 1,
    aux_steps: tuple[int, ...] | None = None,
) -> None:
    """Both ranks trained without error; after each backward (each ``synced_every``-th: the others are under
    ``no_sync``) both hold the replay's gradient, at the end its weights (within 1e-6)."""
    assert [r["error"] for r in ranks] == [None, None]
    grads, final = _replay(ranks, accumulate, aux_steps)
    for rank in ranks:
        assert len(rank["grads"]) == steps
        for step, (got, want) in enumerate(zip(rank["grads"], grads, strict=True)):
            for name in want if (step + 1) % synced_every == 0 else ():
                torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-6, msg=f"step {step} {name}")
        for name, value in final.items():
            torch.testing.assert_close(rank["final"][name], value, rtol=0, atol=1e-6, msg=name)


@pytest.mark.parametrize("options", list(bw.MANUAL_OPTIONS))
def test_manual_optimization_gradients_equal_a_replay_under_each_option(records, options):
    """manual_backward + opt.step() per batch: under each DDP option combination (static_graph, with
    gradient_as_bucket_view and a comm hook, find_unused_parameters, several buckets) both ranks hold the replay's
    gradient after every backward, the first static-graph step included, and end at its weights, as under "ddp"."""
    _, load_fit = records
    for strategy in ("ours", "ddp"):
        _assert_replayed(load_fit(f"manual_{options}_{strategy}"), steps=4)


@pytest.mark.parametrize("options", list(bw.ACCUMULATE_OPTIONS))
def test_static_graph_with_accumulation_trains_like_a_replay(records, options):
    """static_graph=True, accumulate_grad_batches=2: ours all-reduces each micro-batch (no no_sync, which torch
    refuses under a static graph), so both ranks hold the replay's accumulated gradient and end at its weights;
    "ddp" dies in torch's internal assert (pytorch/pytorch#143580) on both ranks."""
    _, load_fit = records
    _assert_replayed(load_fit(f"accumulate_{options}_ours"), steps=4, accumulate=2)
    if options == "static":
        errors = [r["error"] for r in load_fit("accumulate_static_ddp")]
        assert all(e is not None and "expect_autograd_hooks_" in e for e in errors), errors


def test_parameter_unused_before_the_last_micro_batch_trains(records):
    """accumulate_grad_batches=2, aux used in each window's last micro-batch only: DDP all-reduces there, with every
    gradient, so both strategies train like the replay (the unused-parameter check skips no_sync backwards)."""
    _, load_fit = records
    for strategy in ("ours", "ddp"):
        _assert_replayed(
            load_fit(f"accumulate_late_aux_{strategy}"), steps=4, accumulate=2, synced_every=2, aux_steps=(1, 3)
        )


def test_changed_graph_under_static_graph_says_so(records):
    """static_graph=True, aux used in the first step only: both strategies raise a RuntimeError on both ranks; ours
    names the parameters and says the graph changed, advising static_graph=False with find_unused_parameters=True
    (not find_unused_parameters alone, as "ddp"'s text does)."""
    _, load_fit = records
    for rank, record in enumerate(load_fit("static_changed_ours")):
        assert record["error"].startswith(f"RuntimeError: [rank {rank}] {NAMED}. The graph changed"), record["error"]
        assert "MyDDPStrategy(static_graph=False, find_unused_parameters=True)" in record["error"]
    assert all(r["error"].startswith(f"RuntimeError: {LIGHTNING_UNUSED}") for r in load_fit("static_changed_ddp"))


def test_parameter_unused_on_one_rank_is_named_on_every_rank_within_seconds(records):
    """aux used on rank 0 only, find_unused_parameters=False: rank 1 raises ours, naming aux and the option (no
    collective that could pair with rank 0's bucket all-reduce, which killed rank 1 in gloo's C++); rank 0's broken
    all-reduce names rank 1 and its error; both within 20 s of the fit's start (the group's timeout is 30 s)."""
    _, load_fit = records
    rank0, rank1 = load_fit("rank_branch_ours")
    assert rank1["error"].startswith(f"RuntimeError: [rank 1] {NAMED}. With find_unused_parameters=False")
    assert "Pass MyDDPStrategy(find_unused_parameters=True)" in rank1["error"]
    assert f"Cause: rank 1 failed: RuntimeError: [rank 1] {NAMED}" in rank0["error"], rank0["error"]
    assert rank0["seconds"] < 20 and rank1["seconds"] < 20


@pytest.mark.slow
def test_parameter_unused_on_one_rank_under_lightning_waits_for_the_timeout(tmp_path):
    """The same per-rank branch under "ddp" (10 s collective timeout): rank 1 raises DDP's unused-parameter error
    at its next forward, rank 0 only the collective's timeout or, where rank 1's exit comes first, gloo's "Connection
    closed by peer" (seen once in CI), naming nobody (ours: both name the parameters)."""
    launch(bw.scenario_rank_branch_ddp, 2, tmp_path, timeout_s=120)
    rank0, rank1 = load(tmp_path, "rank_branch_ddp", 2)
    assert rank1["error"].startswith(f"RuntimeError: {LIGHTNING_UNUSED}"), rank1["error"]
    assert any(w in rank0["error"] for w in ("Timed out", "Connection closed")), rank0["error"]
    assert "aux" not in rank0["error"] and "Cause" not in rank0["error"], rank0["error"]
