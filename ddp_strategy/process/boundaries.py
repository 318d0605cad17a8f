"""Checks at epoch and step boundaries while fitting: every rank arrives; SIGTERM, SLURM requeue stop all at one step.

:func:`add_fit_callbacks` and :func:`remove_fit_callbacks` put the two callbacks in and out of ``trainer.callbacks``;
:class:`StepRound` is the per-step agreement that the signals and the uneven inputs' join share, and the round
before every strategy collective while fitting (which tells a rank that the others went on, or made another one).
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from datetime import timedelta
from typing import Any, cast

import torch
import torch.distributed as dist

from ddp_strategy._compat import lightning_private as _pl
from ddp_strategy._compat import namespace as _namespace
from ddp_strategy.process.failures import StalledRankError

log = logging.getLogger(__name__)


class StepRound:
    """One fit's per-step agreement: at each training step's start, and again before its backward pass, every rank
    that takes the step starts one asynchronous all-reduce (MAX) of five flags, and the last result is read at the
    step's end, arrived long before: no store operation, no host-device sync. Under NCCL on the world group, a tensor on
    this rank's device: a tree all-reduce of 5 bytes (logarithmic latency) ahead of the step's gradient buckets; the
    step's stream does not wait for it: a side stream does, then copies the flags to pinned host memory, and the read
    waits for that copy alone (Lightning's ``ddp`` broadcasts and reads ``.item()`` per step instead, a host-device
    sync, Lightning-AI/pytorch-lightning#21487). Under gloo, a CPU tensor on the strategy's gloo side group (the world
    group's queue keeps to the gradient buckets), whose pairs connect on first use: the ring's neighbours.

    The strategy makes one, starts each round, and gives it to both parties that read it: :class:`SignalsAtStepBoundary`
    acts on ``signalled`` (this rank's SIGTERM and requeue flags, set until acted on), and the uneven inputs' join
    (``sampling.join``) reads whether every rank has the next batch (each rank's ``has_next``), so that it need not
    notify then. ``has_next`` and ``tail`` are the current batch's: set at its start, before its rounds
    (``batch_to_device``), and cleared where the training steps' stretch ends; in a ``tail`` step, which some ranks (out
    of data) only shadow, no round starts, and a flag raised there rides in the next round every rank takes."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """A fit starts or ends: no flag set, no round in flight (after a failure a peer may be gone: destroying the
        group ends an all-reduce left unread). No collective."""
        self.signalled = [0, 0]  #: this rank's SIGTERM and requeue flags
        self.has_next = False  #: this rank has a batch after the current one (set by sampling.join)
        self.tail = False  #: the current batch is one that some ranks only shadow (set by sampling.join)
        #: the rounds' group, device and world size, from the fit's set-up (``add_fit_callbacks``) to its end
        self.on: tuple[Any, torch.device, int] = (None, torch.device("cpu"), 1)
        self._sent: tuple[torch.Tensor, Any] | None = None

    def start(self, *_: Any) -> None:
        """At a training step's start (the strategy's ``training_step``: after the hooks that may end the epoch) and
        at the start of each backward pass that syncs gradients (a hook on the loss, from the strategy's
        ``pre_backward``; its gradient is ignored: a rank that skipped a collective the others make in the step meets
        their round there), on every rank that takes the step:
        :meth:`send` this step's flags, unless in a ``tail`` step (the batch's flags stay until the next batch's
        ``batch_to_device`` sets them, or the training steps' stretch ends: ``SignalsAtStepBoundary``)."""
        if not self.tail:  # (none after a SIGTERM stop: Lightning raises at the step's or epoch's end)
            self._sent = self.send()

    def send(self, kind: int = 0, timeout: timedelta | None = None) -> tuple[torch.Tensor, Any]:
        """Start the all-reduce (MAX) of ``[*signalled, not has_next, kind, 255 - kind]`` on :attr:`on`'s group and
        device (none with one rank), ending at ``timeout`` (default: the group's). ``kind`` is an index of
        :attr:`KINDS`: 0 in a step and at an epoch's start (:class:`EpochBoundaryCheck`), another before a strategy
        collective (:meth:`barrier`); where the maximum of ``kind`` is not the minimum (``255 -`` the last flag), the
        ranks' rounds differ: some rank made another collective, or went on. Returns what :meth:`received` reads."""
        group, device, world_size = self.on
        flags = torch.tensor(  # CUDA: copied from pinned memory, no host-device sync
            [*self.signalled, int(not self.has_next), kind, 255 - kind],
            dtype=torch.uint8,
            pin_memory=device.type == "cuda",
        ).to(device, non_blocking=True)
        group = dist.group.WORLD if group is None else group
        work = cast(Any, group).allreduce([flags], dist.ReduceOp.MAX, timeout) if world_size > 1 else None
        if work is not None and flags.is_cuda:
            with torch.cuda.stream(copier := torch.cuda.Stream(device)):  # (from torch's pool of streams)
                work.wait()  # this stream waits, not the step's
                flags.record_stream(copier)  # (its memory is not reused before the copy)
                flags, work = flags.to("cpu", non_blocking=True), copier.record_event()  # pinned
        return flags, work

    #: the ``kind`` of a round: a step's (its start, its backward pass), an epoch start's, the fit end's; the
    #: strategy's collectives' (:meth:`barrier`)
    KINDS = ("step", "barrier", "reduce", "broadcast", "all_gather")

    def barrier(self, rank: int, what: str, kind: str = "barrier", device_ids: list[int] | None = None) -> None:
        """Before a strategy collective (``kind``: a barrier, a reduce, a broadcast, an all_gather). While a fit runs
        (:attr:`on` set, more than one rank): a round of its kind (:meth:`send`, waited for), which every rank makes
        at the same point, but which meets another rank's other round if it did not make it: the next step's start
        or backward pass, an epoch's start, the fit's end, another collective. Else, for a barrier,
        ``dist.barrier(device_ids=device_ids)``, and nothing for the others. Collective.

        Raises:
            RuntimeError: ``[rank <rank>] <what>`` while another rank went on or made another collective, at once (it
                names this rank when this one leaves the group: :mod:`ddp_strategy.process.failures`), not at the
                collective timeout.
        """
        if self.on[2] == 1:  # one process, or outside a fit
            if kind == "barrier":
                dist.barrier(device_ids=device_ids)
            return
        flags = self.received(self.send(code := self.KINDS.index(kind)))
        if (high := int(flags[3])) != (low := 255 - int(flags[4])):  # the ranks' kinds differ
            other = low if high == code else high  # (another rank's: the highest or the lowest)
            did = (
                f"made another collective ({self.KINDS[other]}) here"
                if other
                else "went on (to its step's backward pass, its next epoch or the fit's end), which waits for this one"
            )
            raise RuntimeError(
                f"[rank {rank}] {what} while another rank {did}. Both must happen on every rank alike: a barrier"
                " (trainer.save_checkpoint, which writes on rank 0 alone), a reduce, broadcast or all_gather"
                " (self.log(..., sync_dist=True)) outside `if trainer.is_global_zero:`; an epoch's early end decided on"
                " every rank, by reducing the decision first (trainer.strategy.reduce_boolean_decision(decision,"
                " all=False)) or broadcasting one rank's (trainer.strategy.broadcast(decision, src=...))."
            )

    def received(self, sent: tuple[torch.Tensor, Any] | None = None) -> torch.Tensor:
        """The flags of ``sent`` (by default the last step's round), every rank's maximum: ``[SIGTERM, requeue, some
        rank lacks a next batch, the highest kind, 255 - the lowest]``, on the host, waited for (a step's round, sent
        in it, has arrived); ``[0, 0, 1, 0, 255]`` before the first. A round may be read again (the next epoch's
        first step reads the one before a tail): the signal flags are cleared in it once acted on, and a round whose
        ``has_next`` was read already carried a 1 (the epoch's last batch, or the batch before a tail)."""
        flags, work = sent or self._sent or (torch.tensor([0, 0, 1, 0, 255], dtype=torch.uint8), None)
        if isinstance(work, torch.cuda.Event):  # its wait() would make a stream wait, not the host
            work.synchronize()
        elif work is not None:
            work.wait()
        return flags


class EpochBoundaryCheck(_namespace.Callback):
    """At each training epoch's start and at the fit's end, on every rank: a gloo barrier on ``run``'s group (a
    ``ProcessGroupRun``: the world under ``gloo``, else its side group; looked up, not held) with its
    ``barrier_timeout``, then ``begin_epoch(trainer, end)`` (the uneven inputs' batch counts, or at the end a mark
    that pairs with them: ``sampling.UnevenInputs.begin_epoch``, which names a rank that ended the fit while others
    went on). Before the first batch and after the other callbacks' epoch start (or train end), so a rank that
    stalled between epochs is named (with one rank, a barrier of one). The barrier is gloo's own
    (``ProcessGroup.barrier``, torch's ``BarrierOptions`` carrying the timeout): a dissemination barrier, ``ceil(log2
    W)`` rounds in which each rank sends one empty message and receives one (Hensgen, Finkel and Manber, 1988), so no
    rank loops over the world (Lightning's ``monitored_barrier``: rank 0 exchanges with each rank in turn). Under
    gloo on the world group (its full mesh: no connection more); else on the strategy's gloo side group, whose pairs
    connect on first use (``process.group``): about ``2 log2 W`` peers per rank. Before it each rank counts the
    checks it reached in ``run.reports`` (a store ``add`` to its own key), which a timeout reads to name the ranks
    missing: the only loop over the world, on the failure path. Before the barrier each rank sends a round of
    ``step_round`` (:meth:`StepRound.send`, with the barrier's timeout, never read), which a strategy barrier, reduce
    or broadcast on a rank not here meets (a save on one rank at an epoch's end: named at once there). Per fit: one
    round, one barrier, one store ``add`` and one all-reduce of W integers per epoch, and one more of each at its end.

    Raises:
        StalledRankError: a rank did not reach the barrier in ``barrier_timeout``, named (a barrier broken sooner, by
            a peer that failed and left the group, raises gloo's error for :mod:`ddp_strategy.process.failures`).
    """

    def __init__(self, run: Any, gloo: bool, rank: int, begin_epoch: Any, step_round: StepRound) -> None:
        self.run, self.gloo, self.rank, self.begin, self.round = run, gloo, rank, begin_epoch, step_round

    def on_train_epoch_start(self, trainer: Any, pl_module: Any, end: bool = False) -> None:
        epoch, rank, start, timeout = trainer.current_epoch, self.rank, time.monotonic(), self.run.barrier_timeout
        reached = self.run.reports.add(f"checks/{rank}", 1)  # the checks this rank reached (the same on every rank)
        self.round.send(timeout=timeout)  # meets a barrier's round on a rank not here (a save)
        try:  # the group looked up, not held: a traceback holding it would keep its connections open on a failure
            # the timeout per operation: it ends on time, none left in flight (which would block teardown)
            cast(Any, dist.group.WORLD if self.gloo else self.run.barrier_group).barrier(timeout).wait()
        except RuntimeError as e:
            if time.monotonic() - start < 0.9 * timeout.total_seconds():
                raise  # a connection broke (a peer failed and left): failures.describe_peers names it
            missing = [r for r in range(trainer.world_size) if self.run.reports.add(f"checks/{r}", 0) < reached]
            raise StalledRankError(
                f"[rank {rank}] ranks {missing} did not reach"
                f" {'the end of the fit' if end else f'the start of training epoch {epoch}'}"
                f" within {timeout.total_seconds():.0f} s ({e}). Such a rank is stalled (an endless loop, a deadlocked"
                " DataLoader worker, slow storage) or has died."
            ) from e
        self.begin(trainer, end)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        """The same at the fit's end (before the fit-end diagnostics' all-reduce), where a rank that ended the fit
        alone (``trainer.should_stop`` after its epoch's last batch) meets the others' next epoch's start. The round
        is reset at teardown (``remove_fit_callbacks``)."""
        self.on_train_epoch_start(trainer, pl_module, end=True)


class SignalsAtStepBoundary(_namespace.Callback):
    """SIGTERM and Lightning's SLURM requeue signal, acted on at one step boundary on every rank, whichever got it.

    A signal sets a flag of ``step_round``. At each step's start and before its backward pass every rank starts that
    step's round (:class:`StepRound`, started by the strategy's ``training_step`` and ``pre_backward``), and at each
    step's end waits for the last (long done by then). Steps that only some ranks take send nothing: a flag raised in
    them goes in the next epoch's first round. No step's round starts at an epoch's end; only the check of a rank that
    ended its epoch early (:meth:`_check_not_alone`), which this callback, first among them, makes before any user
    callback's (a rank-0-only collective there, a progress bar reading ``trainer.progress_bar_metrics``, which syncs
    metrics, would wait for the other ranks while they wait in a round). So a signal during step ``s`` acts on every
    rank at the end of step ``s`` if it came before the step's backward pass, else of ``s + 1`` (the next epoch's first,
    after an epoch's last step or its tail; a validation run in between ends first), where a step is an optimizer step
    (``accumulate_grad_batches`` batches: a resume from its checkpoint is exact): SIGTERM sets
    ``trainer.received_sigterm``, Lightning raises ``SIGTERMException`` there (``checkpoint_on_sigterm`` saves); the
    requeue signal runs Lightning's handler (save, requeue)."""

    def __init__(self, step_round: StepRound) -> None:
        self.round, self._signal, self._stopping = step_round, cast("int | None", None), False

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        """Take over SIGTERM and (under SLURM auto-requeue) the requeue signal from Lightning (every rank). The round
        starts clean: the last fit's teardown reset it (:func:`remove_fit_callbacks`)."""
        self._rank, self._launcher = trainer.global_rank, trainer.strategy.launcher
        env = trainer.strategy.cluster_environment
        requeue_signal = getattr(env, "requeue_signal", None) if getattr(env, "auto_requeue", False) else None
        main = threading.current_thread() is threading.main_thread()
        if requeue_signal is not None and main and callable(handler := signal.getsignal(requeue_signal)):
            self._signal, self._lightning_handler = requeue_signal, cast(Any, handler)  # (set here only)
            signal.signal(requeue_signal, self._note)
        _pl.take_over_sigterm(trainer, self._note)  # Lightning's, if it handles SIGTERM (in the main thread)

    def _note(self, signum: int, frame: Any) -> None:
        log.info("[rank %d] received signal %d: acted on after the next training step", self._rank, signum)
        if signum == signal.SIGTERM and not self.round.signalled[0] and self._launcher is not None:
            self._launcher.kill(signum)  # as Lightning does: popen's rank 0 passes it on to the other ranks
        self.round.signalled[signum != signal.SIGTERM] = 1

    def _agree(self, trainer: Any) -> None:
        """Wait for the round sent last (every rank has sent the same number), act on its flags once. Collective."""
        flags = self.round.received()
        stop, requeue = flags[:2].tolist()
        flags[:2] = 0  # acted on (an epoch's end reads the last step's round again)
        if requeue:
            self.round.signalled[1] = 0
            self._lightning_handler(self._signal, None)
        if stop:
            self._stopping = True
            _pl.set_received_sigterm(trainer, True)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        """At the end of an accumulation window (every ``accumulate_grad_batches`` batches: an optimizer step; the
        epoch's end is :meth:`on_train_epoch_end`'s), act on the flags sent at this step's start (a collective,
        every rank). Not inside a window: its checkpoint could not hold the accumulated gradients. The test is the
        same on every rank (a rank's own last batch, in an uneven epoch, is not)."""
        if not (batch_idx + 1) % trainer.accumulate_grad_batches:
            self._agree(trainer)

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        """Act on the last step's flags (Lightning stops at the epoch's end on SIGTERM): a last window shorter than
        ``accumulate_grad_batches``. Collective, after :meth:`_check_not_alone`."""
        self._check_not_alone(trainer)
        self._agree(trainer)

    def _check_not_alone(self, trainer: Any) -> None:
        """On a rank that may have left the epoch's steps alone (a batch it did not step: its ``on_train_batch_start``
        returned -1, or it was None; ``trainer.should_stop`` before its last batch, which also validates at once):
        one more round (:meth:`StepRound.barrier`), which meets the step another rank took instead, if any. At the
        epoch's end and at a validation run's start, where the training steps' stretch ends (the
        batch's flags are cleared here: ``StepRound.start``).

        Raises:
            RuntimeError: on a rank that left alone, at once (the others, waiting for it in their step's gradient
                all-reduce, name it when it leaves the group: :mod:`ddp_strategy.process.failures`).
        """
        progress, self.round.has_next, self.round.tail = trainer.fit_loop.epoch_loop.batch_progress, False, False
        if progress.current.started < progress.current.processed or trainer.should_stop and not progress.is_last_batch:
            self.round.barrier(
                trainer.global_rank,
                f"ended training epoch {trainer.current_epoch} early, at batch_idx {progress.current.processed - 1}"
                " (here alone: on_train_batch_start returned -1, a batch was None, or trainer.should_stop was set)",
            )

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        self._check_not_alone(trainer)
        if self._stopping:  # the validation loop would stop at its first batch: it ends first
            _pl.set_received_sigterm(trainer, False)

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        if self._stopping:
            _pl.set_received_sigterm(trainer, True)

    def on_train_end(self, trainer: Any = None, pl_module: Any = None) -> None:
        """Give the requeue signal back to Lightning's handler if ours is still installed (Lightning restores the
        original at teardown). No collective; the round is reset at teardown (:func:`remove_fit_callbacks`), after
        the fit-end check (:meth:`EpochBoundaryCheck.on_train_end`)."""
        if self._signal is not None and signal.getsignal(self._signal) == self._note:  # (not again at teardown)
            signal.signal(self._signal, self._lightning_handler)


def add_fit_callbacks(
    trainer: Any, run: Any, rank: int, world_size: int, step_round: StepRound, begin: Any, first: int
) -> None:
    """Put the callbacks in ``trainer.callbacks`` (replacing earlier ones): the epoch check on ``run``'s barrier group
    (a ``ProcessGroupRun``), then ``begin(trainer, end)``, last; the signals, which read ``step_round`` (the fit's
    per-step round, :attr:`StepRound.on` set here), at index ``first``, before any of the user's: a rank that left the
    epoch alone must learn it before their epoch end, where a rank-0-only collective (a progress bar reading
    ``trainer.progress_bar_metrics`` syncs metrics that the other ranks sync later) would wait for the others while
    they wait in that round."""
    remove_fit_callbacks(trainer)
    # under gloo the barrier on the world group's full mesh, the round on the side group (apart from the gradient
    # buckets' queue), a CPU tensor; else the barrier on the (gloo) side group, the round on the world group
    gloo, side = dist.get_backend() == "gloo", run.barrier_group
    step_round.on = (
        (side, torch.device("cpu"), world_size) if gloo else (None, trainer.strategy.root_device, world_size)
    )
    trainer.callbacks.append(EpochBoundaryCheck(run, gloo, rank, begin, step_round))
    trainer.callbacks.insert(first, SignalsAtStepBoundary(step_round))


def remove_fit_callbacks(trainer: Any, *others: type) -> None:
    """Remove what :func:`add_fit_callbacks` added, giving the requeue signal back to Lightning's handler, and the
    callbacks of the ``others`` types (the strategy's own)."""
    for cb in trainer.callbacks:
        if isinstance(cb, SignalsAtStepBoundary):
            cb.on_train_end()
            cb.round.reset()  # a round in flight let go unread (after a failure a peer may be gone)
    trainer.callbacks[:] = [
        cb for cb in trainer.callbacks if not isinstance(cb, (EpochBoundaryCheck, SignalsAtStepBoundary, *others))
    ]
