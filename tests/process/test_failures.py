"""When a rank fails: every scenario ends promptly, names the rank, and leaves no process behind.

Each job runs tests/scripts/failing_fit.py (a 2-process fit that fails on purpose) in its own session and
measures from the moment the failure is triggered to the moment the launcher exits. The module's ``jobs`` fixture
runs the jobs the selected tests name, two at a time: a job spends most of its time on one core (Python importing
Lightning in the launcher, then in rank 1) or waiting (a timeout, a grace period). Fits that need no launcher of
their own run in the testing kit's ranks (tests/process/failure_workers.py).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from ddp_testing import launch, load, quiet_trainer, session_members
from failure_workers import crash_and_resume, decided_alike, rank_0_fails_between_epochs, resume_after_sigterm

from ddp_strategy import MyDDPStrategy

SCRIPT = Path(__file__).parent.parent / "scripts" / "failing_fit.py"
pytestmark = [pytest.mark.multiprocess]

#: job name -> (failing_fit.py's scenario, start method, the signal the test sends once both ranks wait for it)
JOBS: dict[str, tuple[str, str, int | None]] = {  # the long ones first; spawn (3 processes import) beside popen (1)
    "raw_barrier/popen": ("raw_barrier", "popen", None),
    "skip_log/ddp": ("skip_log", "ddp", None),
    "stall/popen": ("stall", "popen", None),
    "sigterm/spawn": ("sigterm", "spawn", signal.SIGTERM),
    "sigint/popen": ("sigint", "popen", signal.SIGINT),
    "sigint_save/popen": ("sigint_save", "popen", signal.SIGINT),
    "sigint_save/ddp": ("sigint_save", "ddp", signal.SIGINT),
    "train_raise/spawn": ("train_raise", "spawn", None),
    "sigterm/popen": ("sigterm", "popen", signal.SIGTERM),
    "sigkill/spawn": ("sigkill", "spawn", None),
    "val_raise/popen": ("val_raise", "popen", None),
    "callback_raise/popen": ("callback_raise", "popen", None),
    "epoch_end_raise/popen": ("epoch_end_raise", "popen", None),
    "fit_start_raise/popen": ("fit_start_raise", "popen", None),
    "save_raise/popen": ("save_raise", "popen", None),
    "uneven/popen": ("uneven", "popen", None),
    "train_raise/popen": ("train_raise", "popen", None),
    "sigkill/popen": ("sigkill", "popen", None),
    "refit/popen": ("refit", "popen", None),
    "skip_alone/popen": ("skip_alone", "popen", None),
    "stop_alone/popen": ("stop_alone", "popen", None),
    "save_alone/popen": ("save_alone", "popen", None),
    "end_alone/popen": ("end_alone", "popen", None),
    "save_epoch_alone/popen": ("save_epoch_alone", "popen", None),
    "reduce_epoch_alone/popen": ("reduce_epoch_alone", "popen", None),
    "gather_epoch_alone/popen": ("gather_epoch_alone", "popen", None),
    "save_sync_alone/popen": ("save_sync_alone", "popen", None),
    "save_metric_alone/popen": ("save_metric_alone", "popen", None),
    "skip_log/popen": ("skip_log", "popen", None),
    "skip_log_backward/popen": ("skip_log_backward", "popen", None),
    "end_reduce_alone/popen": ("end_reduce_alone", "popen", None),
    "skip_alone/ddp": ("skip_alone", "ddp", None),
    "save_alone/ddp": ("save_alone", "ddp", None),
    "save_epoch_alone/ddp": ("save_epoch_alone", "ddp", None),
    "reduce_epoch_alone/ddp": ("reduce_epoch_alone", "ddp", None),
}
#: Launch variables a fit in this pytest process may have left in os.environ (Lightning's popen launcher and the
#: rendezvous set MASTER_ADDR/MASTER_PORT in the launching process; a module fixture's fit is not undone by the
#: per-test restore): a job is a fresh launch from a clean shell, so it gets none of them.
LAUNCH_VARIABLES = {"MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK"}
#: What Lightning's popen launcher (and ``_set_num_threads_if_needed``) leaves in the launching process, under
#: ``strategy="ddp"`` too; the strategy leaves nothing else (GLOO_SOCKET_IFNAME, set while a run lasts, is removed).
LIGHTNING_LEAVES = {"MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "WORLD_SIZE", "OMP_NUM_THREADS"}
#: How many jobs run at once (2 cores); how long one may take, and its processes may outlive its launcher (s).
PARALLEL, JOB_TIMEOUT_S, OUTLIVE_S = 2, 240.0, 10.0


@dataclass
class Ended:
    """What a job left: the launcher's exit code, output, seconds it ran and seconds from the failure to its exit, its
    folder, and whether the test's signal was sent."""

    code: int
    out: str
    seconds: float
    since_failure: float
    folder: Path
    signalled: bool


class Job:
    """failing_fit.py running in its own session; ``signum`` is sent to the launcher once both ranks wait for it."""

    def __init__(self, out: Path, scenario: str, start_method: str, signum: int | None) -> None:
        out.mkdir(parents=True)
        self.out, self.signum, self.signalled = out, signum, False
        with (out / "output.txt").open("w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, str(SCRIPT), str(out), scenario, start_method],
                cwd=out,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env={k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES},
            )
        self.started = time.time()
        self.deadline = time.monotonic() + JOB_TIMEOUT_S
        self.ended: float | None = None  # time.time() when the launcher exited
        self.left: list[int] = []
        self.error: str | None = None

    def done(self) -> bool:
        """One look at the job: send the signal when due; True once it and every process it started have ended."""
        if self.ended is None and self.proc.poll() is not None:
            self.ended, self.deadline = time.time(), time.monotonic() + OUTLIVE_S
        if self.ended is None:
            waiting = all((self.out / f"waiting_rank{r}").exists() for r in range(2))
            if self.signum is not None and not self.signalled and waiting:
                self.proc.send_signal(self.signum)
                self.signalled = True
                (self.out / "failing_at").write_text(str(time.time()))  # the signal is the failure
            if time.monotonic() > self.deadline:
                self.kill(f"job did not end in {JOB_TIMEOUT_S:.0f} s")
                return True
            return False
        self.left = session_members(self.proc.pid)
        if self.left and time.monotonic() > self.deadline:
            self.kill(f"processes of the job outlived it by {OUTLIVE_S:.0f} s: {self.left}")
        return not self.left or self.error is not None

    def kill(self, error: str) -> None:
        self.error = error
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:  # every process of the job has just ended
            pass
        self.proc.wait()

    def result(self) -> Ended:
        """The outcome; AssertionError if the job timed out or left processes behind."""
        out = (self.out / "output.txt").read_text()
        assert self.error is None, f"{self.error}:\n{out[-4000:]}"
        failing = self.out / "failing_at"
        since_failure = self.ended - float(failing.read_text()) if failing.exists() else float("nan")
        return Ended(self.proc.returncode, out, self.ended - self.started, since_failure, self.out, self.signalled)


@pytest.fixture(scope="module")
def jobs(request, tmp_path_factory) -> dict[str, Job]:
    """Every job a selected test of this module names (its ``job`` parameter), run to its end, PARALLEL at once."""
    selected = [item for item in request.session.items if getattr(item, "module", None) is request.module]
    names = {item.callspec.params.get("job") for item in selected if hasattr(item, "callspec")}
    queue, running, finished = [name for name in JOBS if name in names], [], {}
    root = tmp_path_factory.mktemp("jobs")
    try:
        while queue or running:
            while queue and len(running) < PARALLEL:
                name = queue.pop(0)
                running.append(Job(root / name.replace("/", "-"), *JOBS[name]))
                finished[name] = running[-1]
            running = [job for job in running if not job.done()]
            time.sleep(0.05)
    finally:
        for job in running:
            job.kill("the test run was interrupted")
    return finished


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    ("job", "own", "seen_by_peer"),
    [
        (
            "train_raise/popen",
            "[rank 1] failed: ZeroDivisionError: rank 1 divided by zero on purpose",
            "Cause: rank 1 failed: ZeroDivisionError: rank 1 divided by zero on purpose",
        ),
        pytest.param(
            "train_raise/spawn",
            "[rank 1] failed: ZeroDivisionError: rank 1 divided by zero on purpose",
            "-- Process 1 terminated with the following error",
            marks=pytest.mark.slow,
        ),
        ("val_raise/popen", "[rank 0] failed: KeyError: 'rank 0 lost a key in validation on purpose'", None),
        (
            "callback_raise/popen",
            "[rank 1] failed: ValueError: a callback on rank 1 failed on purpose",
            "Cause: rank 1 failed: ValueError: a callback on rank 1 failed on purpose",
        ),
        (  # rank 1 waits for rank 0 at the next epoch's barrier: until 2026-12-06 (a day) the barrier's callback held
            # the world group, which a failing rank's traceback then kept open: rank 1 waited out the barrier timeout
            "epoch_end_raise/popen",
            "[rank 0] failed: ValueError: rank 0 failed at its epoch's end on purpose",
            "Cause: rank 0 failed: ValueError: rank 0 failed at its epoch's end on purpose",
        ),
        (  # rank 1's first use of the side group (the run-stage barrier) came after rank 0 closed it: until 2026-12-06
            # its pairs connected on first use, and the connect to a closed listener was retried until the timeout
            "fit_start_raise/popen",
            "[rank 0] failed: ValueError: rank 0 failed at the fit's start on purpose",
            "Cause: rank 0 failed: ValueError: rank 0 failed at the fit's start on purpose",
        ),
        (  # Trainer.save_checkpoint on every rank; rank 0's write fails, rank 1 waits in the save's barrier
            "save_raise/popen",
            "[rank 0] failed: OSError: disk full on purpose",
            "Cause: rank 0 failed: OSError: disk full on purpose",
        ),
    ],
)
def test_an_exception_on_one_rank_ends_every_rank_within_30_s(jobs, job, own, seen_by_peer):
    """A rank that raises (training_step, validation_step, a callback) ends the job quickly, non-zero, named."""
    ended = jobs[job].result()
    assert ended.code != 0
    assert ended.since_failure < 30, f"took {ended.since_failure:.1f} s after the failure"
    assert own in ended.out and "Traceback" in ended.out
    assert (ended.folder / "finally_rank0").exists(), "the launching process was killed before its finally ran"
    assert set((ended.folder / "environ_rank0").read_text().split()) <= LIGHTNING_LEAVES  # the launching process
    if seen_by_peer:
        assert seen_by_peer in ended.out


@pytest.mark.timeout(600)
@pytest.mark.parametrize("job", ["sigkill/popen", pytest.param("sigkill/spawn", marks=pytest.mark.slow)])
def test_a_killed_rank_is_named_and_the_others_exit_within_60_s(jobs, job):
    """SIGKILL of rank 1 mid-epoch: the others notice at once and the error names the lost rank."""
    ended = jobs[job].result()
    assert ended.code != 0 and ended.since_failure < 60, f"exit {ended.code} after {ended.since_failure:.1f} s"
    popen = job.endswith("popen")
    expected = "rank 1 (pid" if popen else "process 1 terminated with signal SIGKILL"
    assert expected in ended.out and ("is no longer running" in ended.out or not popen)
    assert (ended.folder / "finally_rank0").exists(), "the launching process was killed before its finally ran"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("job", ["stall/popen"])
def test_a_stalled_rank_is_named_by_the_epoch_barrier(jobs, job):
    """A rank that hangs before its next epoch is named by the epoch barrier after 5 s (its timeout), not 30 minutes:
    gloo's barrier ends on time, and the ranks that reached it read who did not from the run's store (issue 49 item 4:
    until 2026-12-06 a monitored_barrier, rank 0 exchanging with every rank in turn at every epoch)."""
    ended = jobs[job].result()
    assert ended.code != 0 and ended.since_failure < 60, f"exit {ended.code} after {ended.since_failure:.1f} s"
    assert "[rank 0] ranks [1] did not reach the start of training epoch 1 within 5 s" in ended.out


@pytest.mark.timeout(600)
@pytest.mark.parametrize("job", ["uneven/popen"])
def test_uneven_batch_counts_are_reported_instead_of_deadlocking(jobs, job):
    """Ranks whose own samplers give different batch counts fail, under uneven_inputs="error", on every rank with
    the counts, not a hang."""
    ended = jobs[job].result()
    assert ended.code != 0 and ended.since_failure < 60
    assert "ranks have different numbers of training batches in epoch 0: {0: 6, 1: 4}" in ended.out


@pytest.mark.timeout(600)
@pytest.mark.parametrize("job", ["raw_barrier/popen"])
def test_collectives_out_of_step_are_explained_on_every_rank_with_where_each_rank_waited(jobs, job):
    """Rank 1 alone makes a torch.distributed.barrier() of its own in a training step (a 10 s collective timeout), not
    the strategy's: nothing of ours runs before it, and it meets rank 0's gradient all-reduce. Every rank ends at the
    timeout, as under ddp; none calls it its own failure (until 2026-12-06 the rank that timed out published the
    timeout as its own error, and the other said that no rank reported one), and each gives the likely causes and
    where every rank waited: rank 1 in a collective of its training_step (at its line), rank 0 in the backward
    pass."""
    ended = jobs[job].result()
    assert ended.code != 0 and ended.since_failure < 60, f"exit {ended.code} after {ended.since_failure:.1f} s"
    assert "] failed:" not in ended.out  # neither rank's own error
    for rank in range(2):
        said = [line for line in ended.out.splitlines() if line.startswith(f"[rank {rank}] a collective failed")]
        assert said and "self.log(..., sync_dist=True) on some ranks only" in said[0], ended.out
        assert " in MyDDPStrategy.training_step, at failing_fit.py:" in said[0].split("ranks [1]: ")[1], said[0]
        assert said[0].split("ranks [0]: ")[1].startswith("_engine_run_backward in MyDDPStrategy.backward"), said[0]


#: A rank that leaves the others' step sequence alone: the job, the rank, what it says of itself.
ALONE = {
    "skip_alone": (1, "ended training epoch 0 early, at batch_idx 3 (here alone: on_train_batch_start returned -1,"),
    "stop_alone": (1, "ended training epoch 1 early, at batch_idx 3 (here alone: on_train_batch_start returned -1,"),
    "save_alone": (
        0,
        "waited in a barrier (Trainer.save_checkpoint) while another rank went on (to its step's backward pass",
    ),
    "save_epoch_alone": (
        0,
        "waited in a barrier (Trainer.save_checkpoint) while another rank went on (to its step's backward pass, its"
        " next epoch",
    ),
    "reduce_epoch_alone": (
        0,
        "made a reduce (self.log(..., sync_dist=True) or strategy.reduce) while another rank went on (to its step's"
        " backward pass, its next epoch or the fit's end)",
    ),
    "gather_epoch_alone": (
        0,
        "made an all_gather while another rank went on (to its step's backward pass, its next epoch or the fit's end)",
    ),
    "skip_log": (
        0,
        "made a reduce (self.log(..., sync_dist=True) or strategy.reduce) while another rank went on (to its step's"
        " backward pass",
    ),
    "end_reduce_alone": (
        1,
        "made a reduce (self.log(..., sync_dist=True) or strategy.reduce) while another rank went on (to its step's"
        " backward pass, its next epoch or the fit's end)",
    ),
    "skip_log_backward": (
        0,
        "made a reduce (self.log(..., sync_dist=True) or strategy.reduce) while another rank went on (to its step's"
        " backward pass",
    ),
    "save_metric_alone": (
        0,
        "waited in a barrier (Trainer.save_checkpoint) while another rank made another collective (all_gather) here",
    ),
    "save_sync_alone": (0, "waited in a barrier (Trainer.save_checkpoint) while another rank made another collective"),
    "end_alone": (
        1,
        "ranks [1] ended the fit (trainer.should_stop set there alone, after the epoch's last batch) while",
    ),
}


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "job",
    [
        "skip_alone/popen",
        pytest.param("stop_alone/popen", marks=pytest.mark.slow),  # (the fast suite's time: skip_alone's kind)
        "save_alone/popen",
        pytest.param("save_epoch_alone/popen", marks=pytest.mark.slow),
        pytest.param("reduce_epoch_alone/popen", marks=pytest.mark.slow),
        pytest.param("gather_epoch_alone/popen", marks=pytest.mark.slow),
        "save_sync_alone/popen",
        "save_metric_alone/popen",
        "skip_log/popen",
        pytest.param("skip_log_backward/popen", marks=pytest.mark.slow),
        "end_alone/popen",
        pytest.param("end_reduce_alone/popen", marks=pytest.mark.slow),
    ],
)
def test_a_rank_that_leaves_the_others_steps_alone_is_named_on_every_rank_within_seconds(jobs, job):
    """on_train_batch_start returning -1 on rank 1 alone, trainer.should_stop set on rank 1 alone mid-epoch or in
    on_train_epoch_end (after the last batch: it ends the fit), trainer.save_checkpoint on rank 0 alone mid-epoch or
    at an epoch's end, and self.log(..., sync_dist=True) on rank 0 alone at an epoch's end (a 20 s collective
    timeout; until 2026-12-06 the last two waited out the timeout, and the reduce met the other rank's epoch-start
    all-reduce: gloo aborted rank 0 natively, found by a fresh-user tryout), and self.all_gather on rank 0 alone there
    (whose Lightning frame holds the world group: the failing rank's traceback let go of it only since the same
    day, before the other rank waited out the epoch barrier's timeout): the rank that left names itself and the
    cause, the other names it as the cause, within 15 s of the divergence (Lightning's ddp: the timeout, unnamed; for
    the fit's end alone, the others' next step fails once the rank that left exits, unnamed: "Connection closed by
    peer"). Until 2026-12-06 a fit ended alone waited out the timeout: its fit-end all-reduce met the others' next
    epoch's barrier. Since that day's later change (the round before each backward pass; a kind in each round) also:
    self.log(..., sync_dist=True) on rank 0 alone inside a training step (skip_log; ddp: the timeout) or in
    on_before_backward (skip_log_backward: after the strategy's pre_backward, found by a fresh-user tryout), a save
    on rank 0 alone at an epoch's end where rank 1 reduces an epoch-level sync_dist log (save_sync_alone: both ranks
    raise, each naming the other's collective) or computes its torchmetrics metrics there (save_metric_alone: the
    metrics sync through the strategy while fitting), and a strategy.reduce in on_train_end on the rank that ended the
    fit alone
    (end_reduce_alone)."""
    ended = jobs[job].result()
    rank, says = ALONE[job.split("/")[0]]
    assert ended.code != 0 and ended.since_failure < 15, f"exit {ended.code} after {ended.since_failure:.1f} s"
    assert f"[rank {rank}] failed: RuntimeError: [rank {rank}] {says}" in ended.out
    if job.startswith("end_alone"):  # both ranks take part in the same all-reduce at the fit's end: each raises it
        assert f"[rank 0] failed: RuntimeError: [rank 0] {says} the others started training epoch 1" in ended.out
        return
    if job.startswith(("save_sync_alone", "save_metric_alone")):  # the rounds differ: each names the other's kind
        did = "made a reduce (self.log(..., sync_dist=True) or" if "sync" in job else "synced a metric (a torchmetrics"
        assert f"[rank 1] failed: RuntimeError: [rank 1] {did}" in ended.out
        assert "while another rank made another collective (barrier) here" in ended.out
        return
    assert (
        f"[rank {1 - rank}] a collective failed because another rank did not take part. Cause: rank {rank} failed:"
        f" RuntimeError: [rank {rank}] {says}" in ended.out
    )


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "job", ["skip_alone/ddp", "save_alone/ddp", "save_epoch_alone/ddp", "reduce_epoch_alone/ddp", "skip_log/ddp"]
)
def test_under_lightnings_ddp_a_rank_that_leaves_alone_fails_at_the_collective_timeout(jobs, job):
    """The same user code under strategy=DDPStrategy(timeout=20 s): every rank waits out the timeout, no rank named."""
    ended = jobs[job].result()
    assert ended.code != 0 and ended.since_failure >= 20, f"exit {ended.code} after {ended.since_failure:.1f} s"
    assert (
        any(word in ended.out.lower() for word in ("timed out", "timeout"))
        and ALONE[job.split("/")[0]][1] not in ended.out
    )


@pytest.mark.timeout(300)
def test_an_epoch_end_decided_alike_on_every_rank_trains_as_under_ddp(tmp_path):
    """The fix the errors above advise: -1 and should_stop decided on rank 1, shared by reduce_boolean_decision and
    broadcast, with the progress bar on: both fits end where decided (epoch 0 after 3 steps, the fit after epoch 1's
    3rd), with the same steps and weights as ddp's, on both ranks."""
    launch(decided_alike, 2, tmp_path)
    records = load(tmp_path, "decided_alike", 2)
    for record in records:
        assert record["ours"]["steps"] == record["ddp"]["steps"] == 3 + 3, record
        assert record["ours"]["epoch"] == record["ddp"]["epoch"]
        for name, value in record["ddp"]["weights"].items():
            torch.testing.assert_close(record["ours"]["weights"][name], value, rtol=0, atol=1e-6)
    torch.testing.assert_close(records[0]["ours"]["weights"], records[1]["ours"]["weights"], rtol=0, atol=0)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("job", ["sigterm/popen", pytest.param("sigterm/spawn", marks=pytest.mark.slow)])
def test_sigterm_saves_a_checkpoint_that_resumes_and_leaves_no_process(jobs, job):
    """SIGTERM to the launcher (pre-emption): all ranks stop, a checkpoint is written, and fit resumes from it."""
    ended = jobs[job].result()
    assert ended.signalled, f"the job ended before both ranks waited at step 3 for the signal:\n{ended.out[-3000:]}"
    # popen: Lightning's SIGTERMException is a SystemExit (status 0); spawn: the stopped ranks are errors.
    assert ended.code == 0 if job.endswith("popen") else ended.code != 0
    ckpt = ended.folder / "sigterm.ckpt"
    assert ckpt.exists() and not (ended.folder / "finished").exists(), ended.out[-3000:]
    assert "is still running 30 s after the launching process" not in ended.out  # every rank exited by itself
    saved = torch.load(ckpt, weights_only=True)
    assert saved["global_step"] >= 3  # the ranks waited for the signal at step 3
    launch(resume_after_sigterm, 2, ended.folder)
    assert [r["global_step"] for r in load(ended.folder, "resumed", 2)] == [3 * 6] * 2  # 3 epochs of 6 steps


@pytest.mark.timeout(600)
@pytest.mark.parametrize("job", ["refit/popen"])
def test_a_failure_the_script_catches_leaves_every_rank_to_fit_again(jobs, job):
    """popen, every rank raises and the script catches it and fits again (as it may under ddp): no rank is stopped,
    the new fit trains on both ranks and the job exits 0 (before: the launching rank SIGKILLed rank 1 after 5 s); the
    environment of every process is left as under ddp (no GLOO_SOCKET_IFNAME)."""
    ended = jobs[job].result()
    assert ended.code == 0, ended.out[-3000:]
    assert [(ended.folder / f"refit_rank{r}").read_text() for r in (0, 1)] == ["6", "6"]
    assert "is still running 30 s after the launching process" not in ended.out
    for rank in (0, 1):  # after a failed fit and a successful one, only what Lightning's launcher leaves
        assert set((ended.folder / f"environ_rank{rank}").read_text().split()) <= LIGHTNING_LEAVES


@pytest.mark.timeout(600)
@pytest.mark.parametrize("job", ["sigint/popen"])
def test_ctrl_c_to_the_launcher_stops_every_rank(jobs, job):
    """SIGINT to the launching process: it exits non-zero and no rank survives it."""
    ended = jobs[job].result()
    assert ended.signalled, f"the job ended before both ranks waited at step 3 for the signal:\n{ended.out[-3000:]}"
    assert ended.code != 0 and "KeyboardInterrupt" in ended.out


@pytest.mark.timeout(600)
@pytest.mark.parametrize("job", ["sigint_save/popen", "sigint_save/ddp"])
def test_ctrl_c_mid_step_with_on_exception_checkpoint_ends_rank_0_through_python(jobs, job):
    """SIGINT to the launching process alone while rank 1 waits in the step's gradient all-reduce, with an
    OnExceptionCheckpoint: rank 0 saves it and ends through Python as under strategy="ddp" (status 1, its finally run,
    no gloo abort: until 2026-12-06 the save's barrier met rank 1's gradient all-reduce, "Received data size doesn't
    match expected size", status -6; or, where the barrier met nothing, a wait until rank 1's collective timed out,
    98 s here), within 15 s of the signal (DDPStrategy, its timeout lowered to 20 s, waits in that barrier until it
    times out), and no rank survives it."""
    ended = jobs[job].result()
    assert ended.signalled, f"the job ended before rank 0 waited at step 3 for the signal:\n{ended.out[-3000:]}"
    assert ended.code == 1 and "Detected KeyboardInterrupt" in ended.out, ended.out[-3000:]
    assert "EnforceNotMet" not in ended.out and "terminate called" not in ended.out, ended.out[-3000:]
    assert (ended.folder / "finally_rank0").exists() and (ended.folder / "on_exception.ckpt").exists()
    assert job.endswith("ddp") or ended.since_failure < 15, f"took {ended.since_failure:.1f} s after the signal"


@pytest.mark.timeout(300)
def test_resuming_after_a_crash_gives_the_uninterrupted_weights(tmp_path):
    """Crash in epoch 1, resume from last.ckpt: the final weights equal an uninterrupted 2-epoch run."""
    launch(crash_and_resume, 2, tmp_path)
    for rank in load(tmp_path, "crash_and_resume", 2):
        assert "crash at the start of epoch 1" in rank["crash"], rank["crash"]
        for name, value in rank["reference"].items():
            torch.testing.assert_close(rank["resumed"][name], value, rtol=0, atol=1e-6)


@pytest.mark.timeout(300)
def test_a_rank_that_fails_between_epochs_is_named_by_its_peers_epoch_barrier(tmp_path):
    """Rank 0 raises at an epoch's end: rank 1's barrier at the next epoch's start breaks at once and names rank 0's
    error (before: a stall 'within 60 s', rank 0's error unnamed)."""
    launch(rank_0_fails_between_epochs, 2, tmp_path)
    rank_0, rank_1 = (record["error"] for record in load(tmp_path, "between_epochs", 2))
    assert rank_0.startswith("PermissionError: rank 0 cannot remove the previous checkpoint (on purpose)"), rank_0
    assert "Cause: rank 0 failed: PermissionError: rank 0 cannot remove the previous checkpoint" in rank_1, rank_1
    assert "not every rank reached" not in rank_1, rank_1


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
            failures.on_exception(run, e, 1, 3, None)
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
            self.raised_at = time.monotonic()
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

    spy, model = GroupSpy(), RaisesOnRank1(error)
    data = DataLoader(TensorDataset(torch.randn(32, 4)), batch_size=4, num_workers=num_workers)
    try:
        quiet_trainer(world_size, MyDDPStrategy(timeout=60), max_epochs=1, callbacks=[spy]).fit(model, data)
    except type(error) as e:
        if rank == 0:
            raise
        # rank 1: the explanation ended its wait for the peers, not the wait's time limit
        explained = time.monotonic() - model.raised_at < failures.EXPLAIN_WAIT_S
        gc.collect()  # its traceback still holds the DDP wrapper here
        raise RuntimeError(
            f"process group released while the error propagates: {spy.group() is None};"
            f" explained before the wait for the peers ran out: {explained}"
        ) from e


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("num_workers", "error"),
    [
        (0, ZeroDivisionError("rank 1 divided by zero on purpose")),
        (2, RuntimeError("download timeout: the socket to the data server timed out (gloo, nccl)")),
    ],
)
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
    assert "2 of 2 ranks failed" in str(raised.value)  # not "did not finish"
    assert own in raised.value.reports[1] and "did not take part" not in raised.value.reports[1]
    assert "process group released while the error propagates: True" in raised.value.reports[1]
    assert "explained before the wait for the peers ran out: True" in raised.value.reports[1]
    assert f"Cause: rank 1 failed: {own}" in raised.value.reports[0]


def test_errors_are_classified_by_type_and_where_they_were_raised_not_by_their_words():
    """A user's RuntimeError("download timeout ...") is published as the rank's own failure; a DistBackendError
    (whatever its text) is a broken collective, explained (the likely causes, no advice that fails) and not
    published."""
    from datetime import timedelta

    from ddp_strategy.process import ProcessGroupRun, failures

    for error in (RuntimeError("download timeout: socket closed by the gloo server"), dist.DistBackendError("x")):
        run = ProcessGroupRun(timedelta(seconds=5), timedelta(seconds=5))
        run.reports = store = torch.distributed.HashStore()
        try:
            raise error
        except RuntimeError as e:
            failures.on_exception(run, e, 1, 2, None)
        own = not isinstance(error, dist.DistBackendError)
        assert run.own_failure is own and store.check(["failed/1"]) is own and store.check(["explained/1"]) is not own
    assert store.check(["explained/1"]) and "No rank reported an error" in str(error)
    # the likely causes, with no advice that fails (TORCH_DISTRIBUTED_DEBUG=DETAIL segfaults a 2-rank CPU fit on
    # torch 2.13, under strategy="ddp" too)
    assert "a collective waits 5 s" in str(error) and "self.log(..., sync_dist=True) on some ranks only" in str(error)
    assert "TORCH_DISTRIBUTED_DEBUG" not in str(error)
