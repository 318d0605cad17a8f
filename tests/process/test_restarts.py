"""Surviving failures: torchrun restarts, a restart on fewer workers, SLURM requeue, repeated stages and fits.

Every run is tests/scripts/restart_fit.py; failures are triggered deterministically (at a given step, on a
given torchrun attempt), never by timing. Launches are shared between tests through module fixtures.
"""

from __future__ import annotations

import collections
import os
import sys
import threading
from pathlib import Path

import psutil
import pytest
import torch
import torch.distributed as dist
from ddp_testing import finish, free_port, is_loopback, listening_sockets, load_ranks, quiet_trainer, start_session

from ddp_strategy import DigitsClassifier, DigitsDataModule, MyDDPStrategy
from ddp_strategy.checkpoint.io import load_file
from ddp_strategy.sampling.state import CHECKPOINT_KEY

pytestmark = pytest.mark.multiprocess

SCRIPT = Path(__file__).parent.parent / "scripts" / "restart_fit.py"
N_TRAIN, BATCH = 1438, 32
KILL_STEP, MAX_STEPS = 7, 30  # 23 steps per epoch on 2 ranks: killed in epoch 0, finished in epoch 1
BIND_ERROR = "failed to bind"


def _launch(cmd: list[str], out: Path, env: dict | None = None, timeout: float = 300.0) -> str:
    out.mkdir(parents=True, exist_ok=True)
    code, output = finish(start_session(cmd, cwd=out, env={**os.environ, **(env or {})}), timeout)
    assert code == 0, f"{cmd} exited with {code}:\n{output[-4000:]}"
    return output


def _torchrun(out: Path, nproc: int, *args: str) -> str:
    return _launch(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc-per-node={nproc}",
            "--max-restarts=1",
            "--master-addr=127.0.0.1",
            f"--master-port={free_port()}",
            str(SCRIPT),
            str(out),
            f"--devices={nproc}",
            *args,
        ],
        out,
    )


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> tuple[Path, str]:
    """torchrun, 2 workers, fit then test, nothing killed: the reference."""
    out = tmp_path_factory.mktemp("uninterrupted")
    return out, _torchrun(out, 2, "--ckpt=last", f"--max-steps={MAX_STEPS}", "--stages=fit,test")


@pytest.fixture(scope="module")
def restarted(tmp_path_factory) -> tuple[Path, str]:
    """torchrun --max-restarts=1, 2 workers; rank 1 SIGKILLs itself at step 7 of attempt 0; resume from last."""
    out = tmp_path_factory.mktemp("restarted")
    return out, _torchrun(
        out, 2, "--ckpt=last", f"--max-steps={MAX_STEPS}", "--stages=fit,test", f"--kill-step={KILL_STEP}"
    )


def _weights_close(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=1e-6)


@pytest.mark.timeout(600)
def test_torchrun_restart_after_sigkill_ends_with_the_uninterrupted_weights(restarted, uninterrupted):
    """A worker killed mid-epoch: torchrun restarts both; they rejoin, resume at step 6, equal the reference."""
    (out, log), (ref_out, ref_log) = restarted, uninterrupted
    ref = load_ranks(ref_out, 2)
    for rank, record in enumerate(load_ranks(out, 2)):
        assert record["attempt"] == 1 and ref[rank]["attempt"] == 0  # the second attempt finished the job
        assert record["global_step"] == ref[rank]["global_step"] == MAX_STEPS
        # Resumed from the last periodic checkpoint (step 6) in the middle of epoch 0, at its exact position.
        assert record["batches"][0][:2] == (0, 6)
        assert record["batches"] == ref[rank]["batches"][6:]
        _weights_close(record["final"], ref[rank]["final"])
        assert record["test_acc"] == ref[rank]["test_acc"]  # a second stage in the restarted attempt
    assert "Connection refused" not in log
    assert BIND_ERROR not in log and BIND_ERROR not in ref_log  # the agent's store is used, not a second one


@pytest.mark.timeout(600)
def test_torchrun_workers_listen_on_loopback_only(restarted):
    """One node under torchrun: every listening socket of every worker is on 127.0.0.0/8, gloo on lo."""
    for record in load_ranks(restarted[0], 2):
        assert record["listening"] and all(is_loopback(address) for address, _ in record["listening"])
        assert record["gloo_ifname"] == "lo"


@pytest.mark.timeout(600)
def test_relaunch_with_fewer_workers_trains_on_exactly_the_rest_of_the_epoch(tmp_path, uninterrupted):
    """A 2-worker mid-epoch checkpoint resumed by `torchrun --nproc-per-node=1`: the rest of epoch 0, each once."""
    ref_out, _ = uninterrupted
    steps_left = -(-(N_TRAIN - 2 * 6 * BATCH) // BATCH)  # 1054 unseen samples, 33 batches on one worker
    _torchrun(tmp_path, 1, f"--ckpt={ref_out / 'ckpts' / 'epoch=0-step=6.ckpt'}", f"--max-steps={6 + steps_left}")
    (record,) = load_ranks(tmp_path, 1)
    assert record["world_size"] == 1 and record["global_step"] == 6 + steps_left
    assert {epoch for epoch, _, _ in record["batches"]} == {0}
    seen_before = collections.Counter(
        i for r in load_ranks(ref_out, 2) for e, s, idx in r["batches"] if e == 0 and s < 6 for i in idx
    )
    seen_after = collections.Counter(i for _, _, idx in record["batches"] for i in idx)
    assert seen_before + seen_after == collections.Counter(range(N_TRAIN))


@pytest.mark.timeout(300)
def test_stages_and_new_trainers_in_one_script_rejoin_while_rank0_is_slow_to_tear_down(tmp_path):
    """fit, test, then a new Trainer's fit on one MASTER_PORT, rank 0 3 s late at each teardown: all rendezvous work."""
    log = _launch(
        [sys.executable, str(SCRIPT), str(tmp_path), "--max-steps=4", "--stages=fit,test,refit", "--slow-teardown=3"],
        tmp_path,
    )
    records = load_ranks(tmp_path, 2)
    assert [r["refit_step"] for r in records] == [6, 6]
    assert records[0]["test_acc"] == records[1]["test_acc"]
    _weights_close(records[0]["final"], records[1]["final"])
    assert "could not join" not in log
    # One node, popen: rank 0's rendezvous store and both ranks' gloo sockets listen on loopback only.
    for record in records:
        assert record["listening"] and all(is_loopback(address) for address, _ in record["listening"])
    assert ("127.0.0.1", records[0]["master_port"]) in records[0]["listening"]  # rank 0 serves the store


def _slurm_job(out: Path, *args: str) -> None:
    """Start 2 tasks as `srun` would (SLURM's variables, one process per task) and wait for both."""
    out.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "SLURM_NTASKS": "2",
        "SLURM_NTASKS_PER_NODE": "2",
        "SLURM_JOB_NAME": "train",
        "SLURM_JOB_ID": "4242",
        "SLURM_NODELIST": "127.0.0.1",
        "SLURM_NODEID": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }
    procs = [
        start_session(
            [sys.executable, str(SCRIPT), str(out), *args],
            cwd=out,
            env={**env, "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank)},
        )
        for rank in range(2)
    ]
    for proc in procs:
        code, output = finish(proc, 240)
        assert code == 0, output[-4000:]


@pytest.mark.timeout(600)
def test_slurm_requeue_checkpoint_holds_the_sampler_position_and_resumes_exactly(tmp_path):
    """SIGUSR1 to rank 1 in step 4's training_step: all save Lightning's hpc checkpoint at that step's end (the round
    before its backward pass carries it); the requeue matches."""
    first, requeued = tmp_path / "first", tmp_path / "requeued"
    _slurm_job(first, "--max-steps=12", "--usr1-step=4")
    checkpoint = load_file(first / "hpc_ckpt_1.ckpt", weights_only=True)
    assert checkpoint["global_step"] == 5  # saved at the end of the step the signal came in
    assert checkpoint[CHECKPOINT_KEY]["loaders"][0]["layers"] == [{"world_size": 2, "consumed": [5 * BATCH] * 2}]
    # The requeued job (scontrol is not run here) finds hpc_ckpt_1.ckpt in default_root_dir; no ckpt_path needed.
    requeued.mkdir()
    (requeued / "hpc_ckpt_1.ckpt").write_bytes((first / "hpc_ckpt_1.ckpt").read_bytes())
    _slurm_job(requeued, "--max-steps=12")
    for full, resumed in zip(load_ranks(first, 2), load_ranks(requeued, 2), strict=True):
        assert resumed["batches"][0][:2] == (0, 5) and resumed["batches"] == full["batches"][5:]
        _weights_close(resumed["final"], full["final"])


@pytest.mark.timeout(600)
def test_ten_fits_in_one_process_keep_descriptors_threads_and_children_flat(tmp_path):
    """As in a notebook (fork): 10 fits in one process leave descriptors, threads and child processes unchanged."""
    model, counts = DigitsClassifier(), []
    for _ in range(10):
        trainer = quiet_trainer(
            2,
            MyDDPStrategy(start_method="fork", timeout=60),
            max_steps=1,
            limit_val_batches=1,
            default_root_dir=str(tmp_path),
        )
        trainer.fit(model, DigitsDataModule())
        me = psutil.Process()
        counts.append((me.num_fds(), threading.active_count(), me.num_threads(), len(me.children())))
    assert counts[1:] == [counts[0]] * 9, counts
    assert listening_sockets(os.getpid()) == [] and not dist.is_initialized()
