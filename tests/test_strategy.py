"""MyDDPStrategy: construction, registration and Trainer wiring in one process, then real two-process fits on CPU
with gloo (each fit shared by several tests to keep the suite fast)."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from ddp_testing import IndexedDigits, RecordingClassifier, launch, load, load_ranks, quiet_trainer, save
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import ParallelStrategy, StrategyRegistry
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.utils.data import DataLoader, TensorDataset

from ddp_strategy import DDPCheckpointIO, DigitsNet, MyDDPStrategy
from ddp_strategy import strategy as strategy_module
from ddp_strategy.testing import run_on_ranks


def test_is_a_parallel_strategy_not_lightnings_ddp():
    """MyDDPStrategy builds on ParallelStrategy, not on Lightning's DDPStrategy."""
    from lightning.pytorch.strategies import DDPStrategy

    assert issubclass(MyDDPStrategy, ParallelStrategy) and not issubclass(MyDDPStrategy, DDPStrategy)


def test_defaults():
    """Defaults as Lightning's ddp: 30-minute timeout, DDP's own options; backend chosen later, DDPCheckpointIO."""
    s = MyDDPStrategy()
    assert s._options.timeout == timedelta(minutes=30) and s._options.barrier_timeout == timedelta(minutes=30)
    assert s.process_group_backend is None
    assert isinstance(s.checkpoint_io, DDPCheckpointIO)
    assert s._options.ddp_kwargs == {}
    assert MyDDPStrategy(timeout=5)._options.timeout == timedelta(seconds=5)


def test_start_method_default_depends_on_interactivity(monkeypatch):
    """popen for scripts; fork in Jupyter or a REPL, where a script cannot be re-run."""
    assert MyDDPStrategy().start_method == "popen"
    monkeypatch.setattr(strategy_module._pl, "is_interactive", lambda: True)
    assert MyDDPStrategy().start_method == "fork"
    assert MyDDPStrategy(start_method="spawn").start_method == "spawn"


def test_registered_names_build_our_strategy():
    """strategy="my_ddp" and "my_ddp_spawn" resolve to MyDDPStrategy in a Trainer."""
    assert {"my_ddp", "my_ddp_spawn"} <= set(StrategyRegistry.available_strategies())
    trainer = Trainer(accelerator="cpu", devices=2, strategy="my_ddp_spawn", logger=False)
    assert isinstance(trainer.strategy, MyDDPStrategy) and trainer.strategy.start_method == "spawn"


def test_trainer_wires_devices_and_sampler_arguments():
    """With devices=2 the Trainer gives 2 CPU devices; sampler kwargs are world size and global rank."""
    trainer = Trainer(accelerator="cpu", devices=2, strategy=MyDDPStrategy(start_method="spawn"), logger=False)
    s = trainer.strategy
    assert s.parallel_devices == [torch.device("cpu")] * 2
    assert s.num_processes == 2 and s.num_nodes == 1 and s.world_size == 2
    assert s.distributed_sampler_kwargs == {"num_replicas": 2, "rank": 0}
    assert s.root_device == torch.device("cpu")
    assert s.is_distributed


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"find_unused_parameters": False},
        {"broadcast_buffers": True, "bucket_cap_mb": 5},
        {
            "static_graph": True,
            "gradient_as_bucket_view": True,
            "process_group_backend": "gloo",
            "timeout": timedelta(seconds=7),
            "start_method": "spawn",
            "ddp_comm_hook": default_hooks.fp16_compress_hook,
            "ddp_comm_state": None,
            "ddp_comm_wrapper": None,
        },
    ],
    ids=["defaults", "explicit-default", "buffers-buckets", "named"],
)
def test_attributes_read_on_trainer_strategy_are_lightnings(kwargs):
    """process_group_backend, _get_process_group_backend(), _timeout, _start_method, the _ddp_comm_* trio and
    determine_ddp_device_ids() equal DDPStrategy's for the same arguments; _ddp_kwargs is DDPStrategy's less the options
    passed with DDP's default value (retired in issue 48: docs/differences.md), and _ddp_kwargs.get(name, default) is
    DDPStrategy's for every option; none can be assigned."""
    from lightning.pytorch.strategies import DDPStrategy

    names = (
        "process_group_backend",
        "_timeout",
        "_start_method",
        "_ddp_comm_hook",
        "_ddp_comm_state",
        "_ddp_comm_wrapper",
    )
    defaults = {  # as DDP applies them: its signature's broadcast_buffers=None means True
        "find_unused_parameters": False,
        "static_graph": False,
        "gradient_as_bucket_view": False,
        "bucket_cap_mb": None,
        "broadcast_buffers": True,
    }
    seen, ddp_kwargs = [], []
    for cls in (DDPStrategy, MyDDPStrategy):
        s = Trainer(accelerator="cpu", devices=2, num_nodes=1, strategy=cls(**kwargs), logger=False).strategy
        seen.append(({n: getattr(s, n) for n in names}, s._get_process_group_backend(), s.determine_ddp_device_ids()))
        ddp_kwargs.append(s._ddp_kwargs)
        assert type(s._ddp_kwargs) is dict and type(s._timeout) is timedelta
    assert seen[0] == seen[1] and seen[1][1] == "gloo"
    lightnings, ours = ddp_kwargs
    assert ours == {k: v for k, v in lightnings.items() if v != defaults[k]}
    assert {k: ours.get(k, v) for k, v in defaults.items()} == {k: lightnings.get(k, v) for k, v in defaults.items()}
    with pytest.raises(AttributeError):
        s._ddp_kwargs = {}
    s._ddp_kwargs["static_graph"] = "changed"  # a copy, as read-only as a dict can be
    assert s._ddp_kwargs.get("static_graph") == kwargs.get("static_graph")


def test_nccl_barrier_passes_device_ids(monkeypatch):
    """On an NCCL group the barrier gets this rank's device id (checked without a GPU)."""

    calls = []
    s = MyDDPStrategy(parallel_devices=[torch.device("cuda", 0), torch.device("cuda", 1)])
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda *a: "nccl")
    monkeypatch.setattr(dist, "barrier", lambda **k: calls.append(k))
    monkeypatch.setattr(type(s), "local_rank", property(lambda self: 1))
    s.barrier()
    assert calls == [{"device_ids": [1]}]


def test_reduce_without_a_process_group_returns_its_input():
    """Without a process group reduce() gives back what it got, a tensor (whatever the group) or not, as Lightning's."""
    s, t = MyDDPStrategy(), torch.tensor([1.0, 3.0])
    assert s.reduce(3.5) == 3.5 and s.reduce(t, group=object()) is t and s.reduce(t, reduce_op="sum") is t


# ------------------------------------------------ collectives over a group, under strategy="ddp" and MyDDPStrategy()
class GroupCollectives(pl.LightningModule):
    """Validates 2 steps per rank, logging ``rank + 1`` with ``sync_dist`` over the world, the rank's own one-rank
    group and no group; at the epoch's end reduces and gathers over those groups directly."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)
        self.record: dict[str, object] = {}

    def setup(self, stage: str) -> None:
        self.groups = {"world": dist.group.WORLD, "own": dist.new_subgroups_by_enumeration([[0], [1]])[0], "none": None}

    def validation_step(self, batch, batch_idx):
        for name, group in self.groups.items():
            self.log(name, float(self.global_rank + 1), sync_dist=True, sync_dist_group=group)
            self.log(f"{name}_sum", float(self.global_rank + 1), sync_dist=True, sync_dist_group=group, reduce_fx="sum")
            self.log(
                f"{name}_step",
                float(self.global_rank + 1),
                on_step=True,
                on_epoch=False,
                sync_dist=True,
                sync_dist_group=group,
                reduce_fx="max",
            )

    def on_validation_epoch_end(self) -> None:
        for name, group in self.groups.items():
            x, value = torch.tensor([self.global_rank + 1.0]), torch.tensor([self.global_rank + 1.0])
            self.record[f"reduce_{name}"] = self.trainer.strategy.reduce(x, group=group, reduce_op="sum").tolist()
            self.record[f"reduced_in_place_{name}"] = x.tolist()
            self.record[f"gather_{name}"] = self.all_gather(value, group=group).tolist()
        self.record["int_mean"] = self.trainer.strategy.reduce(torch.tensor(self.global_rank + 1)).item()
        strategy = self.trainer.strategy  # after setup: the backend in use, as Lightning's DDPStrategy reports it
        self.record["backend"] = [strategy.process_group_backend, strategy._get_process_group_backend()]


def _group_collectives(out: Path) -> None:
    """The same validation under MyDDPStrategy and then Lightning's ddp; each rank records what it got."""
    for name, strategy in (("ours", MyDDPStrategy(timeout=60)), ("lightning", "ddp")):
        model = GroupCollectives()
        trainer = quiet_trainer(2, strategy, enable_checkpointing=True)
        trainer.validate(model, DataLoader(TensorDataset(torch.zeros(8, 1)), batch_size=2))
        save(out, name, {**model.record, **{k: v.item() for k, v in trainer.callback_metrics.items()}})


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_collectives_over_a_group_give_lightnings_values(tmp_path):
    """self.log(sync_dist=True, sync_dist_group=g), strategy.reduce(x, group=g) and all_gather(x, group=g) for g =
    WORLD, a one-rank subgroup and None give Lightning's ddp values: the world's for WORLD and None, the rank's own for
    its subgroup; reduce works in place, as Lightning's. The one difference: an integer mean is exact (1.5, not 1)."""
    launch(_group_collectives, 2, tmp_path)
    ours, lightning = load(tmp_path, "ours", 2), load(tmp_path, "lightning", 2)
    assert [r.pop("int_mean") for r in ours] == [1.5, 1.5] and [r.pop("int_mean") for r in lightning] == [1, 1]
    assert ours == lightning
    for rank, got in enumerate(ours):
        assert got["world"] == got["none"] == 1.5 and got["own"] == rank + 1
        assert got["world_sum"] == got["none_sum"] == 6 and got["own_sum"] == 2 * (rank + 1)
        assert got["reduce_world"] == got["reduced_in_place_world"] == got["reduce_none"] == [3.0]
        assert got["reduce_own"] == got["reduced_in_place_own"] == [rank + 1.0]
        assert got["gather_world"] == got["gather_none"] == [[1.0], [2.0]] and got["gather_own"] == [[rank + 1.0]]
        assert got["backend"] == ["gloo", "gloo"]


# ------------------------------------------------------------------------------- two-process fits
SEED = 123
EPOCHS = 2


def _recorded_fit(out_dir: str, strategy: MyDDPStrategy) -> None:
    """Fit the recording model on 2 ranks; each rank saves its record as ``out_dir/rank{r}.pt``."""
    pl.seed_everything(SEED)
    model = RecordingClassifier(out_dir=out_dir)
    trainer = quiet_trainer(2, strategy, max_epochs=EPOCHS, default_root_dir=out_dir)
    trainer.fit(model, IndexedDigits(batch_size=32))


def _kit_rank(rank: int, world_size: int, out_dir: str) -> None:
    """One rank of the kit-started fit: the Trainer finds the kit's launch environment and joins, as under torchrun."""
    _recorded_fit(out_dir, MyDDPStrategy(timeout=60))


@pytest.fixture(scope="module")
def fits(tmp_path_factory) -> tuple[list[dict], list[dict]]:
    """Two 2-rank fits with the same seed: one started by the strategy's spawn launcher from this process, one
    by the testing kit (ranks forked from a warm parent, ``Trainer`` joining their environment). Determinism is
    checked across the two ways of starting the ranks; shards, gradients and weights on the spawned one."""
    spawned, kit = tmp_path_factory.mktemp("spawned"), tmp_path_factory.mktemp("kit")
    _recorded_fit(str(spawned), MyDDPStrategy(start_method="spawn", timeout=60))
    run_on_ranks(_kit_rank, 2, args=(str(kit),), init_process_group=False, timeout_s=240)
    return load_ranks(spawned, 2), load_ranks(kit, 2)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_ranks_see_disjoint_shards_covering_the_training_set(fits):
    """In every epoch the two ranks' indices are disjoint and together cover all 1,438 training samples."""
    run, _ = fits
    n = 1438
    for epoch in range(EPOCHS):
        r0, r1 = run[0]["seen"][epoch], run[1]["seen"][epoch]
        assert len(r0) == len(r1) == n // 2
        assert set(r0).isdisjoint(r1)
        assert set(r0) | set(r1) == set(range(n))


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_order_changes_between_epochs_and_repeats_with_the_same_seed(fits):
    """set_epoch is called for the user: epoch 1's order differs from epoch 0's, and a rerun started another way
    (the testing kit instead of spawn) repeats both, and ends with the same weights."""
    run_a, run_b = fits
    for rank in range(2):
        assert run_a[rank]["seen"][0] != run_a[rank]["seen"][1]
        assert set(run_a[rank]["seen"][0]) != set(run_a[rank]["seen"][1])  # reshuffled across ranks, too
        assert run_a[rank]["seen"] == run_b[rank]["seen"]
        for name, value in run_a[rank]["final"].items():
            torch.testing.assert_close(run_b[rank]["final"][name], value, rtol=0, atol=1e-6)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_ddp_gradient_equals_single_process_gradient_on_the_union_of_batches(fits):
    """After the first backward, each rank's gradient equals one process's gradient on both ranks' batches."""
    run, _ = fits
    for name in run[0]["initial"]:
        torch.testing.assert_close(run[0]["initial"][name], run[1]["initial"][name], rtol=0, atol=0)
    dm = IndexedDigits(batch_size=32)
    dm.setup("fit")
    x, y, _ = dm.train_set.tensors
    union = torch.tensor(run[0]["first_batch"] + run[1]["first_batch"])
    assert len(union) == 64
    net = DigitsNet()
    net.load_state_dict(run[0]["initial"])
    F.cross_entropy(net(x[union]), y[union]).backward()
    for name, param in net.named_parameters():
        for rank in range(2):
            torch.testing.assert_close(run[rank]["first_grads"][name], param.grad, rtol=0, atol=1e-6)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_ranks_end_with_identical_weights(fits):
    """Every rank applied the same updates: the final weights are bit-identical and differ from the start."""
    run, _ = fits
    for name, value in run[0]["final"].items():
        assert torch.equal(value, run[1]["final"][name])
    assert not torch.equal(run[0]["final"]["layers.0.weight"], run[0]["initial"]["layers.0.weight"])
