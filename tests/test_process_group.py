"""Backend choice, timeouts, and the collectives the strategy uses (real gloo groups for the latter)."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from ddp_testing import free_port

from ddp_strategy import process_group


def test_backend_follows_device():
    """nccl for CUDA devices, gloo for CPU; explicit choices are honoured."""
    assert process_group.resolve_backend(torch.device("cuda", 1), None) == "nccl"
    assert process_group.resolve_backend(torch.device("cpu"), None) == "gloo"
    assert process_group.resolve_backend(torch.device("cuda", 0), "gloo") == "gloo"


@pytest.mark.parametrize(
    ("backend", "device", "message"),
    [
        ("nccl", torch.device("cpu"), "process_group_backend='nccl' needs CUDA devices"),
        ("glooo", torch.device("cpu"), "Unknown process_group_backend='glooo'"),
    ],
)
def test_impossible_backends_are_refused(backend, device, message):
    """nccl on CPU and unknown names raise ValueError with what to do instead."""
    with pytest.raises(ValueError, match=message):
        process_group.resolve_backend(device, backend)


@pytest.mark.parametrize(("given", "seconds"), [(90, 90.0), (0.5, 0.5), (timedelta(minutes=2), 120.0)])
def test_timeout_accepts_seconds_or_timedelta(given, seconds):
    """Timeouts are seconds or a timedelta."""
    assert process_group.as_timedelta(given).total_seconds() == seconds


@pytest.mark.parametrize(("given", "error"), [(0, ValueError), (-3, ValueError), ("60", TypeError), (True, TypeError)])
def test_bad_timeouts_are_refused(given, error):
    """Zero, negative and non-numeric timeouts raise."""
    with pytest.raises(error, match="timeout"):
        process_group.as_timedelta(given)


def test_cuda_device_is_passed_for_eager_nccl_init(monkeypatch):
    """On CUDA the device reaches init_process_group as device_id (checked without a GPU), with our own store."""
    calls, stores = {}, []

    class FakeStore:
        def __init__(self, *a, **k):
            stores.append((a, k))
            self.keys: set[str] = set()

        def check(self, keys):
            return all(k in self.keys for k in keys)

        def set(self, key, value):
            self.keys.add(key)

    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "TCPStore", FakeStore)
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: calls.update(args=a, kwargs=k))
    returned = process_group.init_process_group("nccl", 1, 2, "127.0.0.1", 29512, timedelta(seconds=9),
                                                torch.device("cuda", 1))
    assert isinstance(returned, FakeStore) and returned.keys == {"ddp_strategy/joined/1"}
    assert stores == [(("127.0.0.1", 29512, 2), {"is_master": False, "timeout": timedelta(seconds=9)})]
    assert calls["args"] == ("nccl",)
    assert calls["kwargs"] == {"store": returned, "rank": 1, "world_size": 2, "timeout": timedelta(seconds=9),
                               "device_id": torch.device("cuda", 1)}
    process_group.init_process_group("gloo", 0, 2, "127.0.0.1", 29512, timedelta(seconds=9), torch.device("cpu"))
    assert "device_id" not in calls["kwargs"] and stores[-1][1]["is_master"] is True


def test_a_client_skips_the_previous_runs_store(monkeypatch):
    """A rank that reaches the next rendezvous while rank 0 still holds the previous run's store (which holds
    this rank's "joined" key) reconnects until it reaches a new store."""
    made = []

    class FakeStore:
        def __init__(self, *a, **k):
            made.append(self)
            self.keys = {"ddp_strategy/joined/1"} if len(made) < 3 else set()

        def check(self, keys):
            return all(k in self.keys for k in keys)

    monkeypatch.setattr(dist, "TCPStore", FakeStore)
    store = process_group._fresh_tcp_store("127.0.0.1", 29512, 2, 1, timedelta(seconds=9))
    assert len(made) == 3 and store is made[2]


def test_all_reduce_without_group_is_a_copy():
    """World size 1 (no process group): the result equals the input, which is not modified."""
    t = torch.tensor([1, 2])
    out = process_group.all_reduce(t, "mean")
    assert out.tolist() == [1.0, 2.0] and out.dtype == torch.float32
    with pytest.raises(ValueError, match="Unsupported reduce op"):
        process_group.all_reduce(t, "median")


def _reduce_worker(rank: int, store_path: str, out_dir: str) -> None:
    store = dist.FileStore(store_path, 2)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=30))
    t = torch.tensor([1.0, 10.0]) * (rank + 1)
    results = {op: process_group.all_reduce(t, op) for op in ("sum", "mean", "max", "min")}
    results["enum_sum"] = process_group.all_reduce(t, dist.ReduceOp.SUM)
    results["input_after"] = t
    torch.save(results, Path(out_dir) / f"{rank}.pt")
    process_group.destroy_process_group()


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_all_reduce_values_on_two_gloo_ranks(tmp_path):
    """On 2 real ranks (inputs [1,10] and [2,20]) every rank gets sum [3,30], mean [1.5,15], max, min."""
    mp.start_processes(_reduce_worker, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2, start_method="spawn")
    for rank in range(2):
        r = torch.load(tmp_path / f"{rank}.pt")
        assert r["sum"].tolist() == [3.0, 30.0] and r["enum_sum"].tolist() == [3.0, 30.0]
        assert r["mean"].tolist() == [1.5, 15.0]
        assert r["max"].tolist() == [2.0, 20.0] and r["min"].tolist() == [1.0, 10.0]
        assert r["input_after"].tolist() == [1.0 * (rank + 1), 10.0 * (rank + 1)]


def test_destroy_without_group_is_a_no_op():
    """Teardown may call destroy on a rank that never joined."""
    process_group.destroy_process_group()
    assert not dist.is_initialized()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_nccl_group_on_a_real_gpu(tmp_path):
    """With a GPU: a 1-rank NCCL group with eager init all-reduces a CUDA tensor."""
    process_group.init_process_group("nccl", 0, 1, "127.0.0.1", free_port(), timedelta(seconds=60),
                                     torch.device("cuda", 0))
    assert dist.get_backend() == "nccl"
    out = process_group.all_reduce(torch.ones(3, device="cuda"), "sum")
    assert out.device.type == "cuda" and out.tolist() == [1.0, 1.0, 1.0]
    process_group.destroy_process_group()
