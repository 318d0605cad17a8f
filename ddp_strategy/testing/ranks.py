"""Run a function on N CPU ranks (gloo) from a test, and get every rank's return value back (docs/testing.md).

Ranks fork from multiprocessing's ``forkserver``, which imports torch, Lightning and ``ddp_strategy`` once and
never starts torch's threads or a process group, so forking it copies no half-held lock (forking the test process
itself, which may have used torch's thread pools, could). Each rank has the caller's environment plus what
torchrun would set, is not daemonic (it may start DataLoader workers) and leads its own process group, SIGKILLed
when the call ends.
"""

from __future__ import annotations

import contextlib
import faulthandler
import math
import multiprocessing
import numbers
import os
import pickle
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from ddp_strategy.process import free_port

#: Imported once by the forkserver, so that ranks start from a warm parent.
PRELOAD = ("torch", "torch.distributed", "ddp_strategy")
#: How long ranks that did not fail may run on after a peer failed, before they are stopped (seconds): time for
#: a peer's collective to break and its error to be written.
FAILURE_GRACE_S = 10.0
#: How long ending the ranks may wait for them, and their descendants, to be gone (seconds).
END_WAIT_S = 5.0
#: The timeout of the process group a rank is given (``init_process_group=True``), seconds.
COLLECTIVE_TIMEOUT_S = 30.0
#: Variables of the cluster schedulers Lightning detects (SLURM, LSF/jsrun) that ranks do not inherit: a test run
#: inside a SLURM job would otherwise have a ``Trainer`` in the rank take the job's tasks for its ranks.
_SCHEDULER_PREFIXES = ("SLURM_", "LSB_", "JSM_NAMESPACE_")
_STACK_SIGNAL = signal.SIGUSR1


class RankError(AssertionError):
    """A rank raised, was killed, or did not finish in time; the message has each rank's traceback or stack.

    Attributes:
        reports: rank -> what that rank reported (its traceback, its stack at the deadline, or its exit code).
    """

    def __init__(self, message: str, reports: dict[int, str]) -> None:
        super().__init__(message)
        self.reports = reports


def _rank_main(
    rank: int,
    world_size: int,
    out: Path,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    init_process_group: bool,
    environ: dict[str, str],
    caller_start_method: str | None,
) -> None:
    """One rank: ``environ`` (the caller's environment plus the launch variables), the group if asked, ``fn``, its
    result."""
    os.setpgrp()  # the leader of its own process group: run_on_ranks ends it with everything it started
    # The rank's own children (DataLoader workers) start as the caller's would, as in a rank Lightning launches:
    # not by the start method that started the rank, which would start a fresh forkserver in each rank.
    multiprocessing.set_start_method(caller_start_method, force=True)
    os.environ.clear()
    os.environ.update(environ)  # the caller's environment now, not the forkserver's from when it started
    # faulthandler holds the file, and writes to it until exit
    faulthandler.register(_STACK_SIGNAL, file=open(out / f"stack_{rank}.txt", "w"), all_threads=True)  # noqa: SIM115
    code = 0
    try:
        if init_process_group:
            dist.init_process_group("gloo", timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))  # env://
        # read only after a 0 exit status, so never half-written
        (out / f"result_{rank}.pkl").write_bytes(pickle.dumps(fn(rank, world_size, *args, **kwargs)))
    except BaseException:  # noqa: BLE001 - everything a rank raises is reported to the test
        (out / f"error_{rank}.txt").write_text(traceback.format_exc())
        code = 1
        # os._exit below skips the shutdown of the rank's multiprocessing children (DataLoader workers), which hold
        # forked copies of its connections to the other ranks: stopped now, the others learn of the failure now,
        # not when the orphaned workers notice their parent is gone (up to 5 s later).
        for child in multiprocessing.active_children():
            child.kill()
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip atexit hooks a failed peer could block on


def run_on_ranks(
    fn: Callable[..., Any],
    world_size: int = 2,
    *,
    args: Sequence[Any] = (),
    kwargs: dict[str, Any] | None = None,
    timeout_s: float = 60.0,
    init_process_group: bool = True,
) -> list[Any]:
    """Call ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` CPU processes; return every rank's value.

    Args:
        fn: a module-level function (it is pickled to the ranks), run with the launch environment set and, by
            default, inside a process group; for a ``Trainer`` built inside ``fn`` pass
            ``init_process_group=False`` and ``Trainer(devices=world_size, ...)``: the strategy joins the ranks.
            Ranks start from a forkserver (module docstring).
        world_size: number of ranks, W (default 2).
        args, kwargs: extra arguments for ``fn`` (pickled).
        timeout_s: deadline for the whole run, seconds (default 60); past it every live rank's stack is dumped
            and the ranks are stopped, so a hang fails the test instead of blocking CI.
        init_process_group: create the default process group before ``fn`` (default True: gloo, a timeout of
            :data:`COLLECTIVE_TIMEOUT_S`), destroyed after it; for another backend or timeout pass False and call
            ``torch.distributed.init_process_group(backend, timeout=...)`` in ``fn`` (the launch variables are set).

    Returns:
        ``[value of rank 0, ..., value of rank W-1]``; values must be picklable.

    Raises:
        TypeError: ``fn`` or its arguments cannot be pickled (a lambda, a local function); ``args`` not a tuple or
            list, ``kwargs`` not a dict.
        ValueError: ``world_size`` not an int >= 1; ``timeout_s`` not a finite number > 0.
        RankError: a rank raised (its traceback is in the message), exited without a result, or the deadline
            passed (each live rank's stack is in the message). No rank, nor any process it started, is left.
    """
    # Refused before any rank starts: each would otherwise fail inside every rank or never end.
    if not isinstance(world_size, numbers.Integral) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"run_on_ranks needs an int world_size >= 1 (the number of ranks), got {world_size!r}.")
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, numbers.Real) or not 0 < timeout_s < math.inf:
        raise ValueError(
            f"run_on_ranks needs timeout_s as a finite number of seconds > 0, got {timeout_s!r}: the"
            " deadline is what turns a hang into a failed test with each rank's stack."
        )
    if isinstance(args, (str, bytes)) or not isinstance(args, Sequence):
        raise TypeError(
            f"run_on_ranks needs args as a tuple or list of fn's extra positional arguments, got"
            f" {args!r}: for one argument x pass args=(x,)."
        )
    if kwargs is not None and not isinstance(kwargs, Mapping):
        raise TypeError(f"run_on_ranks needs kwargs as a dict of fn's keyword arguments, got {kwargs!r}.")
    world_size, kwargs = int(world_size), dict(kwargs or {})
    try:
        pickle.dumps((fn, tuple(args), kwargs))
    except Exception as e:
        raise TypeError(
            f"run_on_ranks pickles {fn!r} and its arguments to the rank processes, which failed ({e});"
            " define the function at module level of an importable file (not a lambda or a nested"
            " function), and pass picklable arguments."
        ) from e
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))  # read only when the forkserver starts (at the first call)
    environ = {
        **{name: value for name, value in os.environ.items() if not name.startswith(_SCHEDULER_PREFIXES)},
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),  # Lightning's find_free_network_port: a port free a moment ago
        "WORLD_SIZE": str(world_size),
        "NODE_RANK": "0",
        "GROUP_RANK": "0",
        "LOCAL_WORLD_SIZE": str(world_size),
    }
    with tempfile.TemporaryDirectory(prefix="ddp_ranks_", ignore_cleanup_errors=True) as temporary:
        folder = Path(temporary)
        # Not daemonic: a daemonic process may not start children, and a rank may (DataLoader workers, a subprocess).
        procs = [
            ctx.Process(
                target=_rank_main,
                name=f"rank {rank}",
                daemon=False,
                args=(
                    rank,
                    world_size,
                    folder,
                    fn,
                    tuple(args),
                    kwargs,
                    init_process_group,
                    {**environ, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                    multiprocessing.get_start_method(True),
                ),
            )
            for rank in range(world_size)
        ]
        try:
            for proc in procs:
                proc.start()
            timed_out = _wait(procs, folder, time.monotonic() + timeout_s)
            return _collect(procs, folder, timed_out, timeout_s)
        finally:
            _end(procs)


def _end(procs: list[Any]) -> None:
    """SIGKILL each rank's process group and reap the ranks; return once none of those groups' processes is
    alive (zombies aside), or after :data:`END_WAIT_S`."""
    groups = [proc.pid for proc in procs if proc.pid is not None]
    for proc in procs:
        if proc.pid is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.kill()  # a rank that had not yet made its group; a no-op for one that has exited
            proc.join(END_WAIT_S)
    deadline = time.monotonic() + END_WAIT_S
    while time.monotonic() < deadline and any(_alive_in(entry, groups) for entry in Path("/proc").glob("[0-9]*")):
        time.sleep(0.02)


def _alive_in(process: Path, groups: list[int]) -> bool:
    """Whether the process of ``/proc/<pid>`` is alive and in one of the process ``groups``. Not
    ``os.killpg(pgid, 0)``: it succeeds for a zombie, and an orphan's zombie may wait for its reaper (proc(5))."""
    with contextlib.suppress(OSError):  # gone meanwhile: False
        stat = (process / "stat").read_text()
        state, _, group = stat[stat.rindex(")") + 2 :].split()[:3]
        return state != "Z" and int(group) in groups
    return False


def _wait(procs: list[Any], folder: Path, deadline: float) -> bool:
    """Wait until every rank exits, a failure's grace period ends, or the deadline; True if time ran out."""
    failed_at = None
    while any(p.is_alive() for p in procs):
        now = time.monotonic()
        if failed_at is None and (any(p.exitcode not in (None, 0) for p in procs) or any(folder.glob("error_*"))):
            failed_at = now
        if now > deadline or (failed_at is not None and now - failed_at > FAILURE_GRACE_S):
            for p in procs:
                if p.is_alive() and p.pid is not None:
                    os.kill(p.pid, _STACK_SIGNAL)
            time.sleep(1.0)  # faulthandler writes the stacks
            return failed_at is None
        time.sleep(0.02)
    return False


def _collect(procs: list[Any], folder: Path, timed_out: bool, timeout_s: float) -> list[Any]:
    """Every rank's result, or a :class:`RankError` with every rank's report."""
    reports: dict[int, str] = {}
    results: list[Any] = []
    for rank, proc in enumerate(procs):
        result, error, stack = folder / f"result_{rank}.pkl", folder / f"error_{rank}.txt", folder / f"stack_{rank}.txt"
        if result.exists() and proc.exitcode == 0:
            results.append(pickle.loads(result.read_bytes()))
        else:
            reports[rank] = (
                f"raised:\n{error.read_text()}"
                if error.exists()
                else f"still running; its stack:\n{stack.read_text() if stack.exists() else '(none)'}"
                if proc.is_alive()
                else f"exited with code {proc.exitcode} without a result (killed, os._exit, or it never"
                " reached fn: called from a script, run_on_ranks must be under"
                " `if __name__ == '__main__':`, because the ranks' parent imports the main module)"
            )
    if not reports:
        return results
    why = f"did not finish within {timeout_s:g} s" if timed_out else "failed"
    text = "\n".join(f"--- rank {rank} {report}" for rank, report in sorted(reports.items()))
    raise RankError(f"run_on_ranks: {len(reports)} of {len(procs)} ranks {why}.\n{text}", reports)
