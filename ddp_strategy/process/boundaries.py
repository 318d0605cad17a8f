"""Checks at epoch and step boundaries while fitting: every rank arrives; SIGTERM, SLURM requeue stop all at one step.

:func:`add_fit_callbacks` and :func:`remove_fit_callbacks` put the two callbacks in and out of ``trainer.callbacks``.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ddp_strategy._compat import lightning_private as _pl
from ddp_strategy._compat import namespace as _namespace
from ddp_strategy.process.failures import StalledRankError

if TYPE_CHECKING:
    from lightning.pytorch import Callback
else:  # this process's Lightning namespace (see ddp_strategy._compat.namespace)
    Callback = _namespace.get("pytorch.callbacks:Callback")

log = logging.getLogger(__name__)


class EpochBoundaryCheck(Callback):
    """At each training epoch's start, on every rank: a gloo ``monitored_barrier`` on ``group`` (``None``: the world),
    then ``then(trainer)`` (the strategy's: the uneven-inputs policy gathers the batch counts), once every rank is
    there. Before the data iterator exists and after the other callbacks' epoch start, so a rank that stalled
    between epochs is named; with one rank nothing is done.

    Raises:
        StalledRankError: a rank did not reach the barrier in ``timeout`` (a barrier broken sooner, by a peer that
            failed and left the group, raises gloo's error for :mod:`ddp_strategy.process.failures` to explain).
        ValueError: from ``then``.
    """

    def __init__(self, group: Any, timeout: timedelta, rank: int, world_size: int, then: Callable[[Any], None]) -> None:
        self.group, self.timeout, self.rank, self.world_size, self.then = group, timeout, rank, world_size, then

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        if self.world_size == 1:
            return
        epoch, rank, start = trainer.current_epoch, self.rank, time.monotonic()
        try:
            dist.monitored_barrier(group=self.group, timeout=self.timeout, wait_all_ranks=True)
        except RuntimeError as e:
            if time.monotonic() - start < 0.9 * self.timeout.total_seconds():
                raise  # a connection broke (a peer failed and left): failures.describe_peers names it
            raise StalledRankError(
                f"[rank {rank}] not every rank reached the start of training epoch {epoch} within"
                f" {self.timeout.total_seconds():.0f} s: {e}. That rank is stalled (an endless loop, a deadlocked"
                " DataLoader worker, slow storage) or has died."
            ) from e
        self.then(trainer)


class SignalsAtStepBoundary(Callback):
    """SIGTERM and Lightning's SLURM requeue signal, acted on at one step boundary on every rank, whichever got it.

    A signal sets a flag. At each batch's start every rank starts an asynchronous all-reduce (MAX) of its flags and
    of the uneven-inputs flag ``ahead()`` (CPU, on the gloo side ``group``: no world-group collective, no
    host-device sync; the one per-step round of both, :meth:`all_have_next`), and at each step's end waits for the
    one it started at that batch's start (long done by then). Steps that only some ranks take (``in_tail()`` on
    those) send nothing: a flag raised in them goes in the next epoch's first round (flags stay set until acted on).
    No round starts at an epoch's end: a rank-0-only collective in an earlier callback (a progress bar reading
    ``trainer.progress_bar_metrics``, which syncs metrics) would wait there for the other ranks while they wait in
    the round. So a signal during step ``s`` acts on every rank at the end of step ``s + 1`` (the next epoch's
    first, after an epoch's last step or its tail; a validation run in between ends first), where a step is an
    optimizer step (``accumulate_grad_batches`` batches: a resume from its checkpoint is exact): SIGTERM sets
    ``trainer.received_sigterm``, Lightning raises ``SIGTERMException`` there (``checkpoint_on_sigterm`` saves); the
    requeue signal runs Lightning's handler (save, requeue)."""

    def __init__(
        self,
        group: Any,
        world_size: int,
        in_tail: Callable[[], bool],
        ahead: Callable[[], int],
    ) -> None:
        self.group, self.world_size, self.in_tail, self._stopping = group, world_size, in_tail, False
        self.ahead = ahead
        self._signal: int | None = None
        self._lightning_handler = self._launcher = self._sent = None  # _sent: (the flags in flight, their work)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        """Take over SIGTERM and (under SLURM auto-requeue) the requeue signal from Lightning (every rank)."""
        self._flags, self._sent, self._stopping, self._rank = [0, 0], None, False, trainer.global_rank  # TERM, requeue
        self._launcher = trainer.strategy.launcher
        env = trainer.strategy.cluster_environment
        requeue_signal = getattr(env, "requeue_signal", None) if getattr(env, "auto_requeue", False) else None
        main = threading.current_thread() is threading.main_thread()
        handler = signal.getsignal(requeue_signal) if requeue_signal is not None and main else None
        if callable(handler):
            self._signal, self._lightning_handler = requeue_signal, handler
            signal.signal(requeue_signal, self._note)
        _pl.take_over_sigterm(trainer, self._note)  # Lightning's, if it handles SIGTERM (in the main thread)

    def _note(self, signum: int, frame: Any) -> None:
        log.info("[rank %d] received signal %d: acted on after the next training step", self._rank, signum)
        if signum == signal.SIGTERM and not self._flags[0] and self._launcher is not None:
            self._launcher.kill(signum)  # as Lightning does: popen's rank 0 passes it on to the other ranks
        self._flags[signum != signal.SIGTERM] = 1

    def _agree(self, trainer: Any) -> None:
        """Wait for the flags sent last (every rank has sent the same number), act on them once. Collective."""
        flags, work = self._sent or (torch.zeros(3), None)
        if work is not None:
            work.wait()
        stop, requeue = flags[:2].tolist()
        flags[:2] = 0  # acted on (an epoch's end reads the last step's round again)
        if requeue:
            self._flags[1] = 0
            self._lightning_handler(self._signal, None)
        if stop:
            self._stopping = True
            _pl.set_received_sigterm(trainer, True)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        """Send this batch's flags, unless in a step only some ranks take (a collective, every rank that takes it)."""
        if not self.in_tail():
            self._send()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        """At the end of an accumulation window (every ``accumulate_grad_batches`` batches: an optimizer step; the
        epoch's end is :meth:`on_train_epoch_end`'s), act on the flags sent at this batch's start (a collective,
        every rank). Not inside a window: its checkpoint could not hold the accumulated gradients. The test is the
        same on every rank (a rank's own last batch, in an uneven epoch, is not)."""
        if not (batch_idx + 1) % trainer.accumulate_grad_batches:
            self._agree(trainer)

    def all_have_next(self) -> bool:
        """At a training step's start, for the uneven inputs' join: whether the round sent at the last batch's start
        says that no rank's ``ahead()`` was 1 (every rank has this batch; False without a round). Waits for it (sent
        a step ago: done). No round is read twice: one is sent at each batch that every rank takes (and a stop on a
        signal ends the fit at that step); the last of an epoch, or of the steps before a tail, carries a 1."""
        flags, work = self._sent or (torch.ones(3), None)
        if work is not None:
            work.wait()
        return not flags[2]

    def _send(self) -> None:
        """Start the all-reduce of this rank's flags and ``ahead()`` (unless stopping); :meth:`_agree` and
        :meth:`all_have_next` wait for it. A requeue flag stays set until acted on."""
        if not self._stopping:
            flags = torch.tensor([*self._flags, self.ahead()], dtype=torch.uint8)
            work = dist.all_reduce(flags, dist.ReduceOp.MAX, self.group, async_op=True) if self.world_size > 1 else None
            self._sent = (flags, work)

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        """Act on the last step's flags (Lightning stops at the epoch's end on SIGTERM): a last window shorter than
        ``accumulate_grad_batches``. Collective."""
        self._agree(trainer)

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        if self._stopping:  # the validation loop would stop at its first batch: it ends first
            _pl.set_received_sigterm(trainer, False)

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        if self._stopping:
            _pl.set_received_sigterm(trainer, True)

    def on_train_end(self, trainer: Any = None, pl_module: Any = None) -> None:
        """Give the requeue signal back to Lightning's handler if ours is still installed (Lightning restores the
        original at teardown); let go of flags in flight unread (after a failure a peer may be gone; destroying the
        group ends the all-reduce). No collective."""
        if self._signal is not None and signal.getsignal(self._signal) == self._note:
            signal.signal(self._signal, self._lightning_handler)
        self._signal = self._lightning_handler = self._launcher = self._sent = None


def add_fit_callbacks(
    trainer: Any,
    run: Any,
    rank: int,
    world_size: int,
    first: Any,
    then: Callable[[Any], None],
    in_tail: Callable[[], bool],
    ahead: Callable[[], int],
) -> None:
    """Put both callbacks last in ``trainer.callbacks`` (replacing earlier ones), on ``run``'s barrier group (a
    ``ProcessGroupRun``), and ``first`` first; ``then(trainer)`` runs after each epoch's barrier, ``in_tail()`` says
    whether this rank is in a step only some ranks take, ``ahead()`` the uneven-inputs flag of each batch's round
    (``first``, ``then``, ``in_tail``, ``ahead``: the strategy's uneven-inputs policy's callback, epoch start, tail and
    flag; ``then`` is also given the signals callback, whose round it reads)."""
    remove_fit_callbacks(trainer, first)
    signals = SignalsAtStepBoundary(run.barrier_group, world_size, in_tail, ahead)
    trainer.callbacks[:] = [
        first,
        *trainer.callbacks,
        EpochBoundaryCheck(run.barrier_group, run.barrier_timeout, rank, world_size, lambda t: then(t, signals)),
        signals,
    ]


def remove_fit_callbacks(trainer: Any, first: Any) -> None:
    """Remove what :func:`add_fit_callbacks` added, giving the requeue signal back to Lightning's handler."""
    for cb in trainer.callbacks:
        if isinstance(cb, SignalsAtStepBoundary):
            cb.on_train_end()
    trainer.callbacks[:] = [
        cb
        for cb in trainer.callbacks
        if cb is not first and not isinstance(cb, (EpochBoundaryCheck, SignalsAtStepBoundary))
    ]
