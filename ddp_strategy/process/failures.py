"""When a rank fails: say which rank and why, on every rank, and end the job promptly.

A DDP job is only as alive as its slowest rank. When one rank raises, is killed or stalls, the others wait
in their next collective until the process-group timeout, and the error they finally print ("Connection
closed by peer", "Timed out") does not say which rank failed or why. This module keeps a little state in
the rendezvous store that every rank already shares:

* at start-up each rank writes its host and pid (``ddp_strategy/pid/<rank>``);
* a rank whose own code raised writes a one-line summary of its exception (``ddp_strategy/failed/<rank>``)
  before it exits, and logs ``[rank N] failed`` with its traceback;
* a rank whose collective broke reads those keys, checks which peer processes on its host are gone, and
  adds that to its error message.

Everything here is best-effort and bounded by short store timeouts: it runs while the job is failing.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import time
import traceback
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from ddp_strategy._compat import namespace as _namespace

if TYPE_CHECKING:
    from lightning.pytorch import Callback
else:  # built for the user's Lightning namespace on construction (see ddp_strategy._compat.namespace)
    Callback = _namespace.lightning_base("pytorch.callbacks:Callback")

log = logging.getLogger(__name__)


_PID_KEY = "ddp_strategy/pid/{rank}"
_FAILED_KEY = "ddp_strategy/failed/{rank}"
_EXPLAINED_KEY = "ddp_strategy/explained/{rank}"
#: How long a rank whose own code failed waits, after leaving the group, for the others to say why (seconds):
#: its exit is what Lightning's popen observer acts on by killing every rank, the explaining ones included.
EXPLAIN_WAIT_S = 10.0
#: How long a store operation may take while handling a failure (seconds).
STORE_TIMEOUT_S = 2.0
#: How long to wait for a peer whose connection broke to show up as exited (seconds).
PEER_EXIT_WAIT_S = 2.0
#: Substrings of collective errors that mean a peer is gone or did not answer (gloo, NCCL, c10d).
_PEER_ERROR_MARKERS = ("connection closed by peer", "connection reset by peer", "broken pipe", "timed out",
                       "timeout", "nccl", "gloo", "distbackenderror", "monitoredbarrier", "socket")
_TIMEOUT_MARKERS = ("timed out", "timeout")


def register_rank(store: dist.Store | None, rank: int) -> None:
    """Record this rank's host and pid in the store (every rank, once, after the rendezvous)."""
    if store is not None:
        store.set(_PID_KEY.format(rank=rank), f"{socket.gethostname()}:{os.getpid()}")


def is_collective_error(exception: BaseException) -> bool:
    """Whether ``exception`` looks like a broken or timed-out collective rather than this rank's own bug."""
    if isinstance(exception, getattr(dist, "DistError", ())):
        return True
    text = f"{type(exception).__name__}: {exception}".lower()
    return isinstance(exception, RuntimeError) and any(m in text for m in _PEER_ERROR_MARKERS)


def is_timeout(exception: BaseException) -> bool:
    """Whether ``exception`` is a collective that timed out."""
    return any(m in str(exception).lower() for m in _TIMEOUT_MARKERS)


def summarize(exception: BaseException) -> str:
    """``Type: message (file:line in function)`` for the innermost frame of ``exception``."""
    frames = traceback.extract_tb(exception.__traceback__)
    where = f" ({frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name})" if frames else ""
    first_line = str(exception).splitlines()[0] if str(exception) else ""
    return f"{type(exception).__name__}: {first_line}{where}"


def report_failure(store: dist.Store | None, rank: int, exception: BaseException) -> None:
    """Publish that this rank's own code failed, and log it with the traceback (best-effort, bounded)."""
    log.error("[rank %d] failed: %s", rank, summarize(exception),
              exc_info=(type(exception), exception, exception.__traceback__))
    if store is None:
        return
    try:
        store.set_timeout(timedelta(seconds=STORE_TIMEOUT_S))
        store.set(_FAILED_KEY.format(rank=rank), summarize(exception))
    except Exception as e:  # the store may live in a process that is already gone
        log.debug("[rank %d] could not publish the failure: %s", rank, e)


def acknowledge(store: dist.Store | None, rank: int) -> None:
    """Say (best-effort, bounded) that this rank has explained its collective error (see :func:`wait_for_peers`)."""
    if store is None:
        return
    try:
        store.set_timeout(timedelta(seconds=STORE_TIMEOUT_S))
        store.set(_EXPLAINED_KEY.format(rank=rank), "1")
    except Exception as e:  # the store may live in a process that is already gone
        log.debug("[rank %d] could not acknowledge: %s", rank, e)


def wait_for_peers(store: dist.Store | None, rank: int, world_size: int, timeout_s: float = EXPLAIN_WAIT_S) -> None:
    """On the rank whose own code failed, after it left the group: wait until every other rank has either
    explained its broken collective (:func:`acknowledge`), reported a failure of its own
    (:func:`report_failure`: it has nothing to explain) or, on this host, exited; at most ``timeout_s`` seconds.

    Its peers learn of the failure when their collective breaks, and say which rank failed and why; the failing
    rank's exit must not come first, or a launcher that kills every rank when one exits (Lightning's popen
    observer) would cut that explanation off. When every rank failed in its own code (the same bug on every
    rank, bad input checked on every rank), nobody is left to explain and nothing is waited for. Returns early
    when the store cannot be reached.
    """
    if store is None or world_size < 2:
        return
    host = socket.gethostname()
    waiting = [peer for peer in range(world_size) if peer != rank]
    deadline = time.monotonic() + timeout_s
    try:
        store.set_timeout(timedelta(seconds=STORE_TIMEOUT_S))
        while waiting and time.monotonic() < deadline:
            waiting = [peer for peer in waiting if not _peer_is_done(store, peer, host)]
            if waiting:
                time.sleep(0.05)
    except Exception as e:  # the store's server (rank 0) may be gone
        log.debug("[rank %d] stopped waiting for the other ranks: %s", rank, e)


def _peer_is_done(store: dist.Store, peer: int, host: str) -> bool:
    """Whether ``peer`` has explained, reported its own failure, or (on this host) exited."""
    if store.check([_EXPLAINED_KEY.format(rank=peer)]) or store.check([_FAILED_KEY.format(rank=peer)]):
        return True
    pid_key = _PID_KEY.format(rank=peer)
    if not store.check([pid_key]):
        return False
    peer_host, pid = store.get(pid_key).decode().rsplit(":", 1)
    return peer_host == host and _process_gone(int(pid))


def has_child_processes() -> bool:
    """Whether this process has a live child (``/proc``; ``True`` where it cannot tell).

    Forked children (DataLoader workers) hold copies of this process's sockets, gloo's connections to the other
    ranks among them: until they exit, destroying the process group does not close those connections.
    """
    me = os.getpid()
    try:
        entries = [e for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return True
    for entry in entries:
        try:
            fields = proc_stat(int(entry))
        except OSError:
            continue
        if int(fields[1]) == me and fields[0] not in "ZX":
            return True
    return False


def proc_stat(pid: int) -> list[str]:
    """The fields of ``/proc/<pid>/stat`` after the command name: ``[state, ppid, pgrp, ...]`` (Linux, proc(5)).

    Raises:
        OSError: no such process, or no ``/proc`` (FileNotFoundError among them).
    """
    with open(f"/proc/{pid}/stat") as f:
        stat = f.read()
    return stat[stat.rindex(")") + 2:].split()


def _process_gone(pid: int) -> bool:
    """True when ``pid`` does not exist or is a zombie (exited, not yet reaped)."""
    try:
        return proc_stat(pid)[0] in "ZX"
    except (FileNotFoundError, ProcessLookupError):
        return True
    except OSError:
        try:
            os.kill(pid, 0)
            return False
        except ProcessLookupError:
            return True
        except PermissionError:
            return False


def _process_gone_within(pid: int, seconds: float) -> bool:
    """Poll :func:`_process_gone` for up to ``seconds``: a killed peer closes its sockets (which is how we
    noticed) a moment before the kernel marks it exited."""
    deadline = time.monotonic() + seconds
    while not _process_gone(pid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


def describe_peers(store: dist.Store | None, rank: int, world_size: int) -> str:
    """Explain which other ranks failed or disappeared, from the store and this host's process table.

    Args:
        store: the rendezvous store (``None`` gives an empty answer).
        rank: this rank, left out of the answer.
        world_size: number of ranks.

    Returns:
        One sentence per rank that reported a failure or whose process on this host is gone, e.g.
        ``"rank 1 failed: ZeroDivisionError: division by zero (train.py:12 in training_step)"`` or
        ``"rank 1 (pid 4242) is no longer running: it was killed or crashed without a Python exception"``;
        ``""`` when nothing is known.
    """
    if store is None:
        return ""
    host = socket.gethostname()
    found: list[str] = []
    deadline = time.monotonic() + PEER_EXIT_WAIT_S  # shared by all peers
    try:
        store.set_timeout(timedelta(seconds=STORE_TIMEOUT_S))
        for peer in range(world_size):
            if peer == rank:
                continue
            failed_key = _FAILED_KEY.format(rank=peer)
            if store.check([failed_key]):
                found.append(f"rank {peer} failed: {store.get(failed_key).decode()}")
                continue
            pid_key = _PID_KEY.format(rank=peer)
            if store.check([pid_key]):
                peer_host, pid = store.get(pid_key).decode().rsplit(":", 1)
                if peer_host == host and _process_gone_within(int(pid), max(0.0, deadline - time.monotonic())):
                    found.append(f"rank {peer} (pid {pid}) is no longer running: it was killed or crashed without"
                                 " a Python exception")
    except Exception as e:  # the store's server (rank 0) may be gone too
        log.debug("[rank %d] could not read peer status: %s", rank, e)
        if rank != 0:
            found.append("rank 0, which holds the rendezvous store, is not answering: it probably failed first")
    return "; ".join(found)


def explain(exception: BaseException, rank: int, peers: str, timeout: timedelta, known_cause: str | None = None) -> str:
    """The sentence added to a collective error: which peers failed, or the likely causes of a timeout.

    ``known_cause`` is a cause the strategy knows for sure (uneven evaluation batch counts); it comes first
    and replaces the generic list of timeout causes.
    """
    parts = [f"[rank {rank}] a collective failed because another rank did not take part."]
    if known_cause:
        parts.append(known_cause)
    if peers:
        parts.append(f"Cause: {peers}.")
        if " failed: " in peers:
            parts.append("The failing rank's own traceback is printed above this one.")
    elif is_timeout(exception) and not known_cause:
        parts.append(
            f"No rank reported an error, and the collective timed out after {timeout.total_seconds():.0f} s: a"
            " rank is stalled (an endless loop, a deadlocked DataLoader worker, slow storage), or ranks called"
            " collectives in a different order or number (self.log(..., sync_dist=True) on some ranks only, an"
            " all_gather in a branch, uneven data with use_distributed_sampler=False). Set"
            " TORCH_DISTRIBUTED_DEBUG=DETAIL to have PyTorch check that collectives match."
        )
    elif not known_cause:
        parts.append("No rank reported an error: a peer process probably exited or lost its connection.")
    return " ".join(parts)


def augment_message(exception: BaseException, extra: str) -> None:
    """Append ``extra`` to ``exception``'s message, in place (the same object keeps propagating)."""
    if exception.args and isinstance(exception.args[0], str):
        exception.args = (f"{exception.args[0]}\n{extra}", *exception.args[1:])
    else:
        exception.args = (*exception.args, extra)


def stop_processes(procs: list[Any], grace_s: float = 5.0) -> None:
    """Wait up to ``grace_s`` seconds for child processes to exit, then SIGKILL the rest and reap them.

    Args:
        procs: ``subprocess.Popen`` or ``multiprocessing.Process`` objects (the launcher's ranks).
        grace_s: seconds to let them exit by themselves (they usually notice the failure at once).
    """
    deadline = time.monotonic() + grace_s
    for proc in procs:
        while _alive(proc) and time.monotonic() < deadline:
            time.sleep(0.05)
    for proc in procs:
        if _alive(proc):
            log.warning("stopping rank process %s, which did not exit after a failure", proc.pid)
            os.kill(proc.pid, signal.SIGKILL)
        _reap(proc)


def _alive(proc: Any) -> bool:
    return proc.poll() is None if hasattr(proc, "poll") else proc.is_alive()


def _reap(proc: Any) -> None:
    try:
        proc.wait(timeout=10) if hasattr(proc, "poll") else proc.join(timeout=10)
    except Exception as e:  # a process that will not die is reported, not waited on forever
        log.warning("rank process %s could not be reaped: %s", proc.pid, e)
