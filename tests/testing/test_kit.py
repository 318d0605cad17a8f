"""The testing kit (ddp_strategy.testing): every rank's value comes back, failures and hangs fail with each rank's
traceback or stack and leave no process, and the checks name what differs."""

from __future__ import annotations

import os
import re
import subprocess
import time
from datetime import timedelta
from pathlib import Path

import lightning as L
import numpy as np
import psutil
import pytest
import torch
import torch.distributed as dist
from ddp_testing import quiet_trainer, state_copy
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler, TensorDataset

from ddp_strategy import MyDDPStrategy
from ddp_strategy.testing import (
    RankError,
    assert_each_sample_once,
    assert_matches_single_process,
    assert_same_on_every_rank,
    run_on_ranks,
)
from pytest_ddp_strategy import _marker_options

pytestmark = pytest.mark.multiprocess


def all_reduce_rank(rank: int, world_size: int, scale: float = 1.0) -> dict:
    """Each rank: its launch environment and the all-reduced sum of ``scale * (rank + 1)``."""
    value = torch.tensor([scale * (rank + 1)])
    dist.all_reduce(value)
    return {
        "rank": rank,
        "world_size": world_size,
        "env_rank": int(os.environ["RANK"]),
        "local_rank": int(os.environ["LOCAL_RANK"]),
        "sum": value.item(),
        "group_size": dist.get_world_size(),
    }


def fail_on_rank_1(rank: int, world_size: int) -> None:
    """Rank 1 raises before the collective; rank 0 waits in it."""
    if rank == 1:
        raise ValueError("rank 1 refuses")
    dist.barrier()


def sleep_forever_in_a_named_function(rank: int, world_size: int) -> None:
    while True:
        time.sleep(0.1)


class SquaresWithWorker(Dataset):
    """Item i is ``(i, i * i, id of the DataLoader worker that read it, that worker's parent pid)``."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> tuple[int, int, int, int]:
        return i, i * i, torch.utils.data.get_worker_info().id, os.getppid()


def read_with_two_workers(rank: int, world_size: int) -> dict:
    """Each rank reads its DistributedSampler shard through a DataLoader with two worker processes."""
    data = SquaresWithWorker()
    loader = DataLoader(data, batch_size=2, num_workers=2, sampler=DistributedSampler(data, shuffle=False))
    batches = list(loader)
    indices, squares, workers, parents = (torch.cat([b[field] for b in batches]).tolist() for field in range(4))
    return {
        "indices": indices,
        "squares": squares,
        "workers": sorted(set(workers)),
        "workers_forked_from_the_rank": set(parents) == {os.getpid()},
    }


def start_a_sleep(rank: int, world_size: int, pid_folder: str, then: str) -> int:
    """Start ``sleep 600`` and leave it running; write its pid to ``pid_folder``, then return it, raise or hang."""
    pid = subprocess.Popen(["sleep", "600"]).pid
    (Path(pid_folder) / f"sleep_{rank}.pid").write_text(str(pid))
    if then == "raise":
        raise RuntimeError(f"rank {rank} fails with its sleep running")
    while then == "hang":
        time.sleep(0.1)
    return pid


def is_gone(pid: int) -> bool:
    """The process is absent, or a zombie (dead, waiting to be reaped by init)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


class TinyRegressor(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit_tiny(rank: int, world_size: int) -> dict:
    """A 2-epoch fit with MyDDPStrategy built inside the rank; returns the weights and the group's world size."""
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(16, 4, generator=generator), torch.randn(16, 1, generator=generator))
    model = TinyRegressor()
    trainer = quiet_trainer(world_size, MyDDPStrategy(), max_epochs=2)
    trainer.fit(model, DataLoader(data, batch_size=4))
    return {
        "weights": state_copy(model),
        "group_size": dist.get_world_size(),
        "steps": trainer.global_step,
    }


def test_every_ranks_value_comes_back_in_rank_order():
    """Three ranks in one gloo group: each sees its own launch environment, and the all-reduce sums 1+2+3."""
    values = run_on_ranks(all_reduce_rank, 3, kwargs={"scale": 2.0})
    assert [v["rank"] for v in values] == [v["env_rank"] for v in values] == [0, 1, 2]
    assert [v["local_rank"] for v in values] == [0, 1, 2]
    assert [v["sum"] for v in values] == [12.0, 12.0, 12.0]
    assert {v["group_size"] for v in values} == {3} and {v["world_size"] for v in values} == {3}


def test_a_failing_rank_fails_the_call_with_its_traceback():
    """Rank 1's exception is in the error; rank 0, stuck in its barrier, is stopped (the autouse fixture checks that
    no process is left)."""
    with pytest.raises(RankError, match="rank 1 raised") as raised:
        run_on_ranks(fail_on_rank_1, 2, timeout_s=60)
    assert "ValueError: rank 1 refuses" in raised.value.reports[1]
    assert 0 in raised.value.reports  # rank 0 never finished its barrier


def test_a_hang_fails_at_the_deadline_with_each_ranks_stack():
    """A rank that never returns is stopped at the deadline and its stack names the function it hung in."""
    with pytest.raises(RankError, match="did not finish within 3 s") as raised:
        run_on_ranks(sleep_forever_in_a_named_function, 2, timeout_s=3)
    assert set(raised.value.reports) == {0, 1}
    assert all("sleep_forever_in_a_named_function" in report for report in raised.value.reports.values())


def test_a_function_that_cannot_be_pickled_is_refused_before_any_rank_starts():
    """A lambda cannot reach the ranks: TypeError saying to define it at module level."""
    with pytest.raises(TypeError, match="define the function at module level"):
        run_on_ranks(lambda rank, world_size: rank, 2)


@pytest.mark.ddp(world_size=3, timeout_s=30)
def test_the_fixture_takes_its_defaults_from_the_marker(ddp_ranks):
    """``ddp_ranks`` is run_on_ranks with the ``ddp`` marker's world size and deadline."""
    assert [v["sum"] for v in ddp_ranks(all_reduce_rank)] == [6.0, 6.0, 6.0]


@pytest.mark.ddp(3, timeout_s=30)
def test_the_marker_takes_the_world_size_as_its_positional_argument(ddp_ranks):
    """``ddp(3)`` runs 3 ranks; a world size given to the fixture's call overrides the marker's."""
    assert [v["sum"] for v in ddp_ranks(all_reduce_rank)] == [6.0, 6.0, 6.0]
    assert [v["sum"] for v in ddp_ranks(all_reduce_rank, 2)] == [3.0, 3.0]


def test_a_malformed_marker_says_how_to_write_it():
    """Two positional arguments, a world size given both ways, or an unknown option: ValueError showing the
    two forms, which both give world size 3."""
    how = r"write it as @pytest\.mark\.ddp\(3\) or @pytest\.mark\.ddp\(world_size=3"
    with pytest.raises(ValueError, match=r"at most one positional argument, the world size; got \(2, 60\): " + how):
        _marker_options(pytest.mark.ddp(2, 60).mark)
    with pytest.raises(ValueError, match=r"both as 3 and as world_size=4: " + how):
        _marker_options(pytest.mark.ddp(3, world_size=4).mark)
    with pytest.raises(ValueError, match=r"got \['worldsize'\], which run_on_ranks does not take.*'timeout_s'"):
        _marker_options(pytest.mark.ddp(worldsize=3).mark)
    assert (
        _marker_options(pytest.mark.ddp(3).mark)
        == _marker_options(pytest.mark.ddp(world_size=3).mark)
        == {"world_size": 3}
    )
    assert _marker_options(None) == {}


def test_a_rank_may_read_through_dataloader_workers():
    """Ranks are not daemonic, so a DataLoader with num_workers=2 runs in each: both workers read, each rank gets
    its DistributedSampler shard's values, and the workers fork from the rank (the caller's start method, not a
    forkserver of the rank's own)."""
    per_rank = run_on_ranks(read_with_two_workers, 2, timeout_s=60)
    assert [r["indices"] for r in per_rank] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert [r["squares"] for r in per_rank] == [[0, 4, 16, 36], [1, 9, 25, 49]]
    assert [r["workers"] for r in per_rank] == [[0, 1], [0, 1]]
    assert [r["workers_forked_from_the_rank"] for r in per_rank] == [True, True]


def test_no_process_a_rank_started_outlives_the_call(tmp_path):
    """A ``sleep 600`` each rank starts with subprocess.Popen is gone when run_on_ranks returns, when it raises
    because the ranks failed, and when it raises at the deadline."""
    pids = run_on_ranks(start_a_sleep, 2, args=(str(tmp_path), "return"))
    assert sorted(int(p.read_text()) for p in tmp_path.glob("sleep_*.pid")) == sorted(pids)
    assert [pid for pid in pids if not is_gone(pid)] == []
    for then, error in (
        ("raise", "(?s)rank 0 raised.*rank 0 fails with its sleep running"),
        ("hang", "did not finish within 3 s"),
    ):
        for p in tmp_path.glob("sleep_*.pid"):
            p.unlink()
        with pytest.raises(RankError, match=error):
            run_on_ranks(start_a_sleep, 2, args=(str(tmp_path), then), timeout_s=3)
        pids = [int(p.read_text()) for p in tmp_path.glob("sleep_*.pid")]
        assert len(pids) == 2 and [pid for pid in pids if not is_gone(pid)] == [], then


def test_bad_arguments_are_refused_before_any_rank_starts():
    """What would fail inside every rank, or never end, is refused in the test process with what to pass: a world
    size that is not an int >= 1 (``ddp("2")``, ``True``, 0), a deadline that is not a finite number > 0 (0, -5, nan,
    inf, "x"), args that are not a tuple or list, kwargs not a dict."""
    for world_size in ("2", True, 0, 2.0):
        with pytest.raises(
            ValueError,
            match=rf"needs an int world_size >= 1 \(the number of ranks\), got"
            rf" {re.escape(repr(world_size))}\.",
        ):
            run_on_ranks(all_reduce_rank, world_size)
    for seconds in (0, -5, float("nan"), float("inf"), "x", True):
        with pytest.raises(
            ValueError,
            match=rf"needs timeout_s as a finite number of seconds > 0, got {re.escape(repr(seconds))}: the deadline",
        ):
            run_on_ranks(all_reduce_rank, 2, timeout_s=seconds)
    for args in (5, "ab"):
        with pytest.raises(TypeError, match=r"needs args as a tuple or list .* for one argument x pass args=\(x,\)"):
            run_on_ranks(all_reduce_rank, 2, args=args)
    with pytest.raises(TypeError, match=r"needs kwargs as a dict of fn's keyword arguments, got \[1\]"):
        run_on_ranks(all_reduce_rank, 2, kwargs=[1])
    # what the messages ask for works: an int world size, numpy's included, and one argument as a 1-tuple
    assert [v["sum"] for v in run_on_ranks(all_reduce_rank, np.int64(2), args=(2.0,), timeout_s=60.0)] == [6.0, 6.0]


def exit_without_a_result(rank: int, world_size: int) -> None:
    os._exit(3)


def test_a_rank_that_exits_without_a_result_is_reported_with_the_likely_causes():
    """A rank gone without a result or traceback: the report names the exit code and the usual causes, the missing
    ``__main__`` guard of a script among them."""
    with pytest.raises(RankError, match="2 of 2 ranks failed") as raised:
        run_on_ranks(exit_without_a_result, 2, init_process_group=False, timeout_s=60)
    for report in raised.value.reports.values():
        assert report.startswith("exited with code 3 without a result (killed, os._exit")
        assert "`if __name__ == '__main__':`" in report


def environment_seen(rank: int, world_size: int) -> dict:
    """The scheduler variables this rank sees, and the cluster environment a Trainer built here picks."""
    trainer = L.Trainer(accelerator="cpu", devices=world_size, strategy=MyDDPStrategy(), logger=False)
    return {
        "slurm": sorted(n for n in os.environ if n.startswith("SLURM_")),
        "kept": os.environ.get("MY_SETTING"),
        "environment": type(trainer.strategy.cluster_environment).__name__,
        "ranks": (trainer.global_rank, trainer.world_size),
    }


def test_ranks_of_a_test_run_inside_a_slurm_job_do_not_take_the_job_for_their_ranks(monkeypatch):
    """Inside a SLURM allocation (SLURM_NTASKS=1 ...) a Trainer in a rank would see the job's one task and refuse
    devices=2; the ranks do not inherit the schedulers' variables, other variables they do."""
    for name, value in {
        "SLURM_JOB_ID": "77",
        "SLURM_NTASKS": "1",
        "SLURM_JOB_NAME": "pytest",
        "SLURM_PROCID": "0",
        "SLURM_LOCALID": "0",
        "SLURM_NODEID": "0",
        "MY_SETTING": "kept",
    }.items():
        monkeypatch.setenv(name, value)
    seen = run_on_ranks(environment_seen, 2, init_process_group=False, timeout_s=60)
    assert [s["slurm"] for s in seen] == [[], []] and [s["kept"] for s in seen] == ["kept", "kept"]
    assert [s["environment"] for s in seen] == ["LightningEnvironment"] * 2
    assert [s["ranks"] for s in seen] == [(0, 2), (1, 2)]


def own_group_all_reduce(rank: int, world_size: int) -> dict:
    """Each rank makes its own process group (gloo, a 5 s timeout) from the kit's launch variables; what its parent
    process is, the group's backend and size, and the all-reduced sum of ``rank + 1``."""
    dist.init_process_group("gloo", timeout=timedelta(seconds=5))
    value = torch.tensor([rank + 1.0])
    dist.all_reduce(value)
    return {
        "parent": " ".join(psutil.Process(os.getppid()).cmdline()),
        "group": (dist.get_backend(), dist.get_world_size()),
        "sum": value.item(),
    }


def test_ranks_fork_from_a_forkserver_and_may_make_their_own_process_group():
    """The ranks' parent is multiprocessing's forkserver (the kit's one start method); with init_process_group=False
    a rank makes the group it wants, with its own backend and timeout, from the kit's launch variables (the kit's
    start_method, backend and collective_timeout_s options are retired: docs/differences.md)."""
    per_rank = run_on_ranks(own_group_all_reduce, 2, init_process_group=False, timeout_s=60)
    assert all("forkserver" in r["parent"] for r in per_rank), [r["parent"] for r in per_rank]
    assert [(r["group"], r["sum"]) for r in per_rank] == [(("gloo", 2), 3.0)] * 2


def test_a_trainer_joins_the_kits_process_group_or_makes_its_own():
    """A Trainer built inside the function fits the same with the kit's process group (the default) as without
    it: the same weights on both ranks, and the same as with init_process_group=False."""
    with_group = run_on_ranks(fit_tiny, 2, timeout_s=120)
    without_group = run_on_ranks(fit_tiny, 2, init_process_group=False, timeout_s=120)
    assert [r["steps"] for r in with_group + without_group] == [4, 4, 4, 4]  # 16 samples / 2 ranks / 4, 2 epochs
    assert {r["group_size"] for r in with_group + without_group} == {2}
    assert_same_on_every_rank([r["weights"] for r in with_group + without_group], "weights")


def test_checks_name_the_rank_and_entry_that_differ():
    """assert_same_on_every_rank names rank and key; assert_each_sample_once names duplicates and gaps."""
    same = {"w": torch.ones(2), "step": 3}
    assert_same_on_every_rank([same, {"w": torch.ones(2), "step": 3}])
    with pytest.raises(AssertionError, match=r"rank 1 vs rank 0: parameters\['w'\]: max abs difference 0.5"):
        assert_same_on_every_rank([same, {"w": torch.tensor([1.0, 1.5]), "step": 3}], "parameters")
    assert_each_sample_once([[0, 2, 4], [1, 3]], 5)
    with pytest.raises(AssertionError, match=r"read more than once: \{0: \[0, 1\]\}.*never read: \[4\]"):
        assert_each_sample_once([[0, 2], [0, 1, 3]], 5)
    assert_matches_single_process(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.0 + 1e-7]))
    with pytest.raises(AssertionError, match="differs from one process"):
        assert_matches_single_process(torch.tensor([1.0]), torch.tensor([1.1]), "accuracy")


def test_same_on_every_rank_counts_nan_at_the_same_place_as_equal():
    """NaN at the same positions on every rank is equal, exactly and within tolerance; elsewhere, or with other
    values around it, it is a difference."""
    nan = float("nan")
    assert_same_on_every_rank([{"loss": nan, "w": torch.tensor([1.0, nan])} for _ in range(3)])
    assert_same_on_every_rank([torch.tensor([1.0, nan]), torch.tensor([1.0 + 1e-9, nan])], atol=1e-6)
    assert_matches_single_process(torch.tensor([nan, 2.0]), torch.tensor([nan, 2.0]))
    with pytest.raises(AssertionError, match=r"rank 1 vs rank 0: w: NaN at different positions, first at index \[0\]"):
        assert_same_on_every_rank([torch.tensor([1.0, nan]), torch.tensor([nan, 1.0])], "w")
    with pytest.raises(AssertionError, match=r"rank 1 vs rank 0: w: max abs difference 1"):
        assert_same_on_every_rank([torch.tensor([1.0, nan]), torch.tensor([2.0, nan])], "w")


def test_same_on_every_rank_compares_numpy_arrays_like_tensors():
    """NumPy arrays and scalars, alone or in dicts, are compared by value (no 'truth value is ambiguous')."""
    assert_same_on_every_rank(
        [{"w": np.array([1.0, 2.0]), "n": np.int64(3)}, {"w": np.array([1.0, 2.0]), "n": np.int64(3)}]
    )
    with pytest.raises(AssertionError, match=r"rank 1 vs rank 0: value\['w'\]: max abs difference 0.5"):
        assert_same_on_every_rank([{"w": np.array([1.0, 2.0])}, {"w": np.array([1.0, 2.5])}])
    with pytest.raises(AssertionError, match=r"value: shapes \(3,\) and \(2,\)"):
        assert_same_on_every_rank([np.zeros(2), np.zeros(3)])


def test_same_on_every_rank_is_bitwise_dtype_included_without_tolerance():
    """float32 against float64 with equal values differs at atol=rtol=0 (naming both dtypes) and passes with a
    tolerance; Python floats are compared as float64."""
    values = [torch.tensor([0.5, 1.0]), torch.tensor([0.5, 1.0], dtype=torch.float64)]
    with pytest.raises(AssertionError, match=r"rank 1 vs rank 0: value: dtypes torch.float64 and torch.float32"):
        assert_same_on_every_rank(values)
    assert_same_on_every_rank(values, atol=1e-6)
    with pytest.raises(AssertionError, match="max abs difference 5.55e-17"):
        assert_same_on_every_rank([0.3, 0.1 + 0.2])
    assert_same_on_every_rank([0.5, torch.tensor(0.5)])  # a float against a scalar tensor: by value
    with pytest.raises(AssertionError, match="max abs difference 0.1"):  # complex: the imaginary part counts
        assert_same_on_every_rank([torch.tensor([1 + 1j]), torch.tensor([1 + 1.1j])], atol=1e-3)


def test_same_on_every_rank_needs_a_value():
    """No rank's value (an empty list) is an error, not a vacuous pass."""
    with pytest.raises(ValueError, match="needs at least one rank's weights, got none"):
        assert_same_on_every_rank([], "weights")
    assert_same_on_every_rank([torch.ones(2)])  # one rank: nothing to differ from


def test_each_sample_once_takes_the_index_batches_ranks_collect():
    """Per-rank lists of per-batch index tensors, arrays or nested lists are flattened; duplicates across them are
    still named; a non-integer index is a TypeError."""
    assert_each_sample_once([[torch.tensor([0, 2]), torch.tensor([4])], [np.array([1, 3]), [[5]]]], 6)
    assert_each_sample_once(torch.arange(6).reshape(2, 3), 6)  # a (W, N / W) tensor
    with pytest.raises(AssertionError, match=r"read more than once: \{2: \[0, 1\]\}.*never read: \[3\]"):
        assert_each_sample_once([[torch.tensor([0, 1]), torch.tensor([2])], [torch.tensor([2])]], 4)
    with pytest.raises(TypeError, match=r"rank 1 read 1.5, which is not a sample index"):
        assert_each_sample_once([[0], torch.tensor([1.5])], 2)


class _RaisingInWorkers(Dataset):
    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> torch.Tensor:
        if dist.get_rank() == 1:
            raise ValueError("a DataLoader worker of rank 1 failed on purpose")
        return torch.tensor([float(i)])


def read_through_failing_workers(rank: int, world_size: int, folder: str) -> None:
    """Rank 1's DataLoader workers raise (rank 1 notes when, in ``folder``); rank 0 waits in an all-reduce for rank 1,
    and raises saying whether that all-reduce broke within 3 s of rank 1's failure."""
    if rank == 1:
        try:
            list(DataLoader(_RaisingInWorkers(), batch_size=4, num_workers=2))
        finally:
            (Path(folder) / "rank_1_failed_at").write_text(repr(time.monotonic()))  # one clock for every process
    try:
        dist.all_reduce(torch.ones(1))
    except Exception as e:
        waited = time.monotonic() - float((Path(folder) / "rank_1_failed_at").read_text())
        raise RuntimeError(f"the all-reduce broke within 3 s of rank 1's failure: {waited < 3.0}") from e


def test_a_rank_failing_with_dataloader_workers_releases_its_peers_at_once(tmp_path):
    """Rank 1 fails while its DataLoader workers are alive: the kit stops them with it, so rank 0's all-reduce breaks
    at once, within 3 s, and rank 0 fails too, in the kit's grace period, instead of being stopped at its end
    (orphaned, the workers, which hold copies of rank 1's connections, would notice their parent is gone only up to
    5 s later)."""
    with pytest.raises(RankError, match="2 of 2 ranks failed") as raised:
        run_on_ranks(read_through_failing_workers, 2, args=(str(tmp_path),), timeout_s=60)
    assert "a DataLoader worker of rank 1 failed on purpose" in raised.value.reports[1]
    assert raised.value.reports[0].startswith("raised:")  # rank 0's all-reduce broke; it was not stopped
    assert "the all-reduce broke within 3 s of rank 1's failure: True" in raised.value.reports[0]
