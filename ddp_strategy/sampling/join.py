"""The join: steps that some ranks, out of data, only shadow (uneven inputs, docs/sampling.md).

A run of steps whose ranks hold different or unknown numbers of batches (a training epoch under
``uneven_inputs="join"``, :mod:`ddp_strategy.sampling.uneven`; an evaluation stage, :meth:`StepJoin.begin_evaluation`)
runs in torch's generic join context manager (``torch.distributed.algorithms.Join``), :class:`StepJoin` its
``Joinable`` and its own join hook. Each step starts with the join's notify (the all-reduce of one number
``Join.notify_join_context`` makes), unless the last training batch's round (``process.boundaries.StepRound``) says
that every rank has this batch; a rank past its last batch enters ``Join.__exit__``, whose hook takes part in the
others' steps until every rank is done. ``Join([ddp])``, DDP's own join, cannot serve: its hook shadows one DDP
forward and backward per step, but a Lightning step makes collectives of its own between them
(``self.log(sync_dist=True)``, ``reduce_boolean_decision``, a checkpoint's barrier and broadcast) that would meet the
wrong collective on a rank out of data.

So in a *tail* step (one that some ranks only shadow) the active ranks announce each collective the strategy makes
before making it: one message (an all-reduce, MAX, of ``4 + W`` integers) of a kind in :attr:`StepJoin.KINDS`, the
one table both sides read, with its shadow, the method a rank out of data runs for it: DDP's forward and gradient
buckets (the calls of DDP's own join hook, in two halves, since the step's own collectives come between), gathers
(reductions and torchmetrics' syncs: a rank out of data gives an empty tensor, the active ranks keep their own rows),
barriers (a checkpoint save's too), broadcasts from an active rank. What a rank out of data cannot take part in
(:data:`Refusal`) raises :class:`UnevenInputsError` on every rank. A collective that the user's code makes with
``torch.distributed`` directly in a tail step meets the join's message instead: gloo aborts one rank, and the error
of the rank left names that as the likely cause (:attr:`StepJoin.failure_cause`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, NamedTuple, cast

import torch
import torch.distributed as dist
from torch.distributed.algorithms import Join, Joinable, JoinHook
from torchmetrics.utilities.distributed import gather_all_tensors

from ddp_strategy._compat import lightning_private as _pl
from ddp_strategy._compat import torch_private as _tp
from ddp_strategy.process import boundaries

_DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
)
#: A reduction's name (``strategy.reduce``'s string or ``torch.distributed.ReduceOp`` name) -> the reduction over
#: the gathered rows of the ranks in a tail step.
_OPS: dict[str, Any] = {
    "sum": torch.sum,
    "mean": torch.mean,
    "avg": torch.mean,
    "max": torch.amax,
    "min": torch.amin,
    "product": torch.prod,
}


#: What a rank out of data cannot take part in, as ``(what, what to do)`` for :class:`UnevenInputsError`.
Refusal = enum.Enum(
    "Refusal",
    {
        "ALL_GATHER": (
            "an all_gather (self.all_gather, strategy.all_gather): a rank without data has no row to give",
            "gather at the epoch's end (on_train_epoch_end)",
        ),
        "BROADCAST": (
            "a broadcast from a rank that has no data left (ModelCheckpoint asks rank 0 whether the file exists"
            " before each save)",
            "broadcast from a rank that still trains, or give rank 0 the longest shard",
        ),
        "SAVE": (
            "a checkpoint save, which rank 0 writes (out of data, it holds an older state)",
            "save at the epoch's end (ModelCheckpoint without every_n_train_steps), or give rank 0 the longest shard",
        ),
        "OTHER": (
            "a collective on a process group other than the world, or a reduction other than sum, mean, max, min or"
            " product, or of a dtype other than float, int or bool",
            "move it to the epoch's end",
        ),
        "VALIDATION": (
            "a validation run (val_check_interval) in a step that not every rank reaches",
            "validate at the epoch's end (val_check_interval=1.0)",
        ),
    },
    module=__name__,
)


class UnevenInputsError(RuntimeError):
    """Raised on every rank where ranks with different amounts of training data cannot go on together: a
    collective a rank without data cannot take part in (``uneven_inputs="join"``), or any unevenness under
    ``uneven_inputs="error"``. The message names the step, the ranks without data and what to do."""


@dataclass
class _Run:
    """This rank's state in a run of steps whose ranks' counts differ or are unknown: a training epoch (``synced``
    None; under ``"stop"`` and ``"error"`` without a join) or an evaluation stage's."""

    progress: Any  #: the loop's ``batch_progress`` (Lightning's: the steps counted, whether this is the last batch)
    join: Join | None = None  #: torch's join context, entered at the start (None: ``"stop"``/``"error"``)
    ahead: bool = False  #: a training step's round may stand for the next step's notify (:meth:`StepJoin.join_step`)
    known: bool = False  #: a training epoch's: every rank's count was known at its start
    trained: int = 0  #: steps started
    tail: bool = False  #: in a step some ranks, out of data, only shadow
    synced: list[Any] | None = None  #: an evaluation's (None: a training epoch): the metrics it syncs (``gather``)
    outer: _Run | None = None  #: an evaluation's: the training epoch it interrupts (a validation run mid-epoch)


class _Message(NamedTuple):
    """A tail step's message as every rank reads it."""

    kind: str
    a: int  #: a broadcast's or save's source rank; a gather's number of dimensions; a refusal's number
    b: int  #: a gather's dtype (its index in ``_DTYPES``)
    batch: int  #: the active ranks' batch, from 1
    active: list[int]  #: the ranks that have this step's batch


class StepJoin(Joinable, JoinHook):
    """The join of the strategy's steps on uneven inputs (module docstring): torch's ``Joinable`` and its own join
    hook (on a rank out of data, one step of the others per ``main_hook``), holding this rank's current run.

    Args:
        divide_by_initial_world_size: a training tail step divides its gradient sum by W (True, DDP's default for
            ``DistributedDataParallel.join``: a sample weighs ``1 / (W * B)`` in every step) or by its ranks.
        step_round: the fit's per-step round (``process.boundaries.StepRound``): a training step reads whether every
            rank has it, and sets whether this rank has a next one and whether the step is a tail step.
    """

    def __init__(self, divide_by_initial_world_size: bool, step_round: boundaries.StepRound) -> None:
        super().__init__()
        self.divide_by_initial_world_size, self._round = divide_by_initial_world_size, step_round
        self._trainer: Any = None
        self._run: _Run | None = None

    def __deepcopy__(self, memo: dict) -> StepJoin:
        """Itself: a deep copy of a module whose metrics sync through :meth:`gather` (``copy.deepcopy(pl_module)``
        during a fit, an EMA callback's) copies the metrics, not the strategy's state (its groups cannot be)."""
        return self

    @property
    def tail(self) -> bool:
        """Whether this rank is in a step that some ranks, out of data, only shadow."""
        return self._run is not None and self._run.tail

    @property
    def ddp(self) -> torch.nn.parallel.DistributedDataParallel:
        """The strategy's DDP wrapper (``sync.wrap`` wraps every module that fits)."""
        return self._trainer.strategy.model

    @property
    def join_device(self) -> torch.device:
        return self._trainer.strategy.root_device

    join_process_group = None  #: the world (torch's ``Joinable`` property, as a constant)

    def join_hook(self, **kwargs: Any) -> JoinHook:
        return self

    @property
    def failure_cause(self) -> str | None:
        """For the failure report of a collective that breaks in a run under the join: the collective a user makes
        with ``torch.distributed`` directly, which the strategy does not see (in a tail step it meets the join's
        message; gloo aborts one rank, the others' collectives break). None outside such a run."""
        return (
            None
            if self._run is None or self._run.join is None
            else "A likely cause: the ranks hold different or unknown numbers of batches here (uneven inputs), and a"
            " rank out of data takes part in the others' steps only through the strategy's collectives, so a"
            " collective that a step or callback makes with torch.distributed directly meets the join's own message"
            ' instead (gloo aborts one rank: "Received data size doesn\'t match expected size"). Make it through'
            " self.log(..., sync_dist=True) or trainer.strategy.reduce, barrier or broadcast, or at the epoch's end,"
            " or pass MyDDPStrategy(uneven_inputs='stop'), or give every rank the same number of batches."
        )

    def begin_evaluation(self, trainer: Any) -> None:
        """At an evaluation stage's start (validation, test, predict), on every rank, where its loaders' batch counts
        differ between ranks or are unknown (``LoaderSharding.agree_counts``): run it under the join as a training
        epoch under ``"join"`` runs (under every policy: an evaluation drops nothing), each step notified at its
        ``batch_to_device``, ended at the stage's epoch end (``UnevenInputs.end_epoch``); meanwhile this module's
        torchmetrics metrics sync through :meth:`gather`. No collective."""
        self._trainer = trainer
        self._run = _Run(
            (
                trainer.fit_loop.epoch_loop.val_loop
                if trainer.state.fn == "fit"
                else getattr(trainer, f"{trainer.state.fn.value}_loop")
            ).batch_progress,
            Join([self]),
            synced=[m for m in trainer.lightning_module.modules() if getattr(m, "dist_sync_fn", False) is None],
            outer=self._run,
        )
        cast(Join, self._run.join).__enter__()
        for metric in cast(list[Any], self._run.synced):
            metric.dist_sync_fn = self.gather

    def join_step(self) -> None:
        """The join's part of a step's start in a run under the join (``UnevenInputs.step_start``, every rank with a
        batch): the last step's tail ends, then this step notifies the join (one blocking all-reduce; a rank that
        lacks this step is in ``Join.__exit__``: it answers), except where the last training batch's round says
        every rank has this batch (known counts, or a stream without a length, while the ranks validate at the same
        batches: Lightning's loop fetches one batch ahead, so ``is_last_batch`` is exact); a training step then tells
        its own round whether this rank has a next batch and whether the step is a tail step (no round then).

        Raises:
            UnevenInputsError: ranks validating at other batches (:meth:`_notify`).
        """
        run, trainer = cast(_Run, self._run), self._trainer  # a run under the join
        if run.tail:
            self._exchange("end")
        if not run.ahead or self._round.received()[2]:  # some rank may lack this batch
            stepping, work = self._notify(1)
            run.tail = stepping < trainer.world_size
            if run.tail and not self.divide_by_initial_world_size and trainer.training:
                _tp.set_gradient_divisor(self.ddp, work, False)
        if trainer.training:
            self._round.has_next = run.ahead and not run.progress.is_last_batch
            self._round.tail = run.tail

    def before_forward(self) -> None:
        """Before DDP's forward (``training_step``) in a tail step: announce it."""
        if self.tail:
            _tp.set_ddp_join_mode(self.ddp, True)  # buffers from an active rank; whether the backward syncs: told
            self._exchange("forward")

    def before_backward(self) -> None:
        """Before a backward through DDP that syncs gradients, in a tail step: announce its gradient all-reduce (one
        that does not, inside an accumulation window, makes no collective)."""
        if self.tail and self.ddp.require_backward_grad_sync:
            self._exchange("backward")

    def announce(self, collective: str, src: int = 0) -> bool:
        """Before each strategy collective, and at a validation run's start (``"validation"``): whether it is in a
        tail step, where ``"barrier"``, ``"broadcast"`` (from ``src``) and ``"save"`` (a checkpoint save's barrier)
        are announced, and ``"all_gather"`` and ``"validation"`` refused (they need every rank); a broadcast from a
        rank out of data or a save while rank 0 is raise :class:`UnevenInputsError` on every rank (a reduce announces
        itself, :meth:`reduce`). If this rank has finished its last batch (an evaluation's: its loop is out of batches,
        as at its epoch-level reductions, which Lightning makes before the epoch-end hooks), its run ends first
        (:meth:`finish`). A validation run under the join then notifies W + 1 on every rank (:meth:`_notify`: the
        ranks must validate at the same batches)."""
        run = self._run
        if (
            run is not None
            and run.join is not None
            and (run.progress.is_last_batch if run.synced is None else _pl.out_of_batches(self._trainer))
            and run.progress.current.completed == run.progress.current.ready
        ):
            self.finish()
        if self.tail and collective in self.KINDS:
            self._exchange(collective, src)
        if collective == "validation" and self._run is not None and self._run.join is not None:
            self._notify(self._trainer.world_size + 1)
        return self.tail

    def reduce(self, tensor: torch.Tensor, group: Any, reduce_op: Any) -> torch.Tensor:
        """``strategy.reduce`` in a tail step: in place, over the active ranks' tensors (:meth:`gather`: the ranks out
        of data give none), so a mean divides by their number."""
        name = (
            reduce_op.lower()
            if isinstance(reduce_op, str)
            else next((n for n in _OPS if reduce_op == getattr(dist.ReduceOp, n.upper(), None)), None)
        )
        rows = self.gather(tensor, group, name)  # first: it refuses, on every rank, a reduction it cannot shadow
        return tensor.copy_(_OPS[cast(str, name)](torch.stack(rows), 0))

    def gather(self, tensor: torch.Tensor, group: Any = None, op: str | None = "sum") -> list[torch.Tensor]:
        """Every rank's ``tensor`` (torchmetrics' ``gather_all_tensors``: shapes may differ), in a tail step only the
        active ranks' (the ranks out of data give an empty one): :meth:`reduce`'s, and the metric syncs of a fit or of
        an evaluation under the join (their ``dist_sync_fn``); outside a tail step, over the world, while fitting, the
        strategy's round first (``process.boundaries.StepRound.barrier``). A collective, on every rank.

        Raises:
            UnevenInputsError: in a tail step, on every rank, for a process group other than the world, a dtype
                other than float, int or bool, or a reduction ``op`` other than sum, mean, max, min or product.
        """
        if self.tail and (group not in (None, dist.group.WORLD) or tensor.dtype not in _DTYPES or op not in _OPS):
            self._exchange("refuse", list(Refusal).index(Refusal.OTHER))  # raises here and on the ranks out of data
        if not self.tail and group in (None, dist.group.WORLD):  # a metric synced on some ranks only: named at once
            self._round.barrier(dist.get_rank(), "synced a metric (a torchmetrics Metric's compute)", "all_gather")
        active = (
            self._exchange("gather", tensor.ndim, _DTYPES.index(tensor.dtype)).active
            if self.tail
            else range(dist.get_world_size(group))  # (the whole group; no trainer before a resumed fit's epoch)
        )
        return [row for r, row in enumerate(gather_all_tensors(tensor, group)) if r in active]

    def finish(self) -> None:
        """This rank's part of its run under the join is done: take part in the others' steps until all are
        (``Join.__exit__``, then the post-hook), and forget the run; after a training epoch, DDP's own divisor and
        forward again. A collective."""
        if self.tail:
            self._exchange("end")
        run = cast(_Run, self._run)  # a run under the join
        cast(Join, run.join).__exit__(None, None, None)
        if run.synced is None:
            _tp.set_gradient_divisor(self.ddp, None, True)
            _tp.set_ddp_join_mode(self.ddp, False)
        self.abandon()

    def abandon(self) -> None:
        """After a failure, at teardown or its end: forget the run (an evaluation's gives its metrics their own sync
        back, and its place to the training epoch it interrupted). No collective."""
        for metric in getattr(self._run, "synced", None) or ():
            metric.dist_sync_fn = None
        self._run = self._run and self._run.outer

    def main_hook(self) -> None:
        """``Join``'s main hook, on a rank out of data: the others' step, each message read and taken part in, to its
        end."""
        while self._exchange().kind != "end":
            pass

    def _notify(self, value: int) -> tuple[int, Any]:
        """One all-reduce of one number, the one ``Join.notify_join_context`` makes and ``Join.__exit__`` shadows
        with 0 on the ranks out of data: a step's (each rank 1) or a validation run's (each rank W + 1, so they are
        told apart). Returns the ranks stepping and the all-reduce's work (its sum: the divisor DDP may read).

        Raises:
            UnevenInputsError: on every rank, where some ranks validate while others train or are out of data
                (``val_check_interval`` on uneven counts; the refusal, where ranks are out of data).
        """
        trainer = self._trainer
        work = dist.all_reduce(torch.full((1,), float(value), device=self.join_device), async_op=True)
        validating, stepping = divmod(int(work.get_future().wait()[0].item()), trainer.world_size + 1)
        if 0 < validating < trainer.world_size:  # some ranks validate while the others train or are out of data
            if stepping + validating < trainer.world_size:  # some are out of data: raised there too
                self._exchange("refuse", list(Refusal).index(Refusal.VALIDATION))
            raise UnevenInputsError(
                f"[rank {trainer.global_rank}] in training epoch {trainer.current_epoch}, {validating} rank(s) start a"
                f" validation run while {stepping} train a batch: Trainer(val_check_interval="
                f"{trainer.val_check_interval!r}) counts each rank's own batches, and the ranks hold different numbers"
                " (uneven inputs). Validate at the epoch's end (val_check_interval=1.0), or pass"
                " MyDDPStrategy(uneven_inputs='stop'), or give every rank the same number of batches."
            )
        return stepping, work

    def _exchange(self, kind: str = "", a: int = 0, b: int = 0) -> _Message:
        """One message of :attr:`KINDS` (an all-reduce, MAX, of ``[kind, a, b, batch, *active]``): the active ranks
        send it, the ranks out of data zeros, then every rank reads it alike: a refusal raises
        :class:`UnevenInputsError`, a rank out of data runs the kind's shadow. Returns the message."""
        trainer = self._trainer
        sent = torch.zeros(4 + trainer.world_size, dtype=torch.int64, device=self.join_device)
        if kind:
            sent[:4] = torch.tensor(
                [list(self.KINDS).index(kind) + 1, a, b, cast(_Run, self._run).progress.current.ready]
            )
            sent[4 + trainer.global_rank] = 1
        dist.all_reduce(sent, dist.ReduceOp.MAX)
        code, a, b, batch, *mask = sent.tolist()
        message = _Message(list(self.KINDS)[code - 1], a, b, batch, [r for r, m in enumerate(mask) if m])
        shadow, refusal = self.KINDS[message.kind]
        if message.kind == "refuse" or refusal is not None and (shadow is None or a not in message.active):
            stage = {"train": "training", "test": "test", "predict": "predict"}.get(trainer.state.stage, "validation")
            what, fix = (list(Refusal)[a] if refusal is None else refusal).value  # "refuse" has none
            raise UnevenInputsError(
                f"[rank {trainer.global_rank}] {stage} batch {batch} (batch_idx {batch - 1}) of epoch"
                f" {trainer.current_epoch} on ranks {message.active} makes {what}, in which ranks"
                f" {[r for r in range(trainer.world_size) if r not in message.active]}, out of {stage} data, cannot"
                f" take part (uneven inputs). Do: {fix};"
                + (
                    " or pass MyDDPStrategy(uneven_inputs='stop') (every rank stops at the shortest rank's last batch;"
                    " the others' later batches are not trained),"
                    if stage == "training"
                    else ""
                )
                + " or give every rank the same number of batches."
            )
        if shadow is not None and not mask[trainer.global_rank]:
            shadow(self, message)
        return message

    def _shadow_forward(self, message: _Message) -> None:
        """DDP's forward in join mode on the active ranks: its bucket rebuild, buffer broadcast and sync flag, in the
        precision plugin's ``train_step_context`` as there (``"64-true"``, ``"bf16-true"``: the flag's dtype)."""
        with self._trainer.precision_plugin.train_step_context():
            _tp.shadow_ddp_forward(self.ddp)

    def _shadow_backward(self, message: _Message) -> None:
        """DDP's gradient all-reduce of the active ranks' backward, bucket by bucket, with zeros."""
        _tp.shadow_ddp_backward(self.ddp)

    def _shadow_gather(self, message: _Message) -> None:
        """A gather of an ``a``-dimensional tensor of dtype number ``b``: this rank gives an empty one."""
        gather_all_tensors(torch.zeros((0,) * message.a, dtype=_DTYPES[message.b], device=self.join_device))

    def _shadow_barrier(self, message: _Message) -> None:
        """``strategy.barrier()``, or a checkpoint save's (rank 0 writes; a failure there fails as under Lightning), as
        the strategy makes it (``process.boundaries.StepRound.barrier`` while fitting)."""
        self._round.barrier(self._trainer.global_rank, "waited in a barrier")

    def _shadow_broadcast(self, message: _Message) -> None:
        """A broadcast of a picklable object from active rank ``a``."""
        dist.broadcast_object_list([None], src=message.a)

    #: The messages of a tail step, by kind (sent as its position, from 1; a rank out of data sends 0): what the
    #: active ranks are about to do, with its shadow (what a rank out of data does for it), and the refusal when rank
    #: ``a``, the collective's source, is out of data (always, where it has no shadow). ``"end"`` ends the step,
    #: ``"refuse"`` raises ``Refusal`` number ``a``. Read by both sides, in :meth:`_exchange`.
    KINDS: dict[str, tuple[Any, Refusal | None]] = {
        "end": (None, None),
        "refuse": (None, None),
        "forward": (_shadow_forward, None),
        "backward": (_shadow_backward, None),
        "gather": (_shadow_gather, None),
        "barrier": (_shadow_barrier, None),
        "broadcast": (_shadow_broadcast, Refusal.BROADCAST),
        "save": (_shadow_barrier, Refusal.SAVE),
        "all_gather": (None, Refusal.ALL_GATHER),
        "validation": (None, Refusal.VALIDATION),
    }
