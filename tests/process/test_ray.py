"""Ray Train: Ray's documented Lightning recipe on a local 2-worker Ray cluster (CPU), under ``MyDDPStrategy()`` and
under Ray's own ``RayDDPStrategy()``, compared (issue 50 item 1).

One run of ``tests/scripts/ray_train.py`` (a user's script: ``ray.init``, then three ``TorchTrainer.fit``) serves every
test here. Marked ``engines``: the README's quick command leaves them out, ``.ci/run`` installs the ``ray`` extra and
runs them (``pytest -m engines``); without Ray they skip.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from ddp_testing import LIGHTNING_KEYS, finish, session_members, start_session

from ddp_strategy import DigitsClassifier, DigitsDataModule

pytestmark = [pytest.mark.engines, pytest.mark.multiprocess, pytest.mark.timeout(600)]

SCRIPT = Path(__file__).parent.parent / "scripts" / "ray_train.py"


@pytest.fixture(scope="module")
def ray_runs(tmp_path_factory) -> tuple[Path, str]:
    """Run the script once; return its output folder and its console output."""
    pytest.importorskip("ray.train.lightning", reason="Ray Train is not installed: pip install 'ddp_strategy[ray]'")
    out = tmp_path_factory.mktemp("ray")
    proc = start_session([sys.executable, str(SCRIPT), str(out)])
    code, log = finish(proc, timeout=540)
    assert code == 0, log[-5000:]
    assert session_members(proc.pid) == [], "a Ray process outlived the script"
    return out, log


def _ranks(out: Path, run: str) -> list[dict]:
    return [torch.load(out / run / f"rank{r}.pt", weights_only=False) for r in range(2)]


def _result(out: Path, run: str) -> dict:
    return torch.load(out / f"{run}.result.pt", weights_only=False)


def test_ray_workers_train_as_under_ray_ddp_strategy(ray_runs):
    """Both workers end with identical weights, bitwise those of the same code under RayDDPStrategy; the injected
    samplers shard by Ray's world (2 replicas) into disjoint halves of the 1,438 training samples, as Ray's do."""
    out, _ = ray_runs
    ours, ray = _ranks(out, "ours"), _ranks(out, "ray")
    assert [r["strategy"] for r in ours + ray] == ["MyDDPStrategy"] * 2 + ["RayDDPStrategy"] * 2
    for rank in ours + ray:
        assert rank["world_size"] == 2
        assert rank["sampler_kwargs"]["num_replicas"] == 2
        assert all(torch.equal(rank["final"][k], ours[0]["final"][k]) for k in ours[0]["final"])
    for epoch in (0, 1):
        shards = [set(rank["seen"][epoch]) for rank in ours]
        assert len(shards[0]) == len(shards[1]) == 719 and not shards[0] & shards[1]
        assert [rank["seen"][epoch] for rank in ours] == [rank["seen"][epoch] for rank in ray]


def test_ray_evaluation_is_exact_and_the_reported_checkpoint_has_no_module_prefix(ray_runs):
    """RayTrainReportCallback reports a checkpoint with Lightning's keys (no `module.`), holding the workers' final
    weights; its val_acc is the accuracy of those weights over the 359 validation samples, each evaluated once
    (RayDDPStrategy's DistributedSampler evaluates 360: one sample twice)."""
    out, _ = ray_runs
    ours, ray, result = _ranks(out, "ours"), _ranks(out, "ray"), _result(out, "ours")
    assert set(result["state_dict"]) == LIGHTNING_KEYS
    assert all(torch.equal(v, ours[0]["final"][k.removeprefix("model.")]) for k, v in result["state_dict"].items())
    assert result["metrics"]["epoch"] == 1
    evaluated = [i for rank in ours for i in rank["val_seen"]]
    assert sorted(evaluated) == list(range(359))
    assert len([i for rank in ray for i in rank["val_seen"]]) == 360
    data, model = DigitsDataModule(), DigitsClassifier()
    data.setup("fit")
    model.load_state_dict(result["state_dict"])
    x, y = data.val_set.tensors
    with torch.no_grad():
        accuracy = (model(x).argmax(dim=1) == y).float().mean().item()
    assert result["metrics"]["val_acc"] == pytest.approx(accuracy, abs=1e-6)


def test_prepare_trainer_refuses_my_ddp_strategy_and_the_recipe_trains_without_it(ray_runs):
    """Ray's prepare_trainer only checks the strategy's class and refuses any but Ray's; left out, as the docs say,
    the recipe trains (the runs above)."""
    out, _ = ray_runs
    for rank in range(2):
        refusal = torch.load(out / "ours" / f"refused.rank{rank}.pt")
        assert refusal.startswith("Invalid strategy class: <class 'ddp_strategy.strategy.MyDDPStrategy'>")
    assert "state_dict" in _result(out, "ours")


def test_a_failing_ray_worker_is_named_on_the_other_within_seconds(ray_runs):
    """Rank 1 raises in its third step. Under ours rank 0's collective fails within seconds and its error names rank 1
    and its error, as under torchrun (Ray made the group before Lightning was imported: it is freed all the same).
    Under both strategies TorchTrainer.fit raises in the driver within seconds, naming rank 1."""
    out, log = ray_runs
    raised_at = torch.load(out / "failing" / "raised_at.pt")
    rank0 = torch.load(out / "failing" / "error.rank0.pt")  # as its callbacks' on_exception saw it: when
    assert rank0["at"] - raised_at < 10, f"rank 0 failed {rank0['at'] - raised_at:.1f} s after rank 1 raised"
    named = "[rank 0] a collective failed because another rank did not take part. Cause: rank 1 failed: "
    assert f"{named}ZeroDivisionError: rank 1 fails on purpose" in log  # logged before rank 1 may leave
    for run in ("failing", "failing_ray"):
        result, raised_at = _result(out, run), torch.load(out / run / "raised_at.pt")
        assert "[Rank 1 Error Snippet]" in result["error"]
        assert "ZeroDivisionError: rank 1 fails on purpose" in result["error"]
        assert result["at"] - raised_at < 30, f"{run}: named {result['at'] - raised_at:.1f} s after rank 1 raised"
