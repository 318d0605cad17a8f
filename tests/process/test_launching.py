"""Starting and joining DDP: init methods, external launchers, two nodes over loopback, teardown, bad input."""

from __future__ import annotations

import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from ddp_testing import (
    IndexedDigits,
    RecordingClassifier,
    finish,
    free_port,
    load_ranks,
    quiet_trainer,
    session_members,
    start_session,
)
from lightning.fabric.plugins.environments import ClusterEnvironment
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from ddp_strategy import DigitsClassifier, DigitsDataModule, MyDDPStrategy
from ddp_strategy.process import failures
from ddp_strategy.process import group as process_group

SCRIPTS = Path(__file__).parent.parent / "scripts"
TEARDOWN_LOOPS = int(os.environ.get("DDP_TEARDOWN_LOOPS", "30"))


def _init_methods_worker(rank: int, tmp: str, ports: list[int]) -> None:
    methods = {
        "env": {"init_method": None, "main_port": ports[0]},
        "tcp": {"init_method": f"tcp://127.0.0.1:{ports[1]}"},
        "file": {"init_method": f"file://{tmp}/rendezvous"},
        "store": {"store": dist.FileStore(f"{tmp}/store", 2)},
    }
    results = {}
    for name, kwargs in methods.items():
        kwargs.setdefault("main_port", 0)
        process_group.init_process_group("gloo", rank, 2, "127.0.0.1", timeout=timedelta(seconds=30), **kwargs)
        total = torch.tensor([rank + 1.0])
        dist.all_reduce(total)
        results[name] = (dist.get_rank(), dist.get_world_size(), total.item())
        failures.destroy_process_group()
    torch.save(results, Path(tmp) / f"{rank}.pt")


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_env_tcp_file_and_store_rendezvous_all_work(tmp_path):
    """Two real ranks join by env://, tcp://, file:// and a FileStore in turn; each group all-reduces 1+2=3."""
    mp.start_processes(
        _init_methods_worker, args=(str(tmp_path), [free_port(), free_port()]), nprocs=2, start_method="spawn"
    )
    for rank in range(2):
        results = torch.load(tmp_path / f"{rank}.pt")
        assert results == {m: (rank, 2, 3.0) for m in ("env", "tcp", "file", "store")}


@pytest.mark.timeout(60)
def test_unreachable_main_address_fails_within_the_timeout_and_names_it():
    """A rank whose rendezvous address has no listener fails after the configured timeout, naming the address."""
    port = free_port()
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=rf"\[rank 1\] could not join the process group at 127.0.0.1:{port}"):
        process_group.init_process_group("gloo", 1, 2, "127.0.0.1", port, timeout=timedelta(seconds=3))
    assert time.monotonic() - start < 30


def _torchrun_env(monkeypatch, world_size: int, rank: int, local_rank: int = 0) -> None:
    for key, value in {
        "TORCHELASTIC_RUN_ID": "test",
        "WORLD_SIZE": world_size,
        "RANK": rank,
        "LOCAL_RANK": local_rank,
        "GROUP_RANK": 0,
        "LOCAL_WORLD_SIZE": 1,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": free_port(),
    }.items():
        monkeypatch.setenv(key, str(value))


@pytest.mark.parametrize(
    ("world", "rank", "local", "num_nodes", "message"),
    [
        (2, 0, 0, 1, r"TorchElasticEnvironment reports WORLD_SIZE=2, but Trainer\(num_nodes=1, devices=1\) expects 1"),
        (4, 0, 0, 2, r"WORLD_SIZE=4, but Trainer\(num_nodes=2, devices=1\) expects 2"),
        (2, 5, 0, 2, r"RANK=5, outside \[0, WORLD_SIZE=2\)"),
        (2, 1, 3, 2, r"LOCAL_RANK=3, but Trainer\(devices=1\)"),
    ],
)
def test_inconsistent_launcher_variables_fail_before_joining(monkeypatch, world, rank, local, num_nodes, message):
    """torchrun variables that disagree with the Trainer fail on every rank before the rendezvous."""
    _torchrun_env(monkeypatch, world, rank, local)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, num_nodes=num_nodes, strategy=MyDDPStrategy(timeout=5), logger=False
    )
    with pytest.raises(ValueError, match=message):
        trainer.strategy.setup_environment()
    assert not dist.is_initialized()


def test_external_launchers_are_detected_by_lightnings_cluster_environments(monkeypatch):
    """Under torchrun the strategy joins (no launch): Lightning's TorchElasticEnvironment supplies the ranks."""
    _torchrun_env(monkeypatch, world_size=2, rank=1)
    trainer = pl.Trainer(accelerator="cpu", devices=1, num_nodes=2, strategy=MyDDPStrategy(), logger=False)
    s = trainer.strategy
    assert type(s.cluster_environment).__name__ == "TorchElasticEnvironment"
    assert s.cluster_environment.creates_processes_externally
    assert (s.global_rank, s.world_size, s.local_rank) == (1, 2, 0)


def test_device_counts_at_trainer_construction(recwarn):
    """devices=0 fails before any process starts (Lightning's check); more CPU processes than cores only warns,
    and allow_cpu_oversubscription=True silences the warning."""
    with pytest.raises(MisconfigurationException, match="`devices` can not be 0|devices=0"):
        pl.Trainer(accelerator="cpu", devices=0, strategy=MyDDPStrategy(), logger=False)
    too_many = os.cpu_count() * 4
    with pytest.warns(UserWarning, match=rf"Trainer\(devices={too_many}\) on CPU starts {too_many} processes, but"):
        trainer = pl.Trainer(accelerator="cpu", devices=too_many, strategy=MyDDPStrategy(), logger=False)
    assert trainer.strategy.num_processes == too_many
    recwarn.clear()
    trainer = pl.Trainer(
        accelerator="cpu", devices=too_many, logger=False, strategy=MyDDPStrategy(allow_cpu_oversubscription=True)
    )
    assert trainer.strategy.num_processes == too_many
    assert not [w for w in recwarn if "CPU cores are available" in str(w.message)]


def test_nccl_on_cpu_fails_before_any_process_starts():
    """process_group_backend='nccl' with CPU devices is refused at construction (CPU-only torch) or in Trainer()."""
    with pytest.raises(ValueError, match="nccl"):
        pl.Trainer(accelerator="cpu", devices=2, strategy=MyDDPStrategy(process_group_backend="nccl"), logger=False)


@pytest.mark.timeout(120)
def test_spawn_with_an_unpicklable_model_says_so_plainly():
    """A model class defined inside a function cannot go to spawned ranks: a plain error, no processes left."""

    class LocalModel(DigitsClassifier):
        pass

    trainer = quiet_trainer(2, MyDDPStrategy(start_method="spawn"), enable_checkpointing=True, max_steps=1)
    with pytest.raises(RuntimeError, match="start_method='spawn' must pickle LocalModel .* module level"):
        trainer.fit(LocalModel(), DigitsDataModule())


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_two_torchrun_nodes_rendezvous_over_loopback_and_train_together(tmp_path):
    """Two `torchrun --nnodes=2` invocations fit together: ranks, node ranks, node groups, identical weights."""
    port = free_port()
    procs = [
        start_session(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes=2",
                "--nproc-per-node=1",
                f"--node-rank={node}",
                "--master-addr=127.0.0.1",
                f"--master-port={port}",
                str(SCRIPTS / "fit_once.py"),
                str(tmp_path),
                "torchrun",
            ]
        )
        for node in range(2)
    ]
    for proc in procs:
        code, out = finish(proc, timeout=200)
        assert code == 0, out[-3000:]
        assert "failed to bind" not in out  # the workers use the agents' store instead of starting their own
    ranks = load_ranks(tmp_path, 2)
    for r, seen in enumerate(ranks):
        assert seen["env"] == "TorchElasticEnvironment"
        assert (seen["world_size"], seen["global_rank"], seen["node_rank"], seen["local_rank"]) == (2, r, r, 0)
        assert seen["node_ranks"] == [r] and seen["node_group_size"] == 1
        assert seen["rank_zero_only"] == r and seen["backend"] == "gloo"
    for name, value in ranks[0]["final"].items():
        assert torch.equal(value, ranks[1]["final"][name])


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_a_popen_fit_leaves_no_thread_or_process_group_behind(tmp_path):
    """The same 2-process popen fit under MyDDPStrategy and strategy="ddp": after trainer.fit returns, Lightning's
    own test suite's check (stop each new daemon thread that has a ``stop``, then it must be gone; join Lightning's
    observer for up to 10 s) finds no thread left in the launching process (until 2026-12-06 the Supervisor's
    ``stop`` returned while its thread slept on in its 5 s poll), and both exit 0. At the interpreter's exit ours has
    destroyed the gloo group on both ranks (its atexit hook), where ddp leaves it to finalisation, whose gloo worker
    thread aborted 3 of 128 stream fits natively ("terminate called without an active exception", issue 51 item 6:
    too rare to show by exit codes here, so the group's state at exit is what is asserted)."""
    runs = {}
    for mode in ("ours", "ddp"):
        (tmp_path / mode).mkdir()
        runs[mode] = start_session([sys.executable, str(SCRIPTS / "fit_once.py"), str(tmp_path / mode), mode])
    for mode, proc in runs.items():
        code, out = finish(proc, 200)
        assert code == 0, out[-3000:]
        assert [rank["leaked"] for rank in load_ranks(tmp_path / mode, 2)] == [[], []], mode
        at_exit = [(tmp_path / mode / f"exit{rank}.txt").read_text() for rank in range(2)]
        assert at_exit == (["False", "False"] if mode == "ours" else ["True", "True"]), mode


@pytest.mark.multiprocess
@pytest.mark.soak
@pytest.mark.timeout(900)
def test_repeated_popen_fits_never_abort_at_exit(tmp_path):
    """30 two-process fits with the default popen launcher: every process exits 0 (no SIGABRT at gloo teardown)."""
    for i in range(TEARDOWN_LOOPS):
        out_dir = tmp_path / str(i)
        out_dir.mkdir()
        proc = start_session([sys.executable, str(SCRIPTS / "fit_once.py"), str(out_dir)], cwd=tmp_path)
        code, out = finish(proc, 120)
        assert code == 0, f"run {i} exited with {code}:\n{out[-3000:]}"
        assert session_members(proc.pid) == [], "rank 1 outlived the launching process"
        assert "Abort" not in out and "core dumped" not in out
        r0, r1 = load_ranks(out_dir, 2)
        assert (r0["world_size"], r0["node_ranks"], r1["node_ranks"]) == (2, [0, 1], [0, 1])
        assert all(torch.equal(v, r1["final"][k]) for k, v in r0["final"].items())


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_second_fit_in_the_same_process_works_with_fork(tmp_path):
    """As in a notebook: two fits in one Python process (fork start method, a new Trainer each) both train."""
    model = DigitsClassifier()
    weights = [model.model.layers[0].weight.detach().clone()]
    for _ in range(2):
        trainer = quiet_trainer(
            2,
            MyDDPStrategy(start_method="fork", timeout=60),
            max_steps=3,
            limit_val_batches=1,
            default_root_dir=str(tmp_path),
        )
        trainer.fit(model, DigitsDataModule())
        weights.append(model.model.layers[0].weight.detach().clone())
        assert trainer.state.finished  # rank 0's weights come back to this process after each fit
    assert not torch.equal(weights[0], weights[1]) and not torch.equal(weights[1], weights[2])
    assert not dist.is_initialized()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.timeout(300)
def test_fit_on_cuda_uses_nccl(tmp_path):
    """With a GPU: the strategy picks nccl, wraps with device_ids, and the digits model trains."""
    trainer = pl.Trainer(
        accelerator="cuda",
        devices=1,
        strategy=MyDDPStrategy(start_method="spawn", timeout=120),
        max_epochs=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        default_root_dir=str(tmp_path),
    )
    model = DigitsClassifier()
    trainer.fit(model, DigitsDataModule())
    assert trainer.callback_metrics["val_acc"] > 0.9


class OwnWorld(ClusterEnvironment):
    """A user's environment that owns the world, as Ray's ``RayLightningEnvironment`` does: rank and world size from
    its own variables (``MY_RANK``, ``MY_WORLD``, ``MY_PORT``), each process alone on its "node", and Lightning's
    ``set_world_size``/``set_global_rank`` ignored."""

    creates_processes_externally = True
    main_address = "127.0.0.1"

    @property
    def main_port(self) -> int:
        return int(os.environ["MY_PORT"])

    @staticmethod
    def detect() -> bool:
        return True

    def world_size(self) -> int:
        return int(os.environ["MY_WORLD"])

    def set_world_size(self, size: int) -> None:
        pass

    def global_rank(self) -> int:
        return int(os.environ["MY_RANK"])

    def set_global_rank(self, rank: int) -> None:
        pass

    def local_rank(self) -> int:
        return 0

    def node_rank(self) -> int:
        return self.global_rank()


def _fit_recorded(tmp: str, strategy, **kwargs) -> dict:
    """Fit RecordingClassifier for 3 steps on IndexedDigits (one process's part); return its record."""
    pl.seed_everything(7)
    model = RecordingClassifier(tmp)
    quiet_trainer(strategy=strategy, max_steps=3, limit_val_batches=0, **kwargs).fit(model, IndexedDigits())
    return {key: model.record[key] for key in ("seen", "final", "world_size")}


def _worlds_not_made_by_the_strategy(rank: int, world_size: int, tmp: str, ports: list[int]) -> dict:
    """Per rank: fits in a world OwnWorld owns (ours: Trainer(devices=1); ddp needs num_nodes=2 for its sampler),
    then fits in a process group the user made before fit (a FileStore, a 50 s timeout)."""
    os.environ.update(MY_RANK=str(rank), MY_WORLD=str(world_size))
    owned = {}
    runs = (("ours", MyDDPStrategy(timeout=30), 1), ("ddp", "ddp", 2))
    for (name, strategy, num_nodes), port in zip(runs, ports, strict=True):
        os.environ["MY_PORT"] = str(port)
        owned[name] = _fit_recorded(tmp, strategy, devices=1, num_nodes=num_nodes, plugins=[OwnWorld()])
        failures.destroy_process_group()  # the next one makes its own
    store = dist.FileStore(f"{tmp}/store", world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=50))
    world, made = dist.group.WORLD, {}
    for name, strategy in (("ddp", "ddp"), ("ours", MyDDPStrategy(timeout=30))):
        made[name] = _fit_recorded(tmp, strategy, devices=world_size)
        made[name]["kept"] = dist.is_initialized() and dist.group.WORLD is world and dist.get_backend() == "gloo"
    total = torch.tensor([rank + 1.0])
    dist.all_reduce(total)  # the user's group still works after both fits
    return {"owned": owned, "made": made, "total": total.item()}


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_an_environment_owning_the_world_and_a_users_process_group_are_used_as_they_are(tmp_path):
    """A user's ClusterEnvironment that owns a world of 2 (Trainer(devices=1), no num_nodes) is trusted as Lightning
    trusts it: both ranks train on disjoint shards to the weights and batches of ddp's fit there; a process group the
    user made before fit is used and left alive by both strategies, with equal weights. 2 ranks started here."""
    from ddp_strategy.testing import run_on_ranks

    ranks = run_on_ranks(
        _worlds_not_made_by_the_strategy,
        2,
        args=(str(tmp_path), [free_port(), free_port()]),
        init_process_group=False,
        timeout_s=200,
    )
    for kind in ("owned", "made"):
        for rank in ranks:
            ours, ddp = rank[kind]["ours"], rank[kind]["ddp"]
            assert ours["world_size"] == ddp["world_size"] == 2
            assert ours["seen"] == ddp["seen"]
            assert all(torch.equal(ours["final"][k], ddp["final"][k]) for k in ddp["final"])
            assert all(torch.equal(ours["final"][k], ranks[0][kind]["ours"]["final"][k]) for k in ddp["final"])
            assert rank["made"]["ours"]["kept"] and rank["made"]["ddp"]["kept"] and rank["total"] == 3.0
        shards = [set(rank[kind]["ours"]["seen"][0]) for rank in ranks]
        assert shards[0] and not shards[0] & shards[1]
