"""Checks at epoch and step boundaries while fitting: every rank arrives, and a SLURM requeue stops all at one step.

:func:`add_fit_callbacks` and :func:`remove_fit_callbacks` put the two callbacks in and out of ``trainer.callbacks``.
"""

from __future__ import annotations

import logging
import signal
import threading
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ddp_strategy._compat import namespace as _namespace
from ddp_strategy.process.failures import StalledRankError

if TYPE_CHECKING:
    from lightning.pytorch import Callback
else:  # built for the user's Lightning namespace on construction (see ddp_strategy._compat.namespace)
    Callback = _namespace.lightning_base("pytorch.callbacks:Callback")

log = logging.getLogger(__name__)


class EpochBoundaryCheck(Callback):
    """At each training epoch's start, on every rank: a gloo ``monitored_barrier`` on ``group`` (``None``: the world),
    then agree on the number of batches (different counts would pair DDP's all-reduces wrongly and hang). Before
    the data iterator exists, so a rank that stalled between epochs is named; with one rank nothing is done.

    Raises:
        StalledRankError: a rank did not reach the barrier in ``timeout``.
        ValueError: ranks have different numbers of training batches this epoch.
    """

    def __init__(self, group: Any, timeout: timedelta, rank: int, world_size: int) -> None:
        self.group, self.timeout, self.rank, self.world_size = group, timeout, rank, world_size

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        if self.world_size == 1:
            return
        epoch, rank = trainer.current_epoch, self.rank
        try:
            dist.monitored_barrier(group=self.group, timeout=self.timeout, wait_all_ranks=True)
        except RuntimeError as e:
            raise StalledRankError(
                f"[rank {rank}] not every rank reached the start of training epoch {epoch} within"
                f" {self.timeout.total_seconds():.0f} s: {e}. That rank is stalled (an endless loop, a deadlocked"
                " DataLoader worker, slow storage) or has died.") from e
        batches = trainer.num_training_batches
        counts: list[Any] = [None] * self.world_size
        dist.all_gather_object(counts, int(batches) if batches != float("inf") else -1, group=self.group)
        if len(set(counts)) > 1:
            raise ValueError(
                f"[rank {rank}] ranks have different numbers of training batches in epoch {epoch}:"
                f" {dict(enumerate(counts))}. DDP needs every rank to take the same number of steps. Let"
                " MyDDPStrategy shard the data (a map-style data set in a DataLoader, with"
                " Trainer(use_distributed_sampler=True), the default), or make the shards you give each rank (your"
                " own sampler, or your split under use_distributed_sampler=False) hold the same number of batches."
            )


class RequeueAtStepBoundary(Callback):
    """Runs Lightning's SLURM auto-requeue (its ``SIGUSR1`` handler) at a step boundary, on every rank at once.

    Lightning would save and requeue inside the handler, wherever each rank is; but saving is a collective here
    and a mid-step checkpoint does not resume exactly. So the signal only sets a flag; after every batch the ranks
    all-reduce it on the gloo ``group`` (only under ``auto_requeue``, and with more than one rank) and, if any rank
    got it, all run Lightning's handler: a step-boundary checkpoint that resumes exactly.
    """

    def __init__(self, group: Any, world_size: int) -> None:
        self.group, self.world_size = group, world_size
        self._signal: int | None = None
        self._lightning_handler: Any = None
        self._received = False

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        """Take over the requeue signal from Lightning's handler, if SLURM auto-requeue is on (every rank)."""
        env = trainer.strategy.cluster_environment
        requeue_signal = getattr(env, "requeue_signal", None) if getattr(env, "auto_requeue", False) else None
        main = threading.current_thread() is threading.main_thread()
        handler = signal.getsignal(requeue_signal) if requeue_signal is not None and main else None
        if callable(handler):
            self._signal, self._lightning_handler, self._received = requeue_signal, handler, False
            signal.signal(requeue_signal, self._note_signal)

    def _note_signal(self, signum: int, frame: Any) -> None:
        log.info("received signal %d: saving and requeueing after the current training step", signum)
        self._received = True

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        """Agree on the flag (a collective, every rank); if set anywhere, run Lightning's handler on every rank."""
        if self._lightning_handler is None:
            return
        flag = torch.tensor([int(self._received)])
        if self.world_size > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        if flag.item():
            self._received = False
            self._lightning_handler(self._signal, None)

    def on_train_end(self, trainer: Any = None, pl_module: Any = None) -> None:
        """Give the signal back to Lightning's handler if ours is still installed (Lightning restores the original
        at teardown). No collective."""
        if self._signal is not None and signal.getsignal(self._signal) == self._note_signal:
            signal.signal(self._signal, self._lightning_handler)
        self._signal = self._lightning_handler = None


def add_fit_callbacks(trainer: Any, run: Any, rank: int, world_size: int) -> None:
    """Add both callbacks to ``trainer.callbacks`` (once each), on ``run``'s barrier group (a ``ProcessGroupRun``)."""
    if not any(isinstance(cb, EpochBoundaryCheck) for cb in trainer.callbacks):
        trainer.callbacks.append(EpochBoundaryCheck(run.barrier_group, run.barrier_timeout, rank, world_size))
    if not any(isinstance(cb, RequeueAtStepBoundary) for cb in trainer.callbacks):
        trainer.callbacks.append(RequeueAtStepBoundary(run.barrier_group, world_size))


def remove_fit_callbacks(trainer: Any) -> None:
    """Remove what :func:`add_fit_callbacks` added, giving the requeue signal back to Lightning's handler."""
    for cb in trainer.callbacks:
        if isinstance(cb, RequeueAtStepBoundary):
            cb.on_train_end()
    trainer.callbacks[:] = [cb for cb in trainer.callbacks
                            if not isinstance(cb, (EpochBoundaryCheck, RequeueAtStepBoundary))]
