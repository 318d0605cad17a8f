"""Uneven inputs: training and evaluating when the ranks' loaders yield different numbers of batches (docs/sampling.md).

Where the strategy does not shard the training loader (the user's shards, sampler or ``IterableDataset``), an
epoch's batch counts can differ or be unknown; each epoch's start gathers them (:meth:`UnevenInputs.begin_epoch`,
after the epoch barrier). ``uneven_inputs="stop"`` ends every rank's epoch with the first rank's last batch;
``"error"`` refuses; equal known counts (the strategy's own shards) cost nothing.

``"join"`` (default) runs the epoch in torch's generic join context manager
(``torch.distributed.algorithms.Join``), :class:`UnevenInputs` its ``Joinable`` and its own join hook. Whether
every rank has a next batch is known a step early (``is_last_batch``: Lightning's loop fetches one batch ahead of a
loader without a length; known counts are exact), so it rides in each batch's asynchronous round of the SIGTERM flags
on the gloo side group (``process.boundaries.StepRound``, which the strategy makes and both read), read at the next
step's start: while every
rank has one, steps make no blocking collective of their own (where a length is only a hint, or validation may
start at other batches on other ranks, each step notifies: :meth:`UnevenInputs.step_start`). At the step a rank
lacks, and in each step after, the ranks notify the join (the all-reduce of one number
``Join.notify_join_context`` makes), and a rank past its last batch enters ``Join.__exit__``, whose hook takes part
in the others' steps. ``Join([ddp])``, DDP's own join, cannot
serve: its hook shadows one DDP forward and backward per step, but a Lightning step makes collectives of its own
between them (``self.log(sync_dist=True)``, ``reduce_boolean_decision``, a checkpoint's barrier and broadcast)
that would meet the wrong collective on a rank out of data. So in a *tail* step (one that some ranks only shadow)
the active ranks announce each collective before making it, one message (an all-reduce, MAX, of ``5 + W``
integers) of a kind in :data:`_KINDS`, the one table both sides read: DDP's forward and gradient buckets (the calls
of DDP's own join hook, in two halves, since the step's own collectives come between), gathers (reductions and
torchmetrics' syncs: a rank out of data gives an empty tensor, the active ranks keep their own rows), barriers,
broadcasts from an active rank, a save's agreement; what a rank out of data cannot take part in (:data:`Refusal`)
raises :class:`UnevenInputsError` on every rank. What makes collectives of its own in a step (a
``ZeroRedundancyOptimizer``, SyncBatchNorm, a metric with ``dist_sync_on_step=True``) is refused at the epoch's start;
a collective that the user's code makes with ``torch.distributed`` directly in a tail step meets the join's message
instead: gloo aborts one rank, and the error of the rank left names that as the likely cause
(:attr:`UnevenInputs.failure_cause`). At the end every rank takes the longest rank's module and training state.
This rank's state in such an epoch is one :class:`_Epoch`.

An evaluation stage (validation, test, predict) whose loaders' counts differ or are unknown runs under the same
join (:meth:`UnevenInputs.begin_evaluation`), under every policy, its metrics' syncs routed through the join's
gather; it ends at the stage's epoch end, before its epoch-level values are reduced, and copies nothing.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from lightning_utilities.core.apply_func import apply_to_collection
from torch.distributed.algorithms import Join, Joinable, JoinHook
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import IterableDataset
from torchmetrics.utilities.distributed import gather_all_tensors

from ddp_strategy._compat import lightning_private as _pl
from ddp_strategy._compat import namespace as _namespace
from ddp_strategy._compat import torch_private as _tp
from ddp_strategy.process import agree_on_rank_zero_failure, boundaries
from ddp_strategy.sampling.loaders import flat_loaders

if TYPE_CHECKING:
    from lightning.pytorch import Callback
else:  # built for the user's Lightning namespace on construction (see ddp_strategy._compat.namespace)
    Callback = _namespace.lightning_base("pytorch.callbacks:Callback")

#: ``MyDDPStrategy(uneven_inputs=...)``'s values, the default first.
POLICIES = ("join", "stop", "error")
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
_OPS = {
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


#: The messages of a tail step, by kind (sent as its position, from 1; a rank out of data sends 0): what the active
#: ranks are about to do, with what a rank out of data does for it given the message's integers ``a, b, c``, and the
#: refusal when rank ``a``, the collective's source, is out of data (always, where it has nothing to do). ``"end"`` ends
#: the step, ``"refuse"`` raises ``Refusal`` number ``a``. Read by both sides, in :meth:`UnevenInputs._exchange`.
_KINDS = {
    "end": (None, None),
    "refuse": (None, None),
    "forward": (lambda u, a, b, c: _tp.shadow_ddp_forward(u.ddp), None),
    "backward": (lambda u, sync, b, c: sync and _tp.shadow_ddp_backward(u.ddp), None),
    "gather": (
        lambda u, ndim, dtype, c: gather_all_tensors(
            torch.zeros((0,) * ndim, dtype=_DTYPES[dtype], device=u.join_device)
        ),
        None,
    ),
    "barrier": (lambda u, a, b, c: dist.barrier(), None),
    "broadcast": (lambda u, src, b, c: dist.broadcast_object_list([None], src=src), Refusal.BROADCAST),
    "all_gather": (None, Refusal.ALL_GATHER),
    "validation": (None, Refusal.VALIDATION),
    "save": (
        lambda u, a, b, c: agree_on_rank_zero_failure(
            None, "saving a checkpoint", u._trainer.global_rank, u.join_device
        ),
        Refusal.SAVE,
    ),
}


class UnevenInputsError(RuntimeError):
    """Raised on every rank where ranks with different amounts of training data cannot go on together: a
    collective a rank without data cannot take part in (``uneven_inputs="join"``), or any unevenness under
    ``uneven_inputs="error"``. The message names the step, the ranks without data and what to do."""


def _unshadowed(trainer: Any) -> list[str]:
    """What makes collectives of its own in a training step, not through the strategy, so that a rank out of data
    cannot take part in them under the join, named: a ``ZeroRedundancyOptimizer`` (its step broadcasts each rank's
    shard), SyncBatchNorm layers (their forward all-reduces the batch statistics), torchmetrics metrics with
    ``dist_sync_on_step=True`` (their forward gathers every rank's state)."""
    found = [
        f"optimizer {i}, a ZeroRedundancyOptimizer"
        for i, optimizer in enumerate(trainer.optimizers)
        if isinstance(optimizer, ZeroRedundancyOptimizer)
    ]
    found += [
        f"the SyncBatchNorm layer {name!r}"
        for name, module in trainer.lightning_module.named_modules()
        if "SyncBatchNorm" in type(module).__name__
    ]
    found += [
        f"the metric {name!r}"
        for name, module in trainer.lightning_module.named_modules()
        if getattr(module, "dist_sync_on_step", False) is True
    ]
    return found


def _accumulation_message(trainer: Any, k: int, ranks: list[int]) -> str:
    """The error for ``accumulate_grad_batches=k`` whose accumulations ``ranks``' last batches end alone."""
    return (
        f"[rank {trainer.global_rank}] accumulate_grad_batches={k} on ranks with different numbers of"
        f" training batches (epoch {trainer.current_epoch}): the last batch of ranks {ranks} ends an"
        " accumulation (a gradient all-reduce) where the longer ranks accumulate on, so their all-reduces"
        f" cannot pair. Give every rank but the longest a multiple of {k} batches, or pass"
        " MyDDPStrategy(uneven_inputs='stop'), or accumulate_grad_batches=1."
    )


@dataclass
class _Epoch:
    """This rank's state in an epoch whose counts differ or are unknown (none in an even one)."""

    known: bool  #: every rank's count known at the start
    progress: Any  #: the loop's ``batch_progress`` (Lightning's: the steps counted, whether this is the last batch)
    join: Join | None = None  #: ``"join"``: torch's join context, entered at the start
    uncut: int | None = None  #: ``"stop"`` with known counts (cut at the start, no per-step work): the epoch's length
    seen: int = -1  #: the batch counter at the last step's start (each step starts once)
    ahead: bool = False  #: ``"join"``: a step's flag round may stand for the next step's notify (:meth:`step_start`)
    trained: int = 0  #: steps started
    tail: bool = False  #: in a step some ranks, out of data, only shadow
    synced: list[Any] | None = None  #: an evaluation's (None: a training epoch): the metrics it syncs (``gather``)
    outer: _Epoch | None = None  #: an evaluation's: the training epoch it interrupts (a validation run mid-epoch)


class UnevenInputs(Joinable, JoinHook):
    """One strategy's policy for training epochs whose ranks hold different numbers of batches (module docstring);
    under ``"join"`` the ``Joinable`` and its own join hook (on a rank out of data, one step of the others per
    ``main_hook``).

    Args:
        policy: ``"join"``, ``"stop"`` or ``"error"``.
        divide_by_initial_world_size: ``"join"``'s tail step divides its gradient sum by W (True, DDP's default for
            ``DistributedDataParallel.join``: a sample weighs ``1 / (W * B)`` in every step) or by its ranks.
        step_round: the fit's per-step round (``process.boundaries.StepRound``), shared with the signal checks: a
            training step reads whether every rank has it, and sets whether this rank has a next one and whether the
            step is a tail step.

    Raises:
        ValueError: an unknown policy. TypeError: ``divide_by_initial_world_size`` not a bool.
    """

    def __init__(self, policy: str, divide_by_initial_world_size: bool, step_round: boundaries.StepRound) -> None:
        super().__init__()
        if policy not in POLICIES:
            raise ValueError(
                f"MyDDPStrategy(uneven_inputs={policy!r}) is not one of {list(POLICIES)}: 'join' trains"
                " every batch of every rank, 'stop' ends the epoch at the shortest rank's last batch,"
                " 'error' refuses ranks with different numbers of batches."
            )
        if not isinstance(divide_by_initial_world_size, bool):
            raise TypeError(
                f"MyDDPStrategy(divide_by_initial_world_size=...) must be True or False, got"
                f" {divide_by_initial_world_size!r}."
            )
        self.policy, self.divide_by_initial_world_size = policy, divide_by_initial_world_size
        self.callback = _EpochEnd(self)  #: first among the callbacks: ends an uneven epoch or evaluation run
        self.epoch_start = _EpochStart(self)  #: after the epoch barrier's callback (2+ ranks): gathers the counts
        self._round = step_round
        self.epochs: dict[int, tuple[int, ...]] = {}  #: epoch whose counts differed -> batches each rank trained
        self._trainer: Any = None
        self._epoch: _Epoch | None = None

    @property
    def tail(self) -> bool:
        """Whether this rank is in a step that some ranks, out of data, only shadow."""
        return self._epoch is not None and self._epoch.tail

    @property
    def ddp(self) -> DistributedDataParallel:
        """The strategy's DDP wrapper (``sync.wrap`` wraps every module that fits)."""
        return self._trainer.strategy.model

    @property
    def join_device(self) -> torch.device:
        return self._trainer.strategy.root_device

    join_process_group = None  #: the world (torch's ``Joinable`` property, as a constant)

    @property
    def failure_cause(self) -> str | None:
        """For the failure report of a collective that breaks in an epoch or evaluation run under the join: the
        collective a user makes with ``torch.distributed`` directly, which the strategy does not see (in a tail step
        it meets the join's message; gloo aborts one rank, the others' collectives break). None outside such a run."""
        return (
            None
            if self._epoch is None or self._epoch.join is None
            else "A likely cause: the ranks hold different or unknown numbers of batches here (uneven inputs), and a"
            " rank out of data takes part in the others' steps only through the strategy's collectives, so a"
            " collective that a step or callback makes with torch.distributed directly meets the join's own message"
            ' instead (gloo aborts one rank: "Received data size doesn\'t match expected size"). Make it through'
            " self.log(..., sync_dist=True) or trainer.strategy.reduce, barrier or broadcast, or at the epoch's end,"
            " or pass MyDDPStrategy(uneven_inputs='stop'), or give every rank the same number of batches."
        )

    def join_hook(self, **kwargs: Any) -> JoinHook:
        return self

    def begin_epoch(self, trainer: Any) -> None:
        """At a training epoch's start, on every rank, after the epoch barrier: gather every rank's batch count
        (-1: unknown, as any ``IterableDataset``'s, whose length is only a hint; one all-reduce of W integers), and
        where they differ or are unknown, set the epoch up for the policy (not called with one rank).

        Raises:
            ValueError: known, unequal counts under ``"error"``, or under ``"join"`` with ``accumulate_grad_batches``
                not dividing a shorter rank's count (its last batch would sync gradients alone), or what a rank out of
                data cannot take part in (:func:`_unshadowed`), each named, with ``uneven_inputs="stop"``.
        """
        self._trainer, self._epoch = trainer, None
        unknown = trainer.num_training_batches == float("inf") or any(
            isinstance(getattr(dl, "dataset", None), IterableDataset) for dl in flat_loaders(trainer.train_dataloader)
        )
        counts = [c - 1 for c in self._flags(0 if unknown else int(trainer.num_training_batches) + 1)]
        if len(set(counts)) == 1 and -1 not in counts:
            return
        epoch, k, known = trainer.current_epoch, trainer.accumulate_grad_batches, -1 not in counts
        if self.policy == "error" and known:
            raise ValueError(
                f"[rank {trainer.global_rank}] ranks have different numbers of training batches in epoch {epoch}:"
                f" {dict(enumerate(counts))}, refused by MyDDPStrategy(uneven_inputs='error'). Pass uneven_inputs="
                "'join' (the default: every rank trains all its batches) or 'stop' (all stop at the fewest), let"
                " MyDDPStrategy shard the data (Trainer(use_distributed_sampler=True), the default), or make your"
                " shards hold the same number of batches."
            )
        if self.policy == "join" and known and any(c % k for c in counts if c < max(counts)):
            raise ValueError(
                _accumulation_message(trainer, k, [r for r, c in enumerate(counts) if c % k and c < max(counts)])
            )
        if self.policy == "join" and (unshadowed := _unshadowed(trainer)):
            raise ValueError(
                f"[rank {trainer.global_rank}] the ranks' numbers of training batches in epoch {epoch} differ or are"
                f" unknown ({dict(enumerate(counts))}; -1: a loader without a length, or an IterableDataset), and under"
                " MyDDPStrategy(uneven_inputs='join') a rank out of data takes part in the others' steps only through"
                f" the strategy's collectives, not in those that {', '.join(unshadowed)} make(s) in each step. Pass"
                " MyDDPStrategy(uneven_inputs='stop') (every rank stops at the shortest rank's last batch), or give"
                " every rank the same known number of batches (let MyDDPStrategy shard the data); a metric also works"
                " with dist_sync_on_step=False (compute it at the epoch's end), a BatchNorm without sync_batchnorm."
            )
        self._epoch = _Epoch(
            known,
            trainer.fit_loop.epoch_loop.batch_progress,
            Join([self]) if self.policy == "join" else None,
            uncut=trainer.num_training_batches if self.policy == "stop" and known else None,  # given back at the end
            ahead=(known or trainer.num_training_batches == float("inf"))  # else is_last_batch is a length's guess
            and (
                not trainer.enable_validation  # or the ranks validate at the same batches while all of them step:
                or (interval := getattr(trainer, "val_check_interval", None)) == 1.0  # (unset for a time interval)
                or isinstance(interval, int)
                and trainer.check_val_every_n_epoch is not None
            ),
        )
        if self._epoch.uncut is not None:  # "stop" on known counts: cut here, the next epoch is cut anew
            _pl.cut_epoch(trainer, min(counts))
            self.epochs[epoch] = (min(counts),) * len(counts)
        elif self._epoch.join is not None:
            self._epoch.join.__enter__()

    def step_start(self) -> None:
        """At a training step's start (``batch_to_device``, else ``training_step``), every rank with a batch, once.
        ``"join"``: read the next-batch flags of the last training batch's round (``process.boundaries.StepRound``),
        then tell this batch's round whether this rank has a next batch and whether the step is a tail step (no round
        then). The join's notify (one blocking all-reduce) instead where a rank lacks this step, in the epoch's first
        step, and in every step where the flags say nothing (each rank's says 1): a loader whose length is a hint (an
        ``IterableDataset``'s ``__len__``, or ``limit_train_batches`` on one: Lightning then fetches no batch ahead,
        and ``is_last_batch`` is the length's guess; known counts and a stream without a length are exact), or a
        validation run that may start at other batches on other ranks
        (``val_check_interval`` a fraction or a time, or an int counted across epochs,
        ``check_val_every_n_epoch=None``). With unknown counts and ``accumulate_grad_batches > 1``, one more.
        ``"stop"``/``"error"`` on unknown counts: one blocking all-reduce.

        Raises:
            UnevenInputsError: as the policy says; ranks validating at other batches; an accumulation a shorter
                rank's last batch ends alone. StopIteration: ``"stop"``, a rank has no batch: the epoch ends here.
        """
        epoch, trainer = self._epoch, self._trainer
        if (
            epoch is None
            or epoch.uncut is not None
            or trainer.training != (epoch.synced is None)
            or epoch.progress.total.completed == epoch.seen  # each step starts once
        ):
            return
        progress, k = epoch.progress, trainer.accumulate_grad_batches
        epoch.seen, epoch.trained = progress.total.completed, epoch.trained + 1
        if epoch.join is None:  # "stop" or "error" on unknown counts: 1 a batch, 2 the last one, 3 none (finish)
            flags = self._flags(1 + progress.is_last_batch)
            if len(set(flags)) > 1 and self.policy == "error":
                raise UnevenInputsError(
                    f"[rank {trainer.global_rank}] ranks {[r for r, f in enumerate(flags) if f >= 2]} reach the end"
                    f" of their training data at batch {progress.current.ready + 1} of epoch {trainer.current_epoch}"
                    " while the others have more (MyDDPStrategy(uneven_inputs='error')). Pass uneven_inputs='join'"
                    " (the default: every rank trains all its batches) or 'stop' (all stop there), or give every rank"
                    " the same number."
                )
            if len(set(flags)) > 1:  # "stop" ends the epoch with this batch (before it, where a rank had none)
                self.epochs[trainer.current_epoch] = (epoch.trained - (3 in flags),) * trainer.world_size
            if 3 in flags:
                raise StopIteration
            progress.is_last_batch = max(flags) >= 2
            return
        if epoch.tail:
            self._exchange("end")
        if not epoch.ahead or self._round.received()[2]:  # some rank may lack this batch (an evaluation's: unknown)
            stepping, work = self._notify(1)  # a rank that lacks this step is in Join.__exit__: it answers
            epoch.tail = stepping < trainer.world_size
            if epoch.tail and not self.divide_by_initial_world_size and trainer.training:
                _tp.set_gradient_divisor(self.ddp, work, False)
        if trainer.training:  # this batch's round
            self._round.has_next = epoch.ahead and not progress.is_last_batch
            self._round.tail = epoch.tail
        if k > 1 and not epoch.tail and not epoch.known and trainer.training:
            syncs = self._flags(1 + (progress.is_last_batch or (progress.current.ready + 1) % k == 0))
            if len(set(syncs)) > 1:
                raise UnevenInputsError(_accumulation_message(trainer, k, [r for r, f in enumerate(syncs) if f == 2]))

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
            if stepping + validating < trainer.world_size:
                self.refuse(Refusal.VALIDATION)
            raise UnevenInputsError(
                f"[rank {trainer.global_rank}] in training epoch {trainer.current_epoch}, {validating} rank(s) start a"
                f" validation run while {stepping} train a batch: Trainer(val_check_interval="
                f"{trainer.val_check_interval!r}) counts each rank's own batches, and the ranks hold different numbers"
                " (uneven inputs). Validate at the epoch's end (val_check_interval=1.0), or pass"
                " MyDDPStrategy(uneven_inputs='stop'), or give every rank the same number of batches."
            )
        return stepping, work

    def _flags(self, flag: int) -> list[int]:
        """One all-reduce (MAX) of every rank's small flag (this rank's ``flag``, at least 0); returns them by rank."""
        flags = torch.tensor(
            [flag if r == self._trainer.global_rank else 0 for r in range(self._trainer.world_size)],
            device=self.join_device,
        )
        dist.all_reduce(flags, dist.ReduceOp.MAX)
        return flags.tolist()

    def before_forward(self) -> None:
        """Before DDP's forward (``training_step``): notify if not yet; in a step with fewer ranks announce it."""
        self.step_start()
        if self.tail:
            _tp.set_ddp_join_mode(self.ddp, True)  # buffers from an active rank; whether the backward syncs: told
            self._exchange("forward")

    def before_backward(self) -> None:
        """Before a backward through DDP in a step with fewer ranks: announce its gradient all-reduce."""
        if self.tail:
            self._exchange("backward", self.ddp.require_backward_grad_sync)

    def announce(self, collective: str, src: int = 0) -> bool:
        """Before each strategy collective (and validation run): whether it is in a step with fewer ranks, where
        ``"barrier"``, ``"broadcast"`` (from ``src``) and ``"save"`` (a save's agreement) are announced, and
        ``"all_gather"`` and ``"validation"`` refused (they need every rank); a broadcast from a rank out of data or a
        save while rank 0 is raise :class:`UnevenInputsError` on every rank (a reduce announces itself, :meth:`reduce`).
        If this rank has finished its last batch (an evaluation's: its loop is out of batches, as at its epoch-level
        reductions, which Lightning makes before the epoch-end hooks), it first waits for the others (:meth:`finish`).
        """
        if (
            self._epoch is not None
            and self._epoch.join is not None
            and (
                self._epoch.progress.is_last_batch if self._epoch.synced is None else _pl.out_of_batches(self._trainer)
            )
            and self._epoch.progress.current.completed == self._epoch.progress.current.ready
        ):
            self.finish()
        if self.tail and collective in _KINDS:
            self._exchange(collective, src)
        return self.tail

    def reduce(self, tensor: torch.Tensor, group: Any, reduce_op: Any) -> torch.Tensor:
        """``strategy.reduce`` in a step with fewer ranks: in place, over the active ranks' tensors (:meth:`gather`:
        the ranks out of data give none), so a mean divides by their number."""
        name = (
            reduce_op.lower()
            if isinstance(reduce_op, str)
            else next((n for n in _OPS if reduce_op == getattr(dist.ReduceOp, n.upper(), None)), None)
        )
        return tensor.copy_(_OPS[name](torch.stack(self.gather(tensor, group, name)), 0))

    def gather(self, tensor: torch.Tensor, group: Any = None, op: str | None = "sum") -> list[torch.Tensor]:
        """Every rank's ``tensor`` (torchmetrics' ``gather_all_tensors``: shapes may differ), in a step with fewer
        ranks only the active ranks' (the ranks out of data give an empty one): :meth:`reduce`'s, and an evaluation's
        metric syncs (their ``dist_sync_fn``). A collective, on every rank.

        Raises:
            UnevenInputsError: in such a step, on every rank, for a process group other than the world, a dtype
                other than float, int or bool, or a reduction ``op`` other than sum, mean, max, min or product.
        """
        if self.tail and (group not in (None, dist.group.WORLD) or tensor.dtype not in _DTYPES or op not in _OPS):
            self.refuse(Refusal.OTHER)
        active = (
            self._exchange("gather", tensor.ndim, _DTYPES.index(tensor.dtype))[1]
            if self.tail
            else range(self._trainer.world_size)
        )
        return [row for r, row in enumerate(gather_all_tensors(tensor, group)) if r in active]

    def refuse(self, refusal: Refusal) -> None:
        """Raise :class:`UnevenInputsError` for ``refusal`` here and on the ranks out of data (one message).

        Raises:
            UnevenInputsError: always.
        """
        self._exchange("refuse", list(Refusal).index(refusal))

    def finish(self, evaluation: bool | None = None) -> None:
        """This rank's epoch (or evaluation run) is done: take part in the others' steps until all are
        (``Join.__exit__``); a training epoch's state copy follows. A collective unless the epoch was even. (A cut
        epoch gets its length back.) ``evaluation``: only an evaluation run's (True) or a training epoch's (False)."""
        epoch, trainer = self._epoch, self._trainer
        if epoch is None or evaluation is not None and evaluation != (epoch.synced is not None):
            return
        if epoch.uncut is not None:
            _pl.cut_epoch(trainer, epoch.uncut)
        elif epoch.join is None:  # "stop"/"error" on unknown counts; without a batch: answer the others' first step
            if epoch.seen == -1 and len(set(self._flags(3))) > 1:
                if self.policy == "error":
                    raise UnevenInputsError(
                        f"[rank {trainer.global_rank}] this rank has no training batch in epoch"
                        f" {trainer.current_epoch} while others have some (MyDDPStrategy(uneven_inputs='error'))."
                        " Pass uneven_inputs='join' or 'stop', or give every rank batches."
                    )
                self.epochs[trainer.current_epoch] = (0,) * trainer.world_size  # "stop": no rank trains one
        else:
            if epoch.tail:
                self._exchange("end")
            epoch.join.__exit__(None, None, None)
        self.abandon()

    def abandon(self) -> None:
        """After a failure, at teardown or its end: forget the epoch (an evaluation's gives its metrics their own sync
        back, and its place to the training epoch it interrupted). No collective."""
        for metric in getattr(self._epoch, "synced", None) or ():
            metric.dist_sync_fn = None
        self._epoch = self._epoch and self._epoch.outer

    def begin_evaluation(self, trainer: Any) -> None:
        """At an evaluation stage's start (validation, test, predict), on every rank, where its loaders' batch counts
        differ between ranks or are unknown (``LoaderSharding.agree_counts``): run it in torch's join as a training
        epoch under ``"join"`` runs (under every policy: an evaluation drops nothing), each step notified at its
        ``batch_to_device``, ended at the stage's epoch end (:class:`_EpochEnd`); meanwhile this module's torchmetrics
        metrics sync through :meth:`gather`. No collective."""
        self._trainer = trainer
        self._epoch = _Epoch(
            False,
            (
                trainer.fit_loop.epoch_loop.val_loop
                if trainer.state.fn == "fit"
                else getattr(trainer, f"{trainer.state.fn.value}_loop")
            ).batch_progress,
            Join([self]),
            synced=[m for m in trainer.lightning_module.modules() if getattr(m, "dist_sync_fn", False) is None],
            outer=self._epoch,
        )
        self._epoch.join.__enter__()
        for metric in self._epoch.synced:
            metric.dist_sync_fn = self.gather

    def main_hook(self) -> None:
        """``Join``'s main hook, on a rank out of data: the others' step, each message read and taken part in, to its
        end."""
        while self._exchange()[0] != "end":
            pass

    def post_hook(self, is_last_joiner: bool) -> None:
        """``Join``'s post-hook, on every rank: where the batch counts differ (some rank joined before the last),
        record them, and every rank takes the module (parameters, buffers) and training state of the highest rank
        that trained longest."""
        if self._epoch.synced is not None:  # an evaluation's: nothing to record or copy
            return
        trainer = self._trainer
        flags = self._flags(2 * self._epoch.trained + is_last_joiner)  # every rank's steps, and whether it was last
        _tp.set_gradient_divisor(self.ddp, None, True)  # the next epochs: DDP's own divisor and forward again
        _tp.set_ddp_join_mode(self.ddp, False)
        if all(f % 2 for f in flags):  # every rank was the last to join: equal counts
            return
        self.epochs[trainer.current_epoch] = tuple(f // 2 for f in flags)
        source, module = max(r for r, f in enumerate(flags) if f % 2), trainer.lightning_module
        _tp.broadcast_coalesced([t.detach() for t in (*module.parameters(), *module.buffers())], src=source)
        box = [
            apply_to_collection(_pl.training_state(trainer), torch.Tensor, torch.Tensor.cpu)
            if trainer.global_rank == source
            else None
        ]
        dist.broadcast_object_list(box, src=source)
        if trainer.global_rank != source:
            _pl.load_training_state(trainer, box[0])

    def _exchange(self, kind: str = "", a: int = 0, b: int = 0, c: int = 0) -> tuple[str, list[int]]:
        """One message of :data:`_KINDS` (an all-reduce, MAX, of ``[kind, a, b, c, batch, *active]``): the active
        ranks send it, the ranks out of data zeros, then every rank reads it alike: a refusal raises
        :class:`UnevenInputsError`, a rank out of data does its part. Returns the kind and the active ranks."""
        trainer = self._trainer
        message = torch.zeros(5 + trainer.world_size, dtype=torch.int64, device=self.join_device)
        if kind:
            message[:5] = torch.tensor([list(_KINDS).index(kind) + 1, a, b, c, self._epoch.progress.current.ready])
            message[5 + trainer.global_rank] = 1
        dist.all_reduce(message, dist.ReduceOp.MAX)
        code, a, b, c, batch, *mask = message.tolist()
        kind, active = list(_KINDS)[code - 1], [r for r, m in enumerate(mask) if m]
        shadow, refusal = _KINDS[kind]
        if kind == "refuse" or refusal is not None and (shadow is None or a not in active):
            stage = {"train": "training", "test": "test", "predict": "predict"}.get(trainer.state.stage, "validation")
            what, fix = (list(Refusal)[a] if kind == "refuse" else refusal).value
            raise UnevenInputsError(
                f"[rank {trainer.global_rank}] {stage} batch {batch} (batch_idx {batch - 1}) of epoch"
                f" {trainer.current_epoch} on ranks {active} makes {what}, in which ranks"
                f" {[r for r in range(trainer.world_size) if r not in active]}, out of {stage} data, cannot take"
                f" part (uneven inputs, MyDDPStrategy(uneven_inputs={self.policy!r})). Do: {fix};"
                + (
                    " or pass MyDDPStrategy(uneven_inputs='stop') (every rank stops at the shortest rank's last batch;"
                    " the others' later batches are not trained),"
                    if stage == "training"
                    else ""
                )
                + " or give every rank the same number of batches."
            )
        if shadow is not None and not mask[trainer.global_rank]:
            shadow(self, a, b, c)
        return kind, active


class _EpochEnd(Callback):
    """Ends this rank's part of an uneven epoch before anything after its last batch: validation or the epoch's
    end (put first among the callbacks; the strategy's collectives check too, :meth:`UnevenInputs.announce`)."""

    def __init__(self, uneven: UnevenInputs) -> None:
        self.uneven = uneven

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        """At a validation run's start: refused in a step with fewer ranks; mid-epoch, every rank must validate.
        After this rank's last batch the epoch ends first (:meth:`UnevenInputs.announce`)."""
        self.uneven.announce("validation")
        if self.uneven._epoch is not None and self.uneven._epoch.join is not None:
            self.uneven._notify(trainer.world_size + 1)

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        """At a training epoch's end, or an evaluation stage's (before its metrics are computed)."""
        self.uneven.finish(evaluation=not trainer.training)

    on_validation_epoch_end = on_test_epoch_end = on_predict_epoch_end = on_train_epoch_end

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        """Forget the last fit's counts."""
        self.uneven.epochs = {}

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        """Rank 0 logs, for the fit summary, the policy and the batches each rank trained in each uneven epoch."""
        if (u := self.uneven).epochs:
            rule = {
                "join": f"; a step's gradient sum divided by {'W' if u.divide_by_initial_world_size else 'its ranks'}",
                "stop": "; the longer ranks' later batches not trained",
            }.get(u.policy, "")
            _namespace.rank_zero_info(
                f"Uneven inputs (uneven_inputs={u.policy!r}{rule}): batches trained per rank, "
                + ", ".join(f"epoch {epoch}: {list(counts)}" for epoch, counts in u.epochs.items())
            )


class _EpochStart(Callback):
    """At each training epoch's start, after the epoch barrier (put after ``process.boundaries``' callbacks): the
    policy's part, :meth:`UnevenInputs.begin_epoch`."""

    def __init__(self, uneven: UnevenInputs) -> None:
        self.uneven = uneven

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        self.uneven.begin_epoch(trainer)
