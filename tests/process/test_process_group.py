"""Backend choice, timeouts, and the collectives the strategy uses (real gloo groups for the latter)."""

from __future__ import annotations

import copy
import ipaddress
import itertools
import os
import socket
from datetime import timedelta

import psutil
import pytest
import torch
import torch.distributed as dist
from ddp_testing import Regressor, error_of, free_port, listening_sockets, loader, one_rank_trainer, quiet_trainer
from lightning.pytorch.strategies import DDPStrategy

from ddp_strategy import MyDDPStrategy
from ddp_strategy.process import failures
from ddp_strategy.process import group as process_group


def test_backend_follows_device():
    """nccl for CUDA devices, gloo for CPU; explicit choices are honoured."""
    assert process_group.resolve_backend(torch.device("cuda", 1), None) == "nccl"
    assert process_group.resolve_backend(torch.device("cpu"), None) == "gloo"
    assert process_group.resolve_backend(torch.device("cuda", 0), "gloo") == "gloo"


def _gloo_backend(store, rank, size, timeout):
    """A backend for ``Backend.register_backend``: gloo under another name."""
    return dist.ProcessGroupGloo(store, rank, size, timeout)


def test_an_unknown_backend_fails_at_setup_and_one_registered_after_the_trainer_trains(monkeypatch, tmp_path):
    """Side by side with strategy="ddp" (DDPStrategy): process_group_backend='glooo' builds the strategy and the
    Trainer and fails at fit's setup (torch's AssertionError there, our ValueError naming the known names); a name
    registered with torch.distributed.Backend.register_backend after the Trainer is built trains, on that backend."""
    for attribute in (
        "backend_list",
        "_plugins",
        "backend_capability",
        "backend_type_map",
        "default_device_backend_map",
    ):
        monkeypatch.setattr(dist.Backend, attribute, copy.copy(getattr(dist.Backend, attribute)))  # undone at the end
    monkeypatch.setattr(dist.Backend, "LATEBACKEND", "latebackend", raising=False)  # as register_backend sets it
    errors = {}
    for name, build in (("ddp", DDPStrategy), ("ours", MyDDPStrategy)):
        unknown = one_rank_trainer(tmp_path, build(process_group_backend="glooo"), max_steps=1)  # built, no error
        with pytest.raises((AssertionError, ValueError)) as raised:
            unknown.fit(Regressor(), loader())
        errors[name] = raised.type
        late = one_rank_trainer(tmp_path, build(process_group_backend="latebackend"), max_steps=2)
        if "latebackend" not in dist.Backend.backend_list:
            dist.Backend.register_backend("latebackend", _gloo_backend, devices=["cpu"])
        late.fit(Regressor(), loader())
        assert (late.global_step, dist.get_backend()) == (2, "latebackend"), name
        dist.destroy_process_group()
    assert errors == {"ddp": AssertionError, "ours": ValueError}


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
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(process_group, "_tcp_store", lambda *a, **k: stores.append(a) or dist.HashStore())
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: calls.update(args=a, kwargs=k))
    process_group.init_process_group("nccl", 1, 2, "127.0.0.1", 29512, timedelta(seconds=9), torch.device("cuda", 1))
    assert stores == [("127.0.0.1", 29512, 1, timedelta(seconds=9), 1)]
    assert calls["args"] == ("nccl",)
    assert isinstance(calls["kwargs"].pop("store"), dist.PrefixStore)  # our store, under the group's prefix
    assert calls["kwargs"] == {
        "init_method": None,
        "rank": 1,
        "world_size": 2,
        "timeout": timedelta(seconds=9),
        "device_id": torch.device("cuda", 1),
    }
    process_group.init_process_group("gloo", 0, 2, "127.0.0.1", 29512, timedelta(seconds=9), torch.device("cpu"))
    assert calls["kwargs"]["device_id"] is None and stores[-1][2] == 0  # no eager device on CPU


def test_destroy_without_group_is_a_no_op():
    """Teardown may call destroy on a rank that never joined."""
    assert failures.destroy_process_group()
    assert not dist.is_initialized()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_nccl_group_on_a_real_gpu(tmp_path):
    """With a GPU: a 1-rank NCCL group with eager init all-reduces a CUDA tensor."""
    process_group.init_process_group(
        "nccl", 0, 1, "127.0.0.1", free_port(), timedelta(seconds=60), torch.device("cuda", 0)
    )
    assert dist.get_backend() == "nccl"
    out = torch.ones(3, device="cuda")
    dist.all_reduce(out)
    assert out.device.type == "cuda" and out.tolist() == [1.0, 1.0, 1.0]
    failures.destroy_process_group()


def test_each_run_reports_under_its_own_prefix_of_the_groups_store(monkeypatch):
    """Runs that reuse one group (2 ranks x 2 stages) get prefixes 0, 0, 1, 1; a torchrun attempt starts anew."""
    base = dist.HashStore()
    monkeypatch.setattr(failures._torch, "default_store", lambda: base)
    for rank in (0, 1, 0, 1):
        failures.run_reports(rank, world_size=2).set("k", "x")
    assert base.check([f"ddp_strategy/0/2/run_{g}/{key}" for g in (0, 1) for key in ("k", "pid/0", "pid/1")])
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    failures.run_reports(0, world_size=1).set("k", "y")
    assert base.get("ddp_strategy/1/1/run_0/k") == b"y"


def test_store_listens_on_loopback_on_one_node_and_on_master_addr_otherwise(caplog):
    """Rank 0's store on one node: 127.0.0.1 whatever MASTER_ADDR is; on several: the address MASTER_ADDR resolves to
    (this machine's, when it has one beside loopback), or every interface and a warning naming why (a loopback
    address: no other node reaches it)."""
    here = [
        a.address
        for addresses in psutil.net_if_addrs().values()
        for a in addresses
        if a.family == socket.AF_INET and not ipaddress.ip_address(a.address).is_loopback
    ]
    cases = [("198.51.100.7", 1, ["127.0.0.1"], None), ("localhost", 2, ["::"], "resolves to the loopback address")]
    cases += [(ip, 2, [ip], None) for ip in here[:1]]
    for host, num_nodes, listens, warning in cases:
        caplog.clear()
        port = free_port()
        store = process_group._tcp_store(host, port, 0, timedelta(seconds=30), num_nodes)
        listening = [address for address, p in listening_sockets(os.getpid()) if p == port]
        assert listening == listens or (listens == ["::"] and listening == ["0.0.0.0"]), (host, num_nodes, listening)
        if warning:
            assert warning in caplog.text, (host, num_nodes)
        else:
            assert "every interface" not in caplog.text, (host, num_nodes)
        del store


def test_on_several_nodes_a_loopback_master_addr_makes_the_store_listen_everywhere(caplog):
    """num_nodes=2, MASTER_ADDR=127.0.0.1 (no other node could reach it): all interfaces, a warning; ranks join."""
    port = free_port()
    server = process_group._tcp_store("127.0.0.1", port, 0, timedelta(seconds=30), num_nodes=2)
    client = process_group._tcp_store("127.0.0.1", port, 1, timedelta(seconds=30), num_nodes=2)
    client.set("k", "v")
    assert server.get("k") == b"v"
    assert "listens on every interface" in caplog.text
    assert [a for a, p in listening_sockets(os.getpid()) if p == port] in (["::"], ["0.0.0.0"])


def test_the_group_is_reused_and_destroying_it_closes_rank_0s_store_and_gloo_sockets():
    """Rank 0's store listens on 127.0.0.1 only, at MASTER_PORT, while the group lives; a second join reuses the
    group (a run in the same process); one with another world size is refused; nothing listens after destroy."""
    port = free_port()
    process_group.init_process_group("gloo", 0, 1, "127.0.0.1", port, timedelta(seconds=30))
    world = dist.group.WORLD
    process_group.init_process_group("gloo", 0, 1, "127.0.0.1", free_port(), timedelta(seconds=30))
    assert dist.group.WORLD is world
    with pytest.raises(RuntimeError, match="already exists with rank 0 of 1, but this run needs rank 0 of 2"):
        process_group.init_process_group("gloo", 0, 2, "127.0.0.1", port, timedelta(seconds=30))
    assert [address for address, p in listening_sockets(os.getpid()) if p == port] == ["127.0.0.1"]
    del world
    assert failures.destroy_process_group()
    assert listening_sockets(os.getpid()) == []


def test_under_torchrun_env_rendezvous_uses_the_agents_store(monkeypatch):
    """TORCHELASTIC_USE_AGENT_STORE=True: init_method None or 'env://' joins the agent's store as a client, prefixed
    per attempt and per group."""
    agent = dist.TCPStore("127.0.0.1", 0, None, is_master=True, timeout=timedelta(seconds=30), wait_for_workers=False)
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    served = []
    monkeypatch.setattr(process_group, "_tcp_store", lambda *a, **k: served.append(a))
    for init_method in (None, "env://"):
        process_group.init_process_group(
            "gloo", 0, 1, "127.0.0.1", agent.port, timedelta(seconds=30), init_method=init_method
        )
        failures.run_reports(0, 1).set("mine", "1")
        failures.destroy_process_group()
    assert served == []  # no store of our own next to the agent's
    # each group under its own prefix in the attempt's (its gloo addresses are never read by a later group)
    assert agent.check([f"ddp_strategy/2/1/group_{g}/0//ddp_strategy/2/1/run_0/mine" for g in (0, 1)])


def _refit_after_a_failed_fit(rank: int, world_size: int) -> tuple[float, list[float]]:
    """A fit that fails on every rank (3 and 2 batches), then a new Trainer's fit: rank 1 starts at once; rank 0
    holds the failed run's exception (its traceback holds the group's store) for 2 s, lets it go, then starts."""
    import time

    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    from ddp_strategy import MyDDPStrategy

    class Linear(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            return self.net(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    def fit(samples: int) -> Linear:
        model = Linear()
        quiet_trainer(world_size, MyDDPStrategy(timeout=30), max_epochs=1, use_distributed_sampler=False).fit(
            model,
            DataLoader(
                TensorDataset(torch.randn(samples, 4, generator=torch.Generator().manual_seed(rank))), batch_size=2
            ),
        )
        return model

    held = []
    try:
        fit(6 if rank == 0 else 4)
    except ValueError as error:
        held.append(error)  # as a logger or a notebook's last traceback would
    if rank == 0:
        time.sleep(2)
        held.clear()  # the traceback, and with it the failed run's store, is let go while rank 1 waits in it
    start = time.monotonic()
    model = fit(4)
    return time.monotonic() - start, [p.detach().sum().item() for p in model.parameters()]


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_new_fit_after_a_failed_one_rejoins_at_once_while_the_failed_runs_store_is_held():
    """After a fit failed on every rank, the next fit in the same processes rejoins the failed run's store (kept
    by failures.teardown) within seconds and both ranks train the same weights. Before, rank 1, first back, joined
    the old store that rank 0's exception still held, which closed under it when rank 0 let the exception go: both
    ranks waited out the timeout (3 of 3 runs failed)."""
    from ddp_strategy.testing import run_on_ranks

    (seconds_0, weights_0), (seconds_1, weights_1) = run_on_ranks(
        _refit_after_a_failed_fit, 2, init_process_group=False, timeout_s=90
    )
    assert weights_0 == weights_1
    assert seconds_1 < 15, f"rank 1's refit took {seconds_1:.1f} s"


class _Probe(Regressor):
    """Records GLOO_SOCKET_IFNAME as a training step sees it; with ``fail``, raises in its first step."""

    def __init__(self, fail: bool = False) -> None:
        super().__init__()
        self.fail, self.ifname = fail, "unseen"

    def training_step(self, batch, batch_idx):
        self.ifname = os.environ.get("GLOO_SOCKET_IFNAME")
        if self.fail:
            raise ZeroDivisionError("a step fails on purpose")
        return super().training_step(batch, batch_idx)


def test_a_fit_leaves_the_environment_as_lightnings_ddp_leaves_it_on_every_path(tmp_path, caplog):
    """From the same environment, a successful and a failing fit under strategy="ddp" and MyDDPStrategy() change
    os.environ alike (Lightning's launch variables only): GLOO_SOCKET_IFNAME=lo holds while our run lasts and is
    gone after it; a GLOO_SOCKET_IFNAME the user set stays, unchanged. (Two-process jobs, the launching process
    included: tests/process/test_failures.py.)"""
    initial, changes, seen = dict(os.environ), {}, {}
    for name, outcome in itertools.product(("ddp", "ours"), ("fit", "failed")):
        if outcome == "fit":  # each strategy from the same environment (Lightning's launcher sets it on first use)
            os.environ.clear()
            os.environ.update(initial)
        before, model = dict(os.environ), _Probe(fail=outcome == "failed")
        trainer = one_rank_trainer(tmp_path, None if name == "ours" else "ddp", max_steps=2)
        if outcome == "fit":
            trainer.fit(model, loader())
        else:
            assert error_of(lambda t=trainer, m=model: t.fit(m, loader()), caplog).startswith("ZeroDivisionError")
        changes[name, outcome] = {k for k in {**before, **os.environ} if before.get(k) != os.environ.get(k)}
        seen[name, outcome] = model.ifname
    assert (
        changes["ours", "fit"]
        == changes["ddp", "fit"]
        <= {"MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK"} | {"WORLD_SIZE", "OMP_NUM_THREADS"}
    )
    assert changes["ours", "failed"] == changes["ddp", "failed"] == set()
    assert seen == {("ddp", "fit"): None, ("ddp", "failed"): None, ("ours", "fit"): "lo", ("ours", "failed"): "lo"}
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # the user's
    one_rank_trainer(tmp_path, max_steps=1).fit(_Probe(), loader())
    assert os.environ["GLOO_SOCKET_IFNAME"] == "lo"
