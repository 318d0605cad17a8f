"""When a rank fails: every scenario ends promptly, names the rank, and leaves no process behind.

Each test runs tests/scripts/failing_fit.py (a 2-process fit that fails on purpose) in its own session and
measures from the moment the failure is triggered to the moment the launcher exits.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from ddp_testing import session_members
from lightning.pytorch.callbacks import ModelCheckpoint

from ddp_strategy import DigitsClassifier, DigitsDataModule, MyDDPStrategy

SCRIPT = Path(__file__).parent.parent / "scripts" / "failing_fit.py"
pytestmark = [pytest.mark.multiprocess]


class Job:
    """failing_fit.py running in its own session, with helpers to wait, signal and check for orphans."""

    def __init__(self, out: Path, scenario: str, start_method: str = "popen", ckpt: str | None = None) -> None:
        out.mkdir(parents=True, exist_ok=True)
        self.out = out
        args = [sys.executable, str(SCRIPT), str(out), scenario, start_method] + ([ckpt] if ckpt else [])
        self.proc = subprocess.Popen(args, cwd=out, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)

    def wait_for(self, name: str, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while not (self.out / name).exists():
            assert self.proc.poll() is None, f"job ended before {name}:\n{self.proc.communicate()[0][-4000:]}"
            assert time.monotonic() < deadline, f"{name} did not appear in {timeout} s"
            time.sleep(0.1)

    def finish(self, timeout: float = 240) -> tuple[int, str, float]:
        """Wait for the launcher; return its exit code, its output, and seconds since the failure was triggered."""
        try:
            out, _ = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            out, _ = self.proc.communicate()
            raise AssertionError(f"job did not end in {timeout} s:\n{out[-4000:]}") from None
        ended = time.time()
        failing = self.out / "failing_at"
        since_failure = ended - float(failing.read_text()) if failing.exists() else float("nan")
        deadline = time.monotonic() + 10
        while (left := session_members(self.proc.pid)) and time.monotonic() < deadline:
            time.sleep(0.2)
        if left:
            os.killpg(self.proc.pid, signal.SIGKILL)
        assert not left, f"processes of the job outlived it: {left}"
        return self.proc.returncode, out, since_failure


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("scenario", "start_method", "own", "seen_by_peer"),
    [
        ("train_raise", "popen", "[rank 1] failed: ZeroDivisionError: rank 1 divided by zero on purpose",
         "Cause: rank 1 failed: ZeroDivisionError: rank 1 divided by zero on purpose"),
        ("train_raise", "spawn", "[rank 1] failed: ZeroDivisionError: rank 1 divided by zero on purpose",
         "-- Process 1 terminated with the following error"),
        ("val_raise", "popen", "[rank 0] failed: KeyError: 'rank 0 lost a key in validation on purpose'", None),
        ("callback_raise", "popen", "[rank 1] failed: ValueError: a callback on rank 1 failed on purpose",
         "Cause: rank 1 failed: ValueError: a callback on rank 1 failed on purpose"),
    ],
)
def test_an_exception_on_one_rank_ends_every_rank_within_30_s(tmp_path, scenario, start_method, own, seen_by_peer):
    """A rank that raises (training_step, validation_step, a callback) ends the job quickly, non-zero, named."""
    code, out, seconds = Job(tmp_path, scenario, start_method).finish()
    assert code != 0
    assert seconds < 30, f"took {seconds:.1f} s after the failure"
    assert own in out and "Traceback" in out
    assert (tmp_path / "finally_rank0").exists(), "the launching process was killed before its finally ran"
    if seen_by_peer:
        assert seen_by_peer in out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("start_method", ["popen", "spawn"])
def test_a_killed_rank_is_named_and_the_others_exit_within_60_s(tmp_path, start_method):
    """SIGKILL of rank 1 mid-epoch: the others notice at once and the error names the lost rank."""
    code, out, seconds = Job(tmp_path, "sigkill", start_method).finish()
    assert code != 0 and seconds < 60, f"exit {code} after {seconds:.1f} s"
    expected = "rank 1 (pid" if start_method == "popen" else "process 1 terminated with signal SIGKILL"
    assert expected in out and ("is no longer running" in out or start_method == "spawn")
    assert (tmp_path / "finally_rank0").exists(), "the launching process was killed before its finally ran"


@pytest.mark.timeout(300)
def test_a_stalled_rank_is_named_by_the_epoch_barrier(tmp_path):
    """A rank that hangs before its next epoch is named by the monitored barrier after 5 s, not 30 minutes."""
    code, out, seconds = Job(tmp_path, "stall").finish()
    assert code != 0 and seconds < 60, f"exit {code} after {seconds:.1f} s"
    assert "[rank 0] not every rank reached the start of training epoch 1 within 5 s" in out
    assert "Rank 1 failed to pass monitoredBarrier" in out or "Ranks 1 failed to pass monitoredBarrier" in out


@pytest.mark.timeout(300)
def test_uneven_batch_counts_are_reported_instead_of_deadlocking(tmp_path):
    """Ranks whose own samplers give different batch counts fail on every rank with the counts, not a hang."""
    code, out, seconds = Job(tmp_path, "uneven").finish()
    assert code != 0 and seconds < 60
    assert "ranks have different numbers of training batches in epoch 0: {0: 6, 1: 4}" in out


@pytest.mark.timeout(300)
def test_collectives_out_of_step_fail_within_the_timeout_with_the_likely_cause(tmp_path):
    """A rank that skips one self.log(sync_dist=True) desynchronises collectives: it fails with an explanation."""
    start = time.monotonic()
    code, out, _ = Job(tmp_path, "skip_log").finish()
    assert code != 0 and time.monotonic() - start < 200, f"exit {code}"
    # gloo itself detects the size mismatch and aborts rank 0 with its own explanation; the peer explains.
    assert "collective mismatch" in out or "did not take part" in out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("start_method", ["popen", "spawn"])
def test_sigterm_saves_a_checkpoint_that_resumes_and_leaves_no_process(tmp_path, start_method):
    """SIGTERM to the launcher (pre-emption): all ranks stop, a checkpoint is written, and fit resumes from it."""
    job = Job(tmp_path / "run", "sigterm", start_method)
    job.wait_for("waiting_rank0")  # both ranks wait at step 3 for the signal (no sleep: explicit sync)
    job.wait_for("waiting_rank1")
    job.proc.send_signal(signal.SIGTERM)
    code, out, _ = job.finish()
    # popen: Lightning's SIGTERMException is a SystemExit (status 0); spawn: the stopped ranks are errors.
    assert code == 0 if start_method == "popen" else code != 0
    ckpt = tmp_path / "run" / "sigterm.ckpt"
    assert ckpt.exists() and not (tmp_path / "run" / "finished").exists(), out[-3000:]
    assert "did not exit after a failure" not in out  # every rank exited by itself
    saved = torch.load(ckpt, weights_only=True)
    assert saved["global_step"] >= 3  # the ranks waited for the signal at step 3
    resumed = Job(tmp_path / "resume", "none", ckpt=str(ckpt))
    code, out, _ = resumed.finish()
    assert code == 0, out[-3000:]
    assert int((tmp_path / "resume" / "finished").read_text()) == 3 * 6  # 3 epochs of 6 steps, in total


@pytest.mark.timeout(300)
def test_ctrl_c_to_the_launcher_stops_every_rank(tmp_path):
    """SIGINT to the launching process: it exits non-zero and no rank survives it."""
    job = Job(tmp_path, "sigint")
    job.wait_for("waiting_rank0")
    job.wait_for("waiting_rank1")
    job.proc.send_signal(signal.SIGINT)
    code, out, _ = job.finish()
    assert code != 0 and "KeyboardInterrupt" in out


class CrashOnce(pl.Callback):
    """Raises at the start of epoch 1 when ``fail`` is set."""

    def __init__(self, fail: bool) -> None:
        self.fail = fail

    def on_train_epoch_start(self, trainer, pl_module):
        if self.fail and trainer.current_epoch == 1:
            raise RuntimeError("crash at the start of epoch 1")


def _fit(tmp_path: Path, max_epochs: int, ckpt_path: str | None = None, fail: bool = False) -> DigitsClassifier:
    pl.seed_everything(11)
    model = DigitsClassifier()
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=MyDDPStrategy(start_method="spawn", timeout=60),
                         max_epochs=max_epochs, limit_train_batches=8, logger=False, enable_progress_bar=False,
                         enable_model_summary=False,
                         default_root_dir=str(tmp_path), deterministic=True,
                         callbacks=[ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True), CrashOnce(fail)])
    trainer.fit(model, DigitsDataModule(), ckpt_path=ckpt_path)
    return model


@pytest.mark.timeout(300)
def test_resuming_after_a_crash_gives_the_uninterrupted_weights(tmp_path):
    """Crash in epoch 1, resume from last.ckpt: the final weights equal an uninterrupted 2-epoch run."""
    reference = _fit(tmp_path / "reference", max_epochs=2)
    with pytest.raises(Exception, match="crash at the start of epoch 1"):
        _fit(tmp_path / "crashed", max_epochs=2, fail=True)
    resumed = _fit(tmp_path / "crashed", max_epochs=2, ckpt_path=str(tmp_path / "crashed" / "ckpt" / "last.ckpt"))
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(resumed.state_dict()[name], value, rtol=0, atol=1e-6)


def _store_with_pids(pids: dict[int, int]) -> torch.distributed.Store:
    store = torch.distributed.HashStore()
    for rank, pid in pids.items():
        store.set(f"pid/{rank}", f"{socket.gethostname()}:{pid}")
    return store


@pytest.mark.parametrize("peer_state", ["explained", "failed_too", "exited"])
def test_a_failing_rank_stops_waiting_once_every_peer_is_accounted_for(peer_state):
    """wait_for_peers returns as soon as each peer has explained, failed in its own code, or exited, not at
    the deadline (a bug raised on every rank must not cost EXPLAIN_WAIT_S per failing fit)."""
    from datetime import timedelta

    from ddp_strategy.process import ProcessGroupRun, failures
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    store = _store_with_pids({1: os.getpid(), 2: gone.pid})  # rank 1 alive here, rank 2's process has exited
    if peer_state == "explained":
        store.set("explained/1", "1")
    elif peer_state == "failed_too":  # rank 1's own on_exception publishes its failure
        run = ProcessGroupRun(timedelta(seconds=5), timedelta(seconds=5))
        run.reports = store
        try:
            raise ValueError("the same bug on rank 1")
        except ValueError as e:
            failures.on_exception(run, e, 1, 3, None, None, launcher=None)
        assert run.own_failure and store.get("failed/1").decode().startswith("ValueError: the same bug on rank 1 (")
    else:
        store.set("pid/1", f"{socket.gethostname()}:{gone.pid}")
    start = time.monotonic()
    failures.wait_for_peers(store, rank=0, world_size=3, timeout_s=60)
    assert time.monotonic() - start < 5


def test_a_failing_rank_waits_for_a_live_peer_that_has_not_explained():
    """A live peer that has said nothing yet is waited for, until the deadline."""
    from ddp_strategy.process import failures
    store = _store_with_pids({1: os.getpid()})
    start = time.monotonic()
    failures.wait_for_peers(store, rank=0, world_size=2, timeout_s=0.5)
    assert time.monotonic() - start >= 0.5


class RaisesOnRank1(pl.LightningModule):
    """A linear model whose training_step raises ``error`` on rank 1 at its third batch."""

    def __init__(self, error: Exception) -> None:
        super().__init__()
        self.net = torch.nn.Linear(4, 1)
        self.error = error

    def training_step(self, batch, batch_idx):
        if batch_idx == 2 and self.global_rank == 1:
            raise self.error
        return self.net(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit_failing_on_rank_1(rank: int, world_size: int, num_workers: int, error: Exception) -> None:
    import gc
    import weakref

    from torch.utils.data import DataLoader, TensorDataset

    from ddp_strategy.process import failures

    class GroupSpy(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            self.group = weakref.ref(torch.distributed.group.WORLD)

    failures.EXPLAIN_WAIT_S = 600.0  # longer than the kit's deadline: a rank 0 that never explains hangs the call
    spy = GroupSpy()
    data = DataLoader(TensorDataset(torch.randn(32, 4)), batch_size=4, num_workers=num_workers)
    try:
        pl.Trainer(accelerator="cpu", devices=world_size, strategy=MyDDPStrategy(timeout=60), max_epochs=1,
                   logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                   callbacks=[spy]).fit(RaisesOnRank1(error), data)
    except type(error) as e:
        if rank == 0:
            raise
        gc.collect()  # rank 1; its traceback still holds the DDP wrapper here
        raise RuntimeError(f"process group released while the error propagates: {spy.group() is None}") from e


@pytest.mark.multiprocess
@pytest.mark.parametrize(("num_workers", "error"), [
    (0, ZeroDivisionError("rank 1 divided by zero on purpose")),
    (2, RuntimeError("download timeout: the socket to the data server timed out (gloo, nccl)")),
])
def test_the_peers_of_a_rank_that_raised_explain_before_it_exits(num_workers, error):
    """Rank 1 raises inside a fit: its DDP wrapper lets go of the process group, so the group's connections close
    at teardown, rank 0's collective breaks at once and names rank 1's error, and rank 1, which waits for that
    explanation, gets it (before, the wrapper, kept alive by the exception, held gloo's connections open until
    rank 1's process exited, and rank 1 waited 10 s for an explanation that could not come). With DataLoader
    workers, which hold forked copies of the connections, rank 1 does not wait: rank 0 learns when it exits. A
    user's RuntimeError whose text speaks of timeouts and sockets is rank 1's own failure, not a collective's."""
    from ddp_strategy.testing import RankError, run_on_ranks

    with pytest.raises(RankError) as raised:
        run_on_ranks(_fit_failing_on_rank_1, 2, args=(num_workers, error), init_process_group=False, timeout_s=60)
    own = f"{type(error).__name__}: {error}"
    assert "2 of 2 ranks failed" in str(raised.value)  # not "did not finish": rank 1 did not wait out 600 s
    assert own in raised.value.reports[1] and "did not take part" not in raised.value.reports[1]
    assert "process group released while the error propagates: True" in raised.value.reports[1]
    assert f"Cause: rank 1 failed: {own}" in raised.value.reports[0]


def test_errors_are_classified_by_type_and_where_they_were_raised_not_by_their_words():
    """A user's RuntimeError("download timeout ...") is published as the rank's own failure; a DistBackendError
    (whatever its text) is a broken collective, explained and not published."""
    from datetime import timedelta

    from ddp_strategy.process import ProcessGroupRun, failures
    for error in (RuntimeError("download timeout: socket closed by the gloo server"), dist.DistBackendError("x")):
        run = ProcessGroupRun(timedelta(seconds=5), timedelta(seconds=5))
        run.reports = store = torch.distributed.HashStore()
        try:
            raise error
        except RuntimeError as e:
            failures.on_exception(run, e, 1, 2, None, None, launcher=None)
        own = not isinstance(error, dist.DistBackendError)
        assert run.own_failure is own and store.check(["failed/1"]) is own and store.check(["explained/1"]) is not own
    assert store.check(["explained/1"]) and "No rank reported an error" in str(error)
