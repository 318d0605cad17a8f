"""MyDDPStrategy construction, registration and Trainer wiring, in one process."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import ParallelStrategy, StrategyRegistry

from ddp_strategy import DDPCheckpointIO, MyDDPStrategy
from ddp_strategy import strategy as strategy_module


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


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"start_method": "thread"}, ValueError, "Unknown start_method='thread'"),
        ({"process_group_backend": "nccl2"}, ValueError, "Unknown process_group_backend"),
        ({"timeout": 0}, ValueError, "timeout must be positive"),
        ({"find_unused_params": True}, TypeError, "unknown DistributedDataParallel option"),
        ({"store": dist.HashStore(), "start_method": "spawn"}, ValueError,
         "store= cannot be used with start_method='spawn'"),
    ],
)
def test_bad_arguments_fail_at_construction(kwargs, error, message):
    """Mistakes are reported when the strategy is built, before any process starts."""
    with pytest.raises(error, match=message):
        MyDDPStrategy(**kwargs)


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


def test_nccl_barrier_passes_device_ids(monkeypatch):
    """On an NCCL group the barrier gets this rank's device id (checked without a GPU)."""
    import torch.distributed as dist

    calls = []
    s = MyDDPStrategy(parallel_devices=[torch.device("cuda", 0), torch.device("cuda", 1)])
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda *a: "nccl")
    monkeypatch.setattr(dist, "barrier", lambda **k: calls.append(k))
    monkeypatch.setattr(type(s), "local_rank", property(lambda self: 1))
    s.barrier()
    assert calls == [{"device_ids": [1]}]


def test_reduce_refuses_subgroups_and_passes_non_tensors():
    """reduce() only reduces over the world; non-tensors come back unchanged."""
    s = MyDDPStrategy()
    assert s.reduce(3.5) == 3.5
    with pytest.raises(ValueError, match="world process group"):
        s.reduce(torch.ones(1), group=object())
