"""When a rank fails: the failing rank and its error are named on every rank within seconds, and the run ends.

A DDP job is only as alive as its slowest rank: when one rank raises, is killed or stalls, the others wait in
their next collective and finally print "Connection closed by peer" or "Timed out", which names nobody. The
protocol, on a few keys under this run's prefix of the world group's own store (``ddp_strategy/<torchrun
attempt>/<world size>/run_<g>/``: the runs of one process, which reuse the group, and torchrun's attempts stay
apart):

1. **Joining** (:func:`run_reports`), every rank writes ``pid/<rank>`` = ``host:pid``.
2. **A rank whose own code raised** (:func:`on_exception`: anything but a broken collective, an interruption, a
   stall or SIGTERM) logs ``[rank N] failed: Type: message (file:line in function)`` with its traceback and
   publishes that line as ``failed/<rank>``.
3. **A rank whose collective broke**, told by the exception's type and where it was raised, never by its words
   (:func:`describe_peers`), writes where it waited as ``explained/<rank>`` (:func:`position`: the collective, the
   Lightning hook, the user's line), then reads every peer's ``failed/<peer>``, ``explained/<peer>`` and, for a
   same-host peer, whether its pid exited (each polled until one is there, for up to :data:`PEER_EXIT_WAIT_S` in
   all); it appends ``Cause: rank 1 failed: ...`` or ``rank 1 (pid N) is no longer running``, or, nothing known,
   the likely causes and where the ranks whose collectives broke too waited (``ranks [0]: barrier in
   MyDDPStrategy.training_step, at train.py:84 in training_step; ranks [1]: _engine_run_backward in
   MyDDPStrategy.backward``: ranks that called collectives in a different order), to its own exception, and logs
   it.
4. **At teardown after a failure** (:func:`teardown`) the world group is destroyed, so the failing rank's
   connections close and its peers' collectives break now (step 3), not at the timeout; its store is kept
   (:data:`KEPT_STORES`) for the process's next run. A failing rank with no live ``multiprocessing`` children
   (DataLoader workers hold forked copies of the connections, so the peers learn only at its exit) then waits up
   to :data:`EXPLAIN_WAIT_S` until every peer explained, failed itself or exited: its exit is what the launchers'
   supervisors act on (popen's ``_compat.lightning_private.Supervisor`` SIGKILLs every rank if the launching
   process still runs 30 s after a rank exited non-zero, and stops at the launching process's exit the ranks still
   running 30 s later; spawn's ``ProcessContext.join`` terminates them).

Every store operation while failing has a :data:`STORE_TIMEOUT_S` timeout: rank 0, which serves the store, may
be the rank that failed.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import multiprocessing
import os
import socket
import sysconfig
import time
import traceback
import weakref
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from ddp_strategy._compat import lightning_private as _pl
from ddp_strategy._compat import torch_private as _torch
from ddp_strategy._compat.namespace import SIGTERMException, pid_alive, rank_zero_info

log = logging.getLogger(__name__)

#: How long a failing rank waits, after leaving the group, for its peers to explain (seconds).
EXPLAIN_WAIT_S = 10.0
#: How long one store operation may take while failing (seconds).
STORE_TIMEOUT_S = 2.0
#: ``(pid, port) -> TCPStore``: the env:// rendezvous store of the group :func:`teardown` destroyed after a failure,
#: kept for the next run of this process (``group.init_process_group`` takes it): every rank rejoins the one store
#: rank 0 serves, under a new group prefix, instead of racing a new server against a closing one.
KEPT_STORES: dict[tuple[int, int], Any] = {}
#: How long a rank whose collective broke waits for a same-host peer to show up as exited (seconds): a killed
#: peer's sockets close a moment before the kernel marks it exited.
PEER_EXIT_WAIT_S = 2.0
#: An error whose innermost frame is in these torch folders was raised in a collective, or maybe (describe_peers).
_IN_COLLECTIVE, *_MAYBE = (
    os.path.join(os.path.dirname(os.path.dirname(dist.__file__)), *folder, "")
    for folder in (["distributed"], ["autograd"], ["nn", "parallel"])
)
#: ``file:function`` of the waits for a round (``boundaries.StepRound.received``) and for the epoch barrier
#: (``boundaries.EpochBoundaryCheck.on_train_epoch_start``, which raises its own StalledRankError): collectives.
_OUR_WAITS = tuple(
    os.path.join(os.path.dirname(__file__), f"boundaries.py:{f}") for f in ("received", "on_train_epoch_start")
)

#: Where library code lives (the standard library, installed packages, this package): a frame elsewhere is the user's.
_LIBRARIES = (
    *{sysconfig.get_path(name) for name in ("stdlib", "purelib", "platlib")},
    os.path.dirname(os.path.dirname(__file__)),
)


class StalledRankError(RuntimeError):
    """A rank did not reach the epoch barrier (:mod:`~ddp_strategy.process.boundaries`) in time; named."""


def generation(store: dist.Store, world_size: int, kind: str) -> dist.PrefixStore:
    """``store`` under ``ddp_strategy/<torchrun attempt>/<world size>/<kind>_<g>``, ``g = (n - 1) // world_size``
    (``n``: this rank's ``add`` to the ``<kind>s`` counter): the same on every rank, as each generation (a group, a
    run) has collectives, so a store that outlives one gives the next fresh keys."""
    base = f"ddp_strategy/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{world_size}"
    return dist.PrefixStore(f"{base}/{kind}_{(store.add(f'{base}/{kind}s', 1) - 1) // world_size}", store)


def run_reports(rank: int, world_size: int) -> dist.Store:
    """Step 1, every rank: this run's :func:`generation` of the group's store, ``pid/<rank>`` written."""
    reports = generation(_torch.default_store(), world_size, "run")
    reports.set(f"pid/{rank}", f"{socket.gethostname()}:{os.getpid()}")
    return reports


def summarize(exception: BaseException) -> str:
    """``Type: message (file:line in function)`` for the innermost frame of ``exception``."""
    frames = traceback.extract_tb(exception.__traceback__)
    where = f" ({frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name})" if frames else ""
    return f"{type(exception).__name__}: {str(exception).splitlines()[0] if str(exception) else ''}{where}"


def position(exception: BaseException) -> str:
    """Where ``exception`` was raised, for the peers' messages: its innermost function, in the innermost Lightning
    hook (``_compat.lightning_private.hook_of``) and, where the user's code runs inside that hook, at its innermost
    line: ``all_reduce in MyDDPStrategy.training_step, at train.py:84 in training_step``."""
    found, frames = ["", ""], list(traceback.walk_tb(exception.__traceback__))
    for frame, line in frames:
        if hook := _pl.hook_of(frame):
            found = [f" in {hook}", ""]
        elif not frame.f_code.co_filename.startswith(_LIBRARIES):
            found[1] = f", at {os.path.basename(frame.f_code.co_filename)}:{line} in {frame.f_code.co_name}"
    return "".join([frames[-1][0].f_code.co_name, *found])


def on_exception(
    run: Any,
    exception: BaseException,
    rank: int,
    world_size: int,
    sigterm_save: Callable[[], None] | None,
    cause: str | None = None,
) -> None:
    """Steps 2 and 3 where ``exception`` was raised (no collective); ``sigterm_save``: the SIGTERM checkpoint (a
    collective: every rank got it); ``cause``: a likely cause the strategy knows of, for a broken collective."""
    run.failed, store = True, run.reports
    if isinstance(exception, SIGTERMException) and sigterm_save is not None:
        rank_zero_info(
            f"SIGTERM: saving a checkpoint to {getattr(sigterm_save, 'args', ('the checkpoint path',))[0]} before"
            " exiting; resume with fit(ckpt_path=...)"
        )
        sigterm_save()
    elif isinstance(exception, (KeyboardInterrupt, SIGTERMException)) or store is None:
        return  # an interruption, or not a rank (the parent of spawned ranks), or one that never joined
    elif (peers := describe_peers(exception, store, rank, world_size)) is not None:
        extra = explain(rank, peers, run.timeout, cause)
        exception.args = (
            (f"{exception.args[0]}\n{extra}", *exception.args[1:])
            if exception.args and isinstance(exception.args[0], str)
            else (*exception.args, extra)
        )
        log.error("[rank %d] %s", rank, exception)  # now: a launcher may stop this rank soon
    else:
        log.error(
            "[rank %d] failed: %s",
            rank,
            summarize(exception),
            exc_info=(type(exception), exception, exception.__traceback__),
        )
        _best_effort(store, rank, store.set, f"failed/{rank}", summarize(exception))
        # Its traceback's frames let go of their locals (the traceback itself stays): one holding the world group
        # (Lightning's LightningModule.all_gather) kept its connections open after the group's destruction, so the
        # peers waited out their timeout instead of naming this failure (found by a fresh-user tryout).
        traceback.clear_frames(exception.__traceback__)
        run.own_failure = not isinstance(exception, StalledRankError)  # (it names the ranks missing: not waited on)


def teardown(run: Any, rank: int, world_size: int) -> None:
    """Step 4 after a failed run; after a successful one the group stays (next stage, user). On every path the
    ``GLOO_SOCKET_IFNAME`` the join set is removed (a user's value was never replaced)."""
    store, run.reports = run.reports, None
    if run.ifname is not None and os.environ.get("GLOO_SOCKET_IFNAME") == run.ifname:
        del os.environ["GLOO_SOCKET_IFNAME"]
    if not run.failed and run.barrier_group is not None:  # (a failed run's is destroyed with the world group below)
        dist.destroy_process_group(run.barrier_group)
    # no reference to the group outlives the run
    run.node_group, run.barrier_group, run.ifname = None, None, None
    if not run.failed:
        return
    base = _torch.default_store() if dist.is_initialized() else None
    while isinstance(base, dist.PrefixStore):
        base = base.underlying_store
    KEPT_STORES.clear()  # one at most: an older failed run's store (another port) is let go
    if isinstance(base, dist.TCPStore):  # the next run of this process rejoins it: see KEPT_STORES
        KEPT_STORES[os.getpid(), base.port] = base
    # The group is destroyed, always; once released, the peers' collectives break now, and a rank whose own code
    # failed waits for their explanations (not with live DataLoader workers: they hold copies of its connections).
    if destroy_process_group() and run.own_failure and not multiprocessing.active_children() and store is not None:
        wait_for_peers(store, rank, world_size)


def collectives_allowed(trainer: Any) -> bool:
    """Whether a strategy collective (a barrier, a broadcast) may run now: a process group exists and ``trainer`` is
    not on the exception path of a fit that this rank stopped alone (Lightning's ``on_exception`` hooks, e.g.
    ``OnExceptionCheckpoint``'s save, after Ctrl-C or this rank's own error: its status ``"interrupted"``). There a
    peer may be mid-step, and the collective would meet that step's (gloo: "Received data size doesn't match", a
    native abort, or a wait until the timeout): none is made. An agreed SIGTERM stop (``trainer.received_sigterm``),
    where every rank is at the same step boundary, makes them."""
    return (
        dist.is_available()
        and dist.is_initialized()
        and (trainer is None or trainer.state.status != "interrupted" or trainer.received_sigterm)
    )


def destroy_process_group() -> bool:
    """Destroy the default process group, if any; return whether it is gone (False: something still holds it).
    Garbage is collected around it (also without a group: the fork path relies on it), else a reference cycle (a
    compiled DDP wrapper, an exception's frames) would hold the group, rank 0's store and ``MASTER_PORT``."""
    gc.collect()
    world = weakref.ref(dist.group.WORLD) if dist.is_initialized() else None
    if world is not None:
        _torch.release_world_defaults(world())  # a group made before Lightning was imported (Ray's) is held there
        dist.destroy_process_group()
    gc.collect()
    return world is None or world() is None


def _best_effort(store: dist.Store, rank: int, operation: Callable[..., Any], *args: Any) -> Any:
    """``operation(*args)`` on ``store`` with :data:`STORE_TIMEOUT_S`; None if the store is gone."""
    try:
        store.set_timeout(timedelta(seconds=STORE_TIMEOUT_S))
        return operation(*args)
    except Exception as e:  # the store lives in rank 0, which may be gone: None
        log.debug("[rank %d] store unreachable while failing: %s", rank, e)


def _peer(store: dist.Store, peer: int) -> tuple[str | None, str | None, int | None]:
    """What ``peer`` published: its failure summary, where its collective broke (:func:`position`), and the pid it
    had if it ran on this host and has exited (else None)."""
    failed, waited = (
        store.get(f"{key}/{peer}").decode() if store.check([f"{key}/{peer}"]) else None
        for key in ("failed", "explained")
    )
    host, _, pid = (store.get(f"pid/{peer}").decode() if store.check([f"pid/{peer}"]) else ":").rpartition(":")
    return failed, waited, int(pid) if host == socket.gethostname() and _gone(int(pid)) else None


def _gone(pid: int) -> bool:
    """Whether process ``pid`` has exited (a child of ours is left unreaped for its ``Popen``)."""
    with contextlib.suppress(ChildProcessError, AttributeError):  # not our child; no waitid (macOS)
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    return not pid_alive(pid)


def wait_for_peers(store: dist.Store, rank: int, world_size: int, timeout_s: float | None = None) -> None:
    """Wait until every other rank explained, failed itself or (on this host) exited; at most ``timeout_s``
    (default :data:`EXPLAIN_WAIT_S`) seconds, less if the store is gone."""
    deadline = time.monotonic() + (EXPLAIN_WAIT_S if timeout_s is None else timeout_s)
    waiting = [peer for peer in range(world_size) if peer != rank]

    while waiting and time.monotonic() < deadline:  # (None: the store is gone)
        waiting = _best_effort(store, rank, list, (peer for peer in waiting if not any(_peer(store, peer))))
        time.sleep(0.05 if waiting else 0)


def describe_peers(
    exception: BaseException, store: dist.Store, rank: int, world_size: int
) -> tuple[list[str], dict[str, list[int]]] | None:
    """Step 3, if ``exception`` broke in a collective (None if it is this rank's own failure): the causes (each peer
    that reported a failure or whose process on this host is gone) and where each rank whose collective broke too
    waited (:func:`position` -> ranks, this one's included, published as ``explained/<rank>`` before the peers are
    read, each until it published or exited, for at most :data:`PEER_EXIT_WAIT_S` in all; where this rank's own code
    failed, ``failed/<rank>`` follows, which the peers read first). In a collective: a ``DistError``
    (``DistBackendError``, ``DistNetworkError``, ``DistStoreError``) or an error raised in ``torch.distributed`` or in
    the wait for a round or the epoch barrier (:data:`_OUR_WAITS`; a round: a barrier's, while fitting); one raised
    in torch's autograd engine or DDP's module (DDP's gradient all-reduce fails the backward pass, its buffer
    broadcast the forward; gloo's errors are plain ``RuntimeError``) only if a peer failed, exited or broke too, as
    those frames raise a rank's own errors too (an in-place modification)."""
    where = "".join(f"{f.filename}:{f.name}" for f in traceback.extract_tb(exception.__traceback__)[-1:])  # innermost
    certain = not isinstance(exception, StalledRankError) and (
        isinstance(exception, dist.DistError) or where.startswith((_IN_COLLECTIVE, *_OUR_WAITS))
    )
    if not certain and not where.startswith(tuple(_MAYBE)):
        return None
    found: list[str] = []
    waits = {position(exception): [rank]}
    deadline = time.monotonic() + PEER_EXIT_WAIT_S  # shared by all peers

    def read() -> bool:  # True once every peer is read: the store answered
        store.set(f"explained/{rank}", next(iter(waits)))  # first: the peers read it (an own failure: failed/ too)
        for peer in (peer for peer in range(world_size) if peer != rank):
            while not any(state := _peer(store, peer)) and time.monotonic() < deadline:
                time.sleep(0.05)
            failed, waited, pid = state
            if failed or pid is not None:
                found.append(
                    f"rank {peer} failed: {failed}"
                    if failed
                    else f"rank {peer} (pid {pid}) is no longer running: it was killed or crashed without a Python"
                    " exception"
                )
            elif waited:
                waits.setdefault(waited, []).append(peer)
        return True

    if _best_effort(store, rank, read) is None and rank != 0:
        found.append("rank 0, which holds the rendezvous store, is not answering: it probably failed first")
    return (found, waits) if found or certain or len(waits) > 1 else None


def explain(
    rank: int, peers: tuple[list[str], dict[str, list[int]]], timeout: timedelta, cause: str | None = None
) -> str:
    """The sentence added to a collective error: ``cause`` (a likely one the strategy knows of), then the ``peers``
    (:func:`describe_peers`) that failed, or the likely causes and where the ranks whose collectives broke waited."""
    head = " ".join(filter(None, [f"[rank {rank}] a collective failed because another rank did not take part.", cause]))
    if peers[0]:
        failing = " The failing rank's own traceback is printed above this one." if " failed: " in peers[0][0] else ""
        return f"{head} Cause: {'; '.join(peers[0])}.{failing}"
    return (
        f"{head} No rank reported an error: a peer exited or lost its connection, or is stalled (an endless loop, a"
        f" deadlocked DataLoader worker, slow storage; a collective waits {timeout.total_seconds():.0f} s), or the"
        " ranks called collectives in a different order or number (self.log(..., sync_dist=True) on some ranks only,"
        " an all_gather in a branch). Where the ranks waited: "
        + "; ".join(f"ranks {sorted(ranks)}: {waited}" for waited, ranks in peers[1].items())
        + "."
    )
