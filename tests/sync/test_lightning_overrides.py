"""What users of Lightning's ``DDPStrategy`` rely on beyond its arguments, under ``MyDDPStrategy`` too: a subclass's
``setup_distributed``, ``configure_ddp``, ``_setup_model`` and ``_register_ddp_hooks`` run, in Lightning's order;
``model_averaging_period`` with the post-localSGD comm hook averages the parameters with torch's
``PeriodicModelAverager``; the optimizers' state is moved to the root device after they are set up.

One launch of 2 real gloo processes fits the same user code under a subclass of Lightning's ``DDPStrategy`` and one of
``MyDDPStrategy``. On CPU Lightning registers no comm hook (CUDA only), so its gradients are all-reduced each step and
the averaging leaves the ranks as they are; ours registers the hook on gloo with the node's group as post-localSGD's
subgroup (torch's default needs CUDA), the world on one node: the same weights. A slow variant runs real local SGD
(``post_local_gradient_allreduce=False``), where the ranks part between averagings.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from ddp_testing import launch, load, quiet_trainer, save
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as post_localsgd
from torch.utils.data import DataLoader, TensorDataset

from ddp_strategy import MyDDPStrategy

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

STEPS = 8  # optimizer steps: 2 of warm-up (start_localSGD_iter), then averaging at steps 6 and 10 (period 4)
OVERRIDES = ["setup_distributed", "configure_ddp", "_setup_model", "_register_ddp_hooks"]


class Probe:
    """An optimizer-state entry that records the devices it is moved to (Lightning moves anything with ``.to``)."""

    def __init__(self) -> None:
        self.devices: list[str] = []

    def to(self, device: torch.device, **kwargs: Any) -> Probe:
        self.devices.append(str(device))
        return self


class Net(pl.LightningModule):
    """A linear model whose ranks read different rows; SGD with momentum, a :class:`Probe` in its state."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.Linear(4, 1)
        self.weights: list[torch.Tensor] = []

    def train_dataloader(self) -> Any:
        x = torch.randn(2 * STEPS * 4, 4, generator=torch.Generator().manual_seed(1))
        return DataLoader(TensorDataset(x, x.sum(1, keepdim=True).sin()), batch_size=4, shuffle=True)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return nn.functional.mse_loss(self.layer(batch[0]), batch[1])

    def on_train_batch_end(self, *args: Any) -> None:
        self.weights.append(self.layer.weight.detach().clone())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        optimizer.state[self.layer.weight]["probe"] = self.probe = Probe()
        return optimizer


def recording(base: type) -> type:
    """A subclass of ``base`` recording each call of the methods in :data:`OVERRIDES`, as users override them."""

    class Recording(base):  # type: ignore[misc, valid-type]
        calls: list[str] = []  # noqa: RUF012

        def setup_distributed(self) -> None:
            self.calls.append("setup_distributed")
            super().setup_distributed()

        def configure_ddp(self) -> None:
            self.calls.append("configure_ddp")
            super().configure_ddp()

        def _setup_model(self, model: nn.Module) -> nn.Module:
            self.calls.append("_setup_model")
            return super()._setup_model(model)

        def _register_ddp_hooks(self) -> None:
            self.calls.append("_register_ddp_hooks")
            super()._register_ddp_hooks()

    return Recording


def scenario_overrides(out: Path, prefix: str = "", **state_options: Any) -> None:
    """Fit :class:`Net` under a recording subclass of each strategy, post-localSGD with ``model_averaging_period=4``
    (``state_options``: more of ``PostLocalSGDState``'s; records named ``prefix`` + the strategy)."""
    for name, base, options in (("lightning", DDPStrategy, {}), ("mine", MyDDPStrategy, {"start_method": "popen"})):
        cls = recording(base)
        cls.calls = []
        state = post_localsgd.PostLocalSGDState(None, None, start_localSGD_iter=2, **state_options)
        strategy = cls(
            ddp_comm_hook=post_localsgd.post_localSGD_hook,
            ddp_comm_state=state,
            model_averaging_period=4,
            timeout=timedelta(seconds=60),
            **options,
        )
        model = Net()
        quiet_trainer(2, strategy, max_steps=STEPS).fit(model)
        averager = strategy._model_averager
        save(
            out,
            prefix + name,
            {
                "calls": cls.calls,
                "weights": model.weights,
                "averager": (type(averager).__name__, averager.period, averager.warmup_steps, averager.step),
                "probe": model.probe.devices,
                "root_device": str(strategy.root_device),
            },
        )
    torch.distributed.destroy_process_group()


def scenario_local_sgd(out: Path) -> None:
    """:func:`scenario_overrides` with real local SGD after the warm-up (no gradient all-reduce)."""
    scenario_overrides(out, "local_", post_local_gradient_allreduce=False)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """The launch; returns the folder holding every rank's records."""
    out = tmp_path_factory.mktemp("overrides")
    launch(scenario_overrides, 2, out)
    return out


def test_a_subclass_overriding_lightnings_ddp_methods_is_called_in_lightnings_order(runs):
    """setup_distributed at launch, then configure_ddp calling _setup_model and _register_ddp_hooks, once each."""
    for records in (load(runs, "lightning", 2), load(runs, "mine", 2)):
        assert [r["calls"] for r in records] == [OVERRIDES, OVERRIDES]


def test_model_averaging_period_averages_with_torchs_averager_as_lightning(runs):
    """PeriodicModelAverager(period=4, warmup_steps=2), called after each of the 8 steps; the ranks' weights equal
    each other and Lightning's at every step."""
    lightning, mine = load(runs, "lightning", 2), load(runs, "mine", 2)
    for records in (lightning, mine):
        assert [r["averager"] for r in records] == [("PeriodicModelAverager", 4, 2, STEPS)] * 2
        assert len(records[0]["weights"]) == STEPS
    for step in range(STEPS):
        for records in (lightning, mine):
            torch.testing.assert_close(records[0]["weights"][step], records[1]["weights"][step])
        torch.testing.assert_close(mine[0]["weights"][step], lightning[0]["weights"][step])
    assert not torch.equal(mine[0]["weights"][0], mine[0]["weights"][-1])


def test_the_optimizer_state_is_moved_to_the_root_device_after_setup_as_lightning(runs):
    """The state entry created in configure_optimizers is moved to the root device at setup (then to the CPU at
    teardown, Lightning's base strategy), under both."""
    for records in (load(runs, "lightning", 2), load(runs, "mine", 2)):
        assert [r["probe"] for r in records] == [[r["root_device"], "cpu"] for r in records] == [["cpu", "cpu"]] * 2


@pytest.mark.slow
def test_local_sgd_on_cpu_diverges_between_averagings_and_is_averaged_every_period(tmp_path):
    """post_local_gradient_allreduce=False: ours runs local SGD on gloo after the 2 warm-up steps, the ranks equal only
    where the averager averaged (the 3rd and 7th steps); Lightning registers no hook on CPU: equal at every step."""
    launch(scenario_local_sgd, 2, tmp_path)
    mine, lightning = load(tmp_path, "local_mine", 2), load(tmp_path, "local_lightning", 2)
    equal = [torch.allclose(mine[0]["weights"][i], mine[1]["weights"][i]) for i in range(STEPS)]
    assert equal == [True, True, True, False, False, False, True, False]
    assert all(torch.allclose(a, b) for a, b in zip(lightning[0]["weights"], lightning[1]["weights"], strict=True))


def test_model_averaging_refusals_match_lightnings():
    """Without model_averaging_period, or with a ZeroRedundancyOptimizer: Lightning's ValueError; a non-integer
    period is refused at construction (Lightning: a TypeError at setup)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from ddp_strategy.sync import CommHookConfig, model_averager

    config = CommHookConfig(post_localsgd.post_localSGD_hook, post_localsgd.PostLocalSGDState(None, None, 2))
    with pytest.raises(ValueError, match="model averaging period is not provided"):
        model_averager(config, None, [])
    zero = ZeroRedundancyOptimizer.__new__(ZeroRedundancyOptimizer)
    with pytest.raises(ValueError, match="distributed optimizer of type ZeroRedundancyOptimizer"):
        model_averager(config, 4, [zero])
    assert model_averager(CommHookConfig("allreduce"), 4, []) is None
    with pytest.raises(TypeError, match="model_averaging_period"):
        MyDDPStrategy(model_averaging_period="4")
