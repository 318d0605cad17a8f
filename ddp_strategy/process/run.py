"""Step 1 for the strategy: this rank's part in one run's process group, from launch to teardown.

:class:`ProcessGroupRun` is the only thing :class:`~ddp_strategy.strategy.MyDDPStrategy` calls for processes:
it picks the launcher (:mod:`~ddp_strategy.process.launching`), joins the process group through a fresh
rendezvous (:mod:`~ddp_strategy.process.group`, :mod:`~ddp_strategy.process.rendezvous`), installs the
epoch-boundary checks and explains failures (:mod:`~ddp_strategy.process.failures`), and leaves the group at
teardown: kept for the user's code after a successful run, as under Lightning's ``ddp``, destroyed after a
failed one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ddp_strategy._compat import lightning_private as _pl
from ddp_strategy._compat.namespace import SIGTERMException, rank_zero_info
from ddp_strategy.process import boundaries, failures, group, launching, rendezvous

if TYPE_CHECKING:
    from lightning.fabric.plugins import ClusterEnvironment
    from lightning.pytorch import Trainer

log = logging.getLogger(__name__)

_FIT_CALLBACKS = (boundaries.EpochBoundaryCheck, boundaries.RequeueAtStepBoundary)


def _no_op() -> None:
    pass


def launched_ranks(launcher: Any) -> list[Any]:
    """The rank processes this process started (popen's rank 0: the script re-run per rank); else empty."""
    return launcher.procs if isinstance(launcher, _pl.SubprocessScriptLauncher) and launcher.procs else []


class ProcessGroupRun:
    """One rank's membership in the process group of the current run (a stage, a fit, a torchrun attempt).

    Args:
        timeout: how long a collective waits for the other ranks.
        barrier_timeout: how long the epoch-start ``monitored_barrier`` waits before naming missing ranks.
        init_method: ``None``/``"env://"``, ``"tcp://host:port"`` or ``"file:///path"``.
        store: a ready ``torch.distributed.Store``; takes precedence over ``init_method``.
    """

    def __init__(self, timeout: timedelta, barrier_timeout: timedelta, init_method: str | None = None,
                 store: dist.Store | None = None) -> None:
        self.timeout = timeout
        self.barrier_timeout = barrier_timeout
        self.init_method = init_method
        self.store = store
        #: The run's rendezvous store (failure reports go through it); None when not joined.
        self.rendezvous_store: dist.Store | None = None
        self.node_group: Any = None
        self.node_ranks: list[int] = []
        #: A gloo side group for ``monitored_barrier`` on other backends; None for gloo (the world is used).
        self.barrier_group: Any = None
        self._undo_gloo_loopback: Callable[[], None] = _no_op
        self._failed = False
        self._own_failure = False
        #: Whether on_exception stopped ranks this process had launched (the launcher's list is emptied then).
        self._stopped_launched = False

    @property
    def failed(self) -> bool:
        """Whether this run has failed (set by :meth:`on_exception`, cleared when the next run joins)."""
        return self._failed

    @staticmethod
    def make_launcher(strategy: Any, start_method: str, backend: str | None, allow_cpu_oversubscription: bool) -> Any:
        """Lightning's launcher for ``start_method``, after refusing what cannot work (in ``Trainer(...)``).

        ``"popen"`` is Lightning's ``_SubprocessScriptLauncher`` (the script re-run per rank); the others are
        its ``_MultiProcessingLauncher`` with our checks (:class:`launching.CheckedMultiProcessingLauncher`).

        Raises:
            ValueError: a backend the device cannot use (``"nccl"`` on CPU).
        """
        env, devices = strategy.cluster_environment, strategy.parallel_devices
        assert env is not None and devices
        group.resolve_backend(devices[0], backend)
        if devices[0].type == "cpu" and not env.creates_processes_externally:
            launching.check_cpu_processes(strategy.num_processes, allow_cpu_oversubscription)
        if start_method == "popen":
            return _pl.SubprocessScriptLauncher(env, strategy.num_processes, strategy.num_nodes)
        return launching.CheckedMultiProcessingLauncher(strategy, start_method=start_method)

    @staticmethod
    def check_world(env: ClusterEnvironment | None, num_nodes: int, num_processes: int) -> None:
        """Before the device is set up: an external launcher's world must match the Trainer's.

        Raises:
            ValueError: on every rank, naming the launch variable that disagrees
                (:func:`ddp_strategy.process.launching.check_external_world`).
        """
        assert env is not None
        launching.check_external_world(env, num_nodes, num_processes)

    def join(self, env: ClusterEnvironment, device: torch.device, backend: str | None, num_nodes: int,
             num_processes: int, launcher: Any, start_method: str) -> str:
        """Join a new rendezvous and create the world process group (every rank); return the backend used.

        Each call is a new rendezvous, kept apart from earlier ones; on one node gloo and the store listen on
        loopback only (:func:`ddp_strategy.process.group.init_process_group`).
        """
        backend = group.resolve_backend(device, backend)
        group.release_kept_process_group()
        self._failed = self._own_failure = self._stopped_launched = False
        rank, world_size = env.global_rank(), num_nodes * num_processes
        self._undo_gloo_loopback = rendezvous.gloo_on_loopback(num_nodes)
        self.rendezvous_store = group.init_process_group(
            backend, rank=rank, world_size=world_size, main_address=env.main_address, main_port=env.main_port,
            timeout=self.timeout, device=device, init_method=self.init_method, store=self.store, num_nodes=num_nodes)
        self.node_group, self.node_ranks = group.build_node_groups(num_nodes, num_processes)
        if isinstance(launcher, _pl.SubprocessScriptLauncher):
            launching.wait_for_ranks_at_exit(launcher.procs)
        failures.register_rank(self.rendezvous_store, rank)
        # monitored_barrier is gloo-only: NCCL jobs get a small gloo side group for it.
        self.barrier_group = None if backend == "gloo" else dist.new_group(backend="gloo")
        rank_zero_info(f"MyDDPStrategy: {world_size} processes, backend={backend}, start_method={start_method}")
        return backend

    def add_fit_callbacks(self, trainer: Trainer, rank: int, world_size: int) -> None:
        """Add the epoch-start rank check and the SLURM requeue at a step boundary (once each)."""
        if not any(isinstance(cb, boundaries.EpochBoundaryCheck) for cb in trainer.callbacks):
            trainer.callbacks.append(boundaries.EpochBoundaryCheck(self.barrier_group, self.barrier_timeout, rank,
                                                                 world_size))
        if not any(isinstance(cb, boundaries.RequeueAtStepBoundary) for cb in trainer.callbacks):
            trainer.callbacks.append(boundaries.RequeueAtStepBoundary(self.barrier_group, world_size))

    @staticmethod
    def remove_fit_callbacks(trainer: Trainer) -> None:
        """Remove what :meth:`add_fit_callbacks` added, restoring the signal handler it replaced."""
        for cb in trainer.callbacks:
            if isinstance(cb, boundaries.RequeueAtStepBoundary):
                cb.restore()
        trainer.callbacks[:] = [cb for cb in trainer.callbacks if not isinstance(cb, _FIT_CALLBACKS)]

    def on_exception(self, exception: BaseException, rank: int, world_size: int, known_cause: str | None,
                     sigterm_save: Callable[[], None] | None, launched: list[Any]) -> None:
        """Say which rank failed and why; save on SIGTERM if asked; stop the ranks this process launched.

        A rank whose own code raised publishes a summary (its peers name it); a rank whose collective broke
        adds which peer failed or vanished (or, for a timeout, the likely causes) to its message. No
        collective: other ranks may be gone.
        """
        self._failed = True
        grace_s = 5.0
        # This process stops the ranks it launched itself (below). Emptied in place, first, the list Lightning's
        # child-process observer watches (the launcher's) leaves it nothing to act on: otherwise, polling every
        # 5 s, it SIGKILLs this process when a child exits non-zero, at times before this rank's own error has
        # reached the user's code (an ``except``, a ``finally``, the traceback).
        procs, launched[:] = list(launched), []
        self._stopped_launched = self._stopped_launched or bool(procs)
        if isinstance(exception, SIGTERMException) and sigterm_save is not None:
            sigterm_save()
            grace_s = 30.0  # the other ranks are exiting by themselves after the same save
        elif isinstance(exception, (KeyboardInterrupt, SIGTERMException)) or self.rendezvous_store is None:
            pass  # an interruption, or not a rank (the parent of spawned ranks) or one that never joined
        elif isinstance(exception, boundaries.StalledRankError):
            # Already names the missing ranks; log it now, before stopping the ranks: Lightning's popen observer
            # SIGKILLs this process within seconds of a child's exit, before the traceback would be printed.
            log.error("%s", exception)
        elif failures.is_collective_error(exception):
            peers = failures.describe_peers(self.rendezvous_store, rank, world_size)
            failures.augment_message(exception, failures.explain(exception, rank, peers, self.timeout, known_cause))
            log.error("[rank %d] %s", rank, exception)  # now: a launcher may stop this rank soon
            failures.acknowledge(self.rendezvous_store, rank)
        else:
            failures.report_failure(self.rendezvous_store, rank, exception)
            self._own_failure = True
        if procs:
            failures.stop_processes(procs, grace_s=grace_s)

    def leave(self, rank: int, world_size: int, launched_here: bool) -> None:
        """Leave the run: keep the group for the user's code after success, destroy it after a failure.

        As under Lightning's ``ddp``, ``torch.distributed`` still works after ``trainer.fit``: the group stays
        until the next run's rendezvous, the end of a spawned/forked rank, or interpreter exit
        (:func:`ddp_strategy.process.group.keep_process_group`). A rank whose own code failed waits briefly
        for its peers to explain the failure before its process exits.
        """
        store, self.rendezvous_store, self.barrier_group = self.rendezvous_store, None, None
        self.node_group, self.node_ranks = None, []
        if self._failed:
            # Released, and held by no forked child (a DataLoader worker), the group's connections close now: the
            # others' collectives break, and they explain; else they learn of the failure when this process exits.
            closed = group.destroy_process_group() and not failures.has_child_processes()
            if self._own_failure and not (launched_here or self._stopped_launched) and closed:
                failures.wait_for_peers(store, rank, world_size, failures.EXPLAIN_WAIT_S)
        else:
            group.keep_process_group()
        self._undo_gloo_loopback()
        self._undo_gloo_loopback = _no_op

