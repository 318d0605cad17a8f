"""Uneven inputs: training when the ranks' loaders yield different numbers of batches (docs/sampling.md).

Where the strategy does not shard the training loader (the user's shards, sampler or ``IterableDataset``), an
epoch's batch counts can differ or be unknown. ``uneven_inputs="join"`` (default) runs it in torch's generic join
context manager (``torch.distributed.algorithms.Join``), :class:`UnevenInputs` its ``Joinable``: each step's ranks
notify it (``Join.notify_join_context``: an all-reduce of one number); a rank past its last batch enters
``Join.__exit__``, whose hook (:class:`_Shadow`) takes part in each collective the others announce in a *tail*
step (an all-reduce, MAX, of ``5 + W`` integers): DDP's forward and gradient buckets (DDP's join-hook calls),
reductions with a neutral value, barriers, broadcasts from an active rank, a save's agreement; anything else
raises :class:`UnevenInputsError` on every rank. At the end every rank takes the longest rank's module and
training state. ``"stop"`` ends every rank's epoch with the first rank's last batch; ``"error"`` refuses. Equal
known counts (the strategy's own shards) cost nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NoReturn

import torch
import torch.distributed as dist
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor
from torch.distributed.algorithms import Join, Joinable, JoinHook
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import IterableDataset

from ddp_strategy._compat import lightning_private as _pl
from ddp_strategy._compat import namespace as _namespace
from ddp_strategy._compat import torch_private as _tp
from ddp_strategy._compat.namespace import rank_zero_info
from ddp_strategy.process import agree_on_rank_zero_failure

if TYPE_CHECKING:
    from lightning.pytorch import Callback
else:  # built for the user's Lightning namespace on construction (see ddp_strategy._compat.namespace)
    Callback = _namespace.lightning_base("pytorch.callbacks:Callback")

#: ``MyDDPStrategy(uneven_inputs=...)``'s values, the default first.
POLICIES = ("join", "stop", "error")
_END, _FORWARD, _BACKWARD, _REDUCE, _BARRIER, _BROADCAST, _AGREE, _REFUSE = range(1, 9)  # what comes next
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
_OPS = ("sum", "max", "min", "product")
#: What a joined rank cannot take part in (announced by its index).
_REFUSALS = (  # (what, what to do)
    (
        "an all_gather (self.all_gather, strategy.all_gather): a rank without data has no row to give",
        "gather at the epoch's end (on_train_epoch_end)",
    ),
    (
        "a broadcast from a rank that has no data left (ModelCheckpoint asks rank 0 whether the file exists before"
        " each save)",
        "broadcast from a rank that still trains, or give rank 0 the longest shard",
    ),
    (
        "a checkpoint save, which rank 0 writes (out of data, it holds an older state)",
        "save at the epoch's end (ModelCheckpoint without every_n_train_steps), or give rank 0 the longest shard",
    ),
    (
        "a collective on a process group other than the world, or a reduction other than sum, mean, max, min or"
        " product, or of a dtype other than float, int or bool",
        "move it to the epoch's end",
    ),
    (
        "a per-step sync a rank without data cannot shadow (a torchmetrics Metric with dist_sync_on_step=True, a"
        " SyncBatchNorm layer)",
        "sync metrics at the epoch's end (dist_sync_on_step=False), or drop sync_batchnorm",
    ),
    (
        "a validation run (val_check_interval) in a step that not every rank reaches",
        "validate at the epoch's end (val_check_interval=1.0)",
    ),
)


class UnevenInputsError(RuntimeError):
    """Raised on every rank where ranks with different amounts of training data cannot go on together: a
    collective a rank without data cannot take part in (``uneven_inputs="join"``), or any unevenness under
    ``uneven_inputs="error"``. The message names the step, the ranks without data and what to do."""


class UnevenInputs(Joinable):
    """One strategy's policy for training epochs whose ranks hold different numbers of batches (module docstring).

    Args:
        policy: ``"join"``, ``"stop"`` or ``"error"``.
        divide_by_initial_world_size: ``"join"``'s tail step divides its gradient sum by W (True, DDP's default for
            ``DistributedDataParallel.join``: a sample weighs ``1 / (W * B)`` in every step) or by its ranks.

    Raises:
        ValueError: an unknown policy. TypeError: ``divide_by_initial_world_size`` not a bool.
    """

    def __init__(self, policy: str = "join", divide_by_initial_world_size: bool = True) -> None:
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
        self.callback = _EpochEnd(self)  #: ends the join at the epoch's end, first among the callbacks
        self.epochs: dict[int, tuple[int, ...]] = {}  #: uneven epoch -> batches each rank trained
        self.tail = False  #: this rank is in a step that some ranks, out of data, only shadow
        self._trainer: Any = None
        self._mode: str | None = None  # "join", "flags" (stop/error on unknown counts) or None (nothing per step)
        self._join: Join | None = None
        self._seen, self._trained, self._n, self._work, self._uncut, self._known = -1, 0, 0, None, None, True

    @property
    def join_device(self) -> torch.device:
        return self._trainer.strategy.root_device

    @property
    def join_process_group(self) -> Any:
        return None  # the world

    def join_hook(self, **kwargs: Any) -> JoinHook:
        return _Shadow(self)

    def begin_epoch(self, trainer: Any, counts: list[int]) -> None:
        """At a training epoch's start, on every rank, with every rank's batch count (-1: unknown; any
        ``IterableDataset``'s, whose length is only a hint); no collective.

        Raises:
            ValueError: known, unequal counts under ``"error"``, or under ``"join"`` with ``accumulate_grad_batches``
                not dividing a shorter rank's count (its last batch would sync gradients alone).
        """
        self._trainer, self._mode, self.tail, self._seen, self._trained = trainer, None, False, -1, 0
        loaders = trainer.train_dataloader
        loaders = (
            loaders.values()
            if isinstance(loaders, dict)
            else loaders
            if isinstance(loaders, (list, tuple))
            else [loaders]
        )
        if any(isinstance(getattr(loader, "dataset", None), IterableDataset) for loader in loaders):
            counts = [-1] * len(counts)
        if len(set(counts)) == 1 and -1 not in counts:
            return
        epoch, rank, k, self._known = (
            trainer.current_epoch,
            trainer.global_rank,
            trainer.accumulate_grad_batches,
            -1 not in counts,
        )
        if self.policy == "error" and self._known:
            raise ValueError(
                f"[rank {rank}] ranks have different numbers of training batches in epoch {epoch}:"
                f" {dict(enumerate(counts))}, refused by MyDDPStrategy(uneven_inputs='error'). Pass uneven_inputs="
                "'join' (the default: every rank trains all its batches) or 'stop' (all stop at the fewest), let"
                " MyDDPStrategy shard the data (Trainer(use_distributed_sampler=True), the default), or make your"
                " shards hold the same number of batches."
            )
        if self.policy == "join" and self._known and any(c % k for c in counts if c < max(counts)):
            raise ValueError(self._accumulation_message([r for r, c in enumerate(counts) if c % k and c < max(counts)]))
        if self.policy == "stop" and self._known:
            self._uncut = trainer.num_training_batches  # given back at the epoch's end: the next one is cut anew
            _pl.cut_epoch(trainer, min(counts))
            self.epochs[epoch] = (min(counts),) * len(counts)
        elif self.policy == "join":
            self._mode, self._join = "join", Join([self])
            self._join.__enter__()
        else:
            self._mode = "flags"

    def step_start(self) -> None:
        """At a training step's start (``batch_to_device``, else ``training_step``), every rank with a batch, once:
        one all-reduce (a second under ``"join"`` with unknown counts and ``accumulate_grad_batches > 1``).

        Raises:
            UnevenInputsError: as the policy says; ranks validating at other batches; an accumulation a shorter
                rank's last batch ends alone. StopIteration: ``"stop"``, a rank has no batch: the epoch ends here.
        """
        trainer = self._trainer
        if self._mode is None or not trainer.training:
            return
        progress = trainer.fit_loop.epoch_loop.batch_progress
        if progress.total.completed == self._seen:
            return
        self._seen, self._trained = progress.total.completed, self._trained + 1
        strategy, k = trainer.strategy, trainer.accumulate_grad_batches
        if self._mode == "flags":
            flags = self._flags(1 + progress.is_last_batch)
            ended = [r for r, f in enumerate(flags) if f >= 2]
            if len(set(flags)) > 1 and self.policy == "error":
                raise UnevenInputsError(
                    f"[rank {strategy.global_rank}] ranks {ended} reach the end of their training data at batch"
                    f" {progress.current.ready + 1} of epoch {trainer.current_epoch} while the others have more"
                    " (MyDDPStrategy(uneven_inputs='error')). Pass uneven_inputs='join' (the default: every rank"
                    " trains all its batches) or 'stop' (all stop there), or give every rank the same number."
                )
            self._trained -= 3 in flags  # a rank had no batch: "stop" ends the epoch before this one
            self.epochs[trainer.current_epoch] = (self._trained,) * len(flags)
            if 3 in flags:
                raise StopIteration
            progress.is_last_batch = progress.is_last_batch or bool(ended)
            return
        if self.tail:
            self._exchange(_END)
        self._n, validating, work = self._notify()
        if validating:
            self._out_of_step(self._n, validating)
        if isinstance(strategy.model, DistributedDataParallel):
            _tp.set_gradient_divisor(strategy.model, work, self.divide_by_initial_world_size)
        self._work, self.tail = work, self._n < strategy.world_size
        if k > 1 and not self.tail and not self._known:
            syncs = self._flags(1 + (progress.is_last_batch or (progress.current.ready + 1) % k == 0))
            if len(set(syncs)) > 1:
                raise UnevenInputsError(self._accumulation_message([r for r, f in enumerate(syncs) if f == 2]))

    def _notify(self, validating: bool = False) -> tuple[int, int, Any]:
        """One all-reduce of one number: a step's (torch's ``Join.notify_join_context``, each rank 1) or a validation
        run's (each rank W + 1, so they are told apart); returns the ranks stepping, validating, and the step's work."""
        world_size = self._trainer.world_size
        if validating:
            total, work = torch.full((1,), float(world_size + 1), device=self.join_device), None
            dist.all_reduce(total)
        else:
            work = Join.notify_join_context(self)
            work.wait()
            total = work.get_future().value()[0]
        return int(total.item()) % (world_size + 1), int(total.item()) // (world_size + 1), work

    def _out_of_step(self, stepping: int, validating: int) -> NoReturn:
        """Some ranks validate while others train (``val_check_interval`` on uneven counts): raise on every rank."""
        if stepping + validating < self._trainer.world_size:
            self._exchange(_REFUSE, 5)
        raise UnevenInputsError(
            f"[rank {self._trainer.global_rank}] in training epoch {self._trainer.current_epoch}, {validating} rank(s)"
            f" start a validation run while {stepping} train a batch: Trainer(val_check_interval="
            f"{self._trainer.val_check_interval!r}) counts each rank's own batches, and the ranks hold different"
            " numbers (uneven inputs). Validate at the epoch's end (val_check_interval=1.0), or pass"
            " MyDDPStrategy(uneven_inputs='stop'), or give every rank the same number of batches."
        )

    def _flags(self, flag: int) -> list[int]:
        """One all-reduce (MAX) of every rank's small flag (this rank's ``flag``); returns them by rank."""
        strategy = self._trainer.strategy
        flags = torch.zeros(strategy.world_size, dtype=torch.int64, device=strategy.root_device)
        flags[strategy.global_rank] = flag
        dist.all_reduce(flags, dist.ReduceOp.MAX)
        return flags.tolist()

    def _accumulation_message(self, ranks: list[int]) -> str:
        trainer = self._trainer
        k = trainer.accumulate_grad_batches
        return (
            f"[rank {trainer.global_rank}] accumulate_grad_batches={k} on ranks with different numbers of"
            f" training batches (epoch {trainer.current_epoch}): the last batch of ranks {ranks} ends an"
            " accumulation (a gradient all-reduce) where the longer ranks accumulate on, so their all-reduces"
            f" cannot pair. Give every rank but the longest a multiple of {k} batches, or pass"
            " MyDDPStrategy(uneven_inputs='stop'), or accumulate_grad_batches=1."
        )

    def before_forward(self) -> None:
        """Before DDP's forward (``training_step``): notify if not yet; in a step with fewer ranks announce it."""
        self.step_start()
        if not self.tail:
            return
        module, model = self._trainer.lightning_module, self._trainer.strategy.model
        if any(
            getattr(m, "dist_sync_on_step", False) is True
            and hasattr(m, "compute")
            or "SyncBatchNorm" in type(m).__name__
            for m in module.modules()
        ):
            self.refuse(4)
        if isinstance(model, DistributedDataParallel):
            _tp.set_ddp_join_mode(model, True)  # buffers from an active rank; whether the backward syncs: told
            self._exchange(_FORWARD)

    def before_backward(self, model: Any) -> None:
        """Before a backward through DDP in a step with fewer ranks: announce its gradient all-reduce."""
        if self.tail and isinstance(model, DistributedDataParallel):
            self._exchange(_BACKWARD, model.require_backward_grad_sync)

    def tail_step(self) -> bool:
        """Called by each strategy collective: whether it is in a step with fewer ranks (then announced). If this
        rank has finished its last batch, it first waits for the others (:meth:`finish`)."""
        if self._join is not None:
            progress = self._trainer.fit_loop.epoch_loop.batch_progress
            if progress.is_last_batch and progress.current.completed == progress.current.ready:
                self.finish()
        return self.tail

    def reduce(self, tensor: Tensor, group: Any, reduce_op: Any) -> Tensor:
        """``strategy.reduce`` in a step with fewer ranks: in place, over the active ranks (a mean divides by
        their number); the joined ranks give a neutral value (0, 1, the dtype's lowest or highest)."""
        name = (
            reduce_op.lower()
            if isinstance(reduce_op, str)
            else next((n for n in _OPS if reduce_op == getattr(dist.ReduceOp, n.upper())), None)
        )
        op = "sum" if name in ("mean", "avg") else name
        if group not in (None, dist.group.WORLD) or op not in _OPS or tensor.dtype not in _DTYPES:
            self.refuse(3)
        self._exchange(_REDUCE, tensor.numel(), _DTYPES.index(tensor.dtype), _OPS.index(op))
        dist.all_reduce(tensor, getattr(dist.ReduceOp, op.upper()))
        return tensor.div_(self._n) if op != name else tensor

    def announce(self, collective: str, src: int = 0) -> None:
        """Called before the strategy's ``"barrier"``, ``"broadcast"`` (from ``src``), ``"save"`` (a save's
        agreement) and ``"all_gather"``: in a step with fewer ranks, announce it; ``"all_gather"``, a broadcast from
        a joined rank or a save while rank 0 has joined raise :class:`UnevenInputsError` on every rank."""
        if not self.tail_step():
            return
        if collective == "all_gather":
            self.refuse(0)
        kind = {"barrier": _BARRIER, "broadcast": _BROADCAST, "save": _AGREE}[collective]
        _, a, _, _, batch, active = self._exchange(kind, src)
        if kind in (_BROADCAST, _AGREE) and a not in active:
            raise UnevenInputsError(self._message(1 if kind == _BROADCAST else 2, batch, active))

    def refuse(self, reason: int) -> NoReturn:
        """Raise :class:`UnevenInputsError` for ``_REFUSALS[reason]`` here and on the joined ranks."""
        *_, batch, active = self._exchange(_REFUSE, reason)
        raise UnevenInputsError(self._message(reason, batch, active))

    def finish(self) -> None:
        """This rank's epoch is done: take part in the others' steps until all are (``Join.__exit__``); the state
        copy follows. A collective unless the epoch was even. (A cut epoch gets its length back.)"""
        if self._uncut is not None:
            _pl.cut_epoch(self._trainer, self._uncut)
            self._uncut = None
        if self._mode == "flags" and self._seen == -1:  # no batch here: answer the others' first step
            self._mode = None
            if len(set(self._flags(3))) > 1 and self.policy == "error":
                raise UnevenInputsError(
                    f"[rank {self._trainer.global_rank}] this rank has no training batch in epoch"
                    f" {self._trainer.current_epoch} while others have some"
                    " (MyDDPStrategy(uneven_inputs='error')). Pass uneven_inputs='join' or"
                    " 'stop', or give every rank batches."
                )
        join, self._join = self._join, None
        if join is not None:
            if self.tail:
                self._exchange(_END)
            self.tail = False
            join.__exit__(None, None, None)

    def abandon(self) -> None:
        """After a failure, or at teardown: forget the epoch (no collective)."""
        self._join, self._mode, self.tail, self._work = None, None, False, None  # (the DDP wrapper goes too)

    def _exchange(self, kind: int = 0, a: int = 0, b: int = 0, c: int = 0) -> tuple[Any, ...]:
        """One all-reduce (MAX) of ``[kind, a, b, c, batch, *active]``: the active ranks send, the joined zeros."""
        strategy = self._trainer.strategy
        message = torch.zeros(5 + strategy.world_size, dtype=torch.int64, device=strategy.root_device)
        if kind:
            batch = self._trainer.fit_loop.epoch_loop.batch_progress.current.ready
            message[:5] = torch.tensor([kind, int(a), b, c, batch])
            message[5 + strategy.global_rank] = 1
        dist.all_reduce(message, dist.ReduceOp.MAX)
        kind, a, b, c, batch, *mask = message.tolist()
        return kind, a, b, c, batch, tuple(r for r, m in enumerate(mask) if m)

    def _message(self, reason: int, batch: int, active: tuple[int, ...]) -> str:
        trainer = self._trainer
        joined = [r for r in range(trainer.world_size) if r not in active]
        what, fix = _REFUSALS[reason]
        return (
            f"[rank {trainer.global_rank}] training batch {batch} (batch_idx {batch - 1}) of epoch"
            f" {trainer.current_epoch} on ranks {list(active)} makes {what}, in which ranks {joined}, out of"
            f" training data, cannot take part (uneven inputs, MyDDPStrategy(uneven_inputs='join')). Do: {fix};"
            " or pass MyDDPStrategy(uneven_inputs='stop') (every rank stops at the shortest rank's last batch;"
            " the others' later batches are not trained), or give every rank the same number of batches."
        )

    def _end_epoch(self, is_last_joiner: bool) -> None:
        """``Join``'s post-hook, on every rank: record the batch counts; after a step with fewer ranks every rank
        takes the module (parameters, buffers) and training state of the highest rank that trained longest."""
        trainer, strategy = self._trainer, self._trainer.strategy
        gathered: list[Any] = [None] * strategy.world_size
        dist.all_gather_object(gathered, (is_last_joiner, self._trained))
        self.epochs[trainer.current_epoch] = tuple(trained for _, trained in gathered)
        if self._work is not None and isinstance(strategy.model, DistributedDataParallel):
            _tp.set_gradient_divisor(strategy.model, self._work, True)  # the next epochs: the world size again
            _tp.set_ddp_join_mode(strategy.model, False)
        if all(last for last, _ in gathered):
            return
        source = max(r for r, (last, _) in enumerate(gathered) if last)
        module = trainer.lightning_module
        with torch.no_grad():
            _tp.broadcast_coalesced([t.detach() for t in (*module.parameters(), *module.buffers())], src=source)
        box = (
            [apply_to_collection(_pl.training_state(trainer), Tensor, Tensor.cpu)]
            if strategy.global_rank == source
            else [None]
        )
        dist.broadcast_object_list(box, src=source)
        if strategy.global_rank != source:
            _pl.load_training_state(trainer, box[0])


class _Shadow(JoinHook):
    """The join hook of :class:`UnevenInputs`: on a rank out of data, one step of the others per ``main_hook``."""

    def __init__(self, uneven: UnevenInputs) -> None:
        self.uneven = uneven

    def main_hook(self) -> None:
        uneven = self.uneven
        model, device = uneven._trainer.strategy.model, uneven._trainer.strategy.root_device
        while True:
            kind, a, b, c, batch, active = uneven._exchange()
            if kind == _END:
                return
            if kind == _REFUSE or kind in (_BROADCAST, _AGREE) and a not in active:
                reason = a if kind == _REFUSE else 1 if kind == _BROADCAST else 2
                raise UnevenInputsError(uneven._message(reason, batch, active))
            if kind == _FORWARD:
                _tp.shadow_ddp_forward(model)
            elif kind == _BACKWARD and a:
                _tp.shadow_ddp_backward(model)
            elif kind == _REDUCE:
                dist.all_reduce(
                    torch.full((a,), _neutral(_OPS[c], _DTYPES[b]), dtype=_DTYPES[b], device=device),
                    getattr(dist.ReduceOp, _OPS[c].upper()),
                )
            elif kind == _BARRIER:
                dist.barrier()
            elif kind == _BROADCAST:
                dist.broadcast_object_list([None], src=a)
            elif kind == _AGREE:
                agree_on_rank_zero_failure(None, "saving a checkpoint", uneven._trainer.global_rank, device)

    def post_hook(self, is_last_joiner: bool) -> None:
        self.uneven._end_epoch(is_last_joiner)


def _neutral(op: str, dtype: torch.dtype) -> float | int | bool:
    """What leaves ``op``'s result unchanged: 0 (sum), 1 (product), the dtype's lowest (max) or highest (min)."""
    if op in ("sum", "product") or dtype == torch.bool:
        return int(op == "product") if op in ("sum", "product") else op == "min"
    if dtype.is_floating_point:
        return float("-inf") if op == "max" else float("inf")
    return torch.iinfo(dtype).min if op == "max" else torch.iinfo(dtype).max


class _EpochEnd(Callback):
    """Ends this rank's part of an uneven epoch before anything after its last batch: validation or the epoch's
    end (put first among the callbacks; the strategy's collectives check too, :meth:`UnevenInputs.tail_step`)."""

    def __init__(self, uneven: UnevenInputs) -> None:
        self.uneven = uneven

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        uneven = self.uneven
        if uneven._join is not None and uneven.tail_step():  # an uneven epoch's step the joined ranks do not take
            uneven.refuse(5)
        if uneven._join is not None:  # mid-epoch in an uneven epoch: every rank must be validating now
            stepping, validating, _ = uneven._notify(validating=True)
            if validating < trainer.world_size:
                uneven._out_of_step(stepping, validating)

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        self.uneven.finish()

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.uneven.epochs = {}

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        """Rank 0 logs, for the fit summary, the policy and the batches each rank trained in each uneven epoch."""
        u = self.uneven
        rule = {
            "join": f"; a step's gradient sum divided by {'W' if u.divide_by_initial_world_size else 'its ranks'}",
            "stop": "; the longer ranks' later batches not trained",
        }.get(u.policy, "")
        if u.epochs:
            epochs = ", ".join(f"epoch {epoch}: {list(counts)}" for epoch, counts in u.epochs.items())
            rank_zero_info(f"Uneven inputs (uneven_inputs={u.policy!r}{rule}): batches trained per rank, {epochs}")
