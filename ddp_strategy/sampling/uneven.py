"""Uneven inputs: training when the ranks' loaders yield different numbers of batches (docs/sampling.md).

An epoch's batch counts can differ across ranks, or be unknown, where the strategy does not shard the training
loader (the user's shards under ``use_distributed_sampler=False``, their own distributed sampler, an
``IterableDataset``). Then :class:`UnevenInputs` applies ``MyDDPStrategy(uneven_inputs=...)``:

- ``"join"`` (default): the epoch runs inside torch's generic join context manager
  (``torch.distributed.algorithms.Join``) with this object as its ``Joinable``. At each step's start every rank
  with a batch notifies the context (``Join.notify_join_context``: an all-reduce of one number). A rank that has
  trained its last batch enters ``Join.__exit__``, whose hook takes part in the others' steps: in a step with
  fewer ranks the active ranks announce each collective (an all-reduce, MAX, of ``5 + W`` integers) and the
  joined ranks join in: DDP's forward and its gradient buckets (zeros, as DDP's own join hook does),
  ``strategy.reduce`` (``self.log(..., sync_dist=True)``) and ``reduce_boolean_decision`` with a neutral value
  (a mean is over the active ranks), ``barrier``, ``broadcast`` from an active rank, a checkpoint save's
  agreement. What a joined rank cannot take part in raises :class:`UnevenInputsError` on every rank at once.
  When every rank is done, all take the module and training state of the highest rank that trained longest.
- ``"stop"``: every rank ends the epoch with the batch where the first rank ends (the others' later batches are
  not trained): with known counts by cutting the epoch to the fewest; else one all-reduce per step.
- ``"error"``: known unequal counts raise ``ValueError`` at the epoch's start, unknown ones
  :class:`UnevenInputsError` at the step where one rank ends before the others, on every rank.

Loaders the strategy shards have equal counts: nothing of this runs, no collective is added.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NoReturn

import torch
import torch.distributed as dist
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor
from torch.distributed.algorithms import Join, Joinable, JoinHook
from torch.nn.parallel import DistributedDataParallel

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
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
           torch.int8, torch.uint8, torch.bool)
_OPS = ("sum", "max", "min", "product")
#: What a joined rank cannot take part in (announced by its index).
_REFUSALS = (
    "an all_gather (self.all_gather, strategy.all_gather): a rank without data has no row to give",
    "a broadcast from a rank that has no data left (ModelCheckpoint asks rank 0, which writes checkpoints,"
    " whether the file exists before each save)",
    "a checkpoint save, but rank 0, which writes checkpoints, has no data left and holds an older state",
    "a collective on a process group other than the world, or a reduction other than sum, mean, max, min or"
    " product, or of a dtype other than float, int or bool",
    "torchmetrics' per-step sync (a Metric with dist_sync_on_step=True), which no rank without data can shadow",
    "a validation run (val_check_interval) in a step that not every rank reaches",
)


class UnevenInputsError(RuntimeError):
    """Raised on every rank where ranks with different amounts of training data cannot go on together: a
    collective a rank without data cannot take part in (``uneven_inputs="join"``), or any unevenness under
    ``uneven_inputs="error"``. The message names the step, the ranks without data and what to do."""


class UnevenInputs(Joinable):
    """One strategy's policy for training epochs whose ranks hold different numbers of batches (module docstring).

    Args:
        policy: ``"join"``, ``"stop"`` or ``"error"``.
        divide_by_initial_world_size: under ``"join"``, a step's gradient is the sum of the active ranks' divided
            by the world size W (True, DDP's default: every sample weighs ``1 / (W * B)`` in every step), or by the
            number of active ranks (False: a step's size does not shrink; DDP's ``join(divide_by_initial_world_size)``;
            DDP's default all-reduce only, a comm hook divides as it does).

    Raises:
        ValueError: an unknown policy. TypeError: ``divide_by_initial_world_size`` not a bool.
    """

    def __init__(self, policy: str = "join", divide_by_initial_world_size: bool = True) -> None:
        super().__init__()
        if policy not in POLICIES:
            raise ValueError(f"MyDDPStrategy(uneven_inputs={policy!r}) is not one of {list(POLICIES)}: 'join' trains"
                             " every batch of every rank, 'stop' ends the epoch at the shortest rank's last batch,"
                             " 'error' refuses ranks with different numbers of batches.")
        if not isinstance(divide_by_initial_world_size, bool):
            raise TypeError(f"MyDDPStrategy(divide_by_initial_world_size=...) must be True or False, got"
                            f" {divide_by_initial_world_size!r}.")
        self.policy, self.divide_by_initial_world_size = policy, divide_by_initial_world_size
        self.callback = _EpochEnd(self)  #: ends the join at the epoch's end, first among the callbacks
        self.epochs: dict[int, tuple[int, ...]] = {}  #: uneven epoch -> batches each rank trained
        self.tail = False  #: this rank is in a step that some ranks, out of data, only shadow
        self._trainer: Any = None
        self._mode: str | None = None  # "join", "flags" (stop/error on unknown counts) or None (nothing per step)
        self._join: Join | None = None
        self._seen, self._trained, self._n, self._work, self._uncut = -1, 0, 0, None, None

    @property
    def join_device(self) -> torch.device:
        return self._trainer.strategy.root_device

    @property
    def join_process_group(self) -> Any:
        return None  # the world

    def join_hook(self, **kwargs: Any) -> JoinHook:
        return _Shadow(self)

    def begin_epoch(self, trainer: Any, counts: list[int]) -> None:
        """At a training epoch's start, on every rank, with every rank's batch count (-1: unknown); no collective.

        Raises:
            ValueError: ``"error"`` and known, unequal counts.
        """
        self._trainer, self._mode, self.tail, self._seen, self._trained = trainer, None, False, -1, 0
        if len(set(counts)) == 1 and -1 not in counts:
            return
        epoch, rank = trainer.current_epoch, trainer.global_rank
        if self.policy == "error" and -1 not in counts:
            raise ValueError(
                f"[rank {rank}] ranks have different numbers of training batches in epoch {epoch}:"
                f" {dict(enumerate(counts))}, refused by MyDDPStrategy(uneven_inputs='error'). Pass uneven_inputs="
                "'join' (the default: every rank trains all its batches) or 'stop' (all stop at the fewest), let"
                " MyDDPStrategy shard the data (a map-style data set in a DataLoader, with"
                " Trainer(use_distributed_sampler=True), the default), or make the shards you give each rank (your"
                " own sampler, or your split under use_distributed_sampler=False) hold the same number of batches.")
        if self.policy == "stop" and -1 not in counts:
            self._uncut = trainer.num_training_batches  # given back at the epoch's end: the next one is cut anew
            _pl.cut_epoch(trainer, min(counts))
            self.epochs[epoch] = (min(counts),) * len(counts)
        elif self.policy == "join":
            self._mode, self._join = "join", Join([self])
            self._join.__enter__()
        else:
            self._mode = "flags"

    def step_start(self) -> None:
        """At a training step's start (``batch_to_device``; ``training_step`` when the step takes the iterator),
        every rank with a batch: one all-reduce (see the module docstring), once per step."""
        trainer = self._trainer
        if self._mode is None or not trainer.training:
            return
        progress = trainer.fit_loop.epoch_loop.batch_progress
        if progress.total.completed == self._seen:
            return
        self._seen, self._trained = progress.total.completed, self._trained + 1
        strategy = trainer.strategy
        if self._mode == "flags":
            flags = torch.zeros(strategy.world_size, dtype=torch.int64, device=strategy.root_device)
            flags[strategy.global_rank] = 1 + progress.is_last_batch
            dist.all_reduce(flags, dist.ReduceOp.MAX)
            last = [r for r, f in enumerate(flags.tolist()) if f == 2]
            if last and len(last) < len(flags) and self.policy == "error":
                raise UnevenInputsError(
                    f"[rank {strategy.global_rank}] ranks {last} reach the end of their training data at batch"
                    f" {progress.current.ready + 1} of epoch {trainer.current_epoch} while the others have more"
                    " (MyDDPStrategy(uneven_inputs='error')). Pass uneven_inputs='join' (the default: every rank"
                    " trains all its batches) or 'stop' (all stop there), or give every rank the same number.")
            if last:
                progress.is_last_batch = True
            self.epochs[trainer.current_epoch] = (self._trained,) * len(flags)
            return
        if self.tail:
            self._exchange(_END)
        self._work = work = Join.notify_join_context(self)
        work.wait()
        self._n = int(work.result()[0].item())
        if isinstance(strategy.model, DistributedDataParallel):
            _tp.set_gradient_divisor(strategy.model, work, self.divide_by_initial_world_size)
        self.tail = self._n < strategy.world_size

    def before_forward(self) -> None:
        """Before DDP's forward (``training_step``): notify if not yet; in a step with fewer ranks announce it."""
        self.step_start()
        if not self.tail:
            return
        module, model = self._trainer.lightning_module, self._trainer.strategy.model
        if any(getattr(m, "dist_sync_on_step", False) is True and hasattr(m, "compute") for m in module.modules()):
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
        name = reduce_op.lower() if isinstance(reduce_op, str) else next(
            (n for n in _OPS if reduce_op == getattr(dist.ReduceOp, n.upper())), None)
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
        """This rank has trained its last batch of the epoch: take part in the others' steps until all are done
        (``Join.__exit__``), then agree on the state. A collective; a no-op unless joining. (``"stop"``'s cut epoch
        gets its length back.)"""
        if self._uncut is not None:
            _pl.cut_epoch(self._trainer, self._uncut)
            self._uncut = None
        join, self._join = self._join, None
        if join is not None:
            if self.tail:
                self._exchange(_END)
            self.tail = False
            join.__exit__(None, None, None)

    def abandon(self) -> None:
        """After a failure, or at teardown: forget the epoch (no collective)."""
        self._join, self._mode, self.tail, self._work = None, None, False, None
        if self._trainer is not None and isinstance(self._trainer.strategy.model, DistributedDataParallel):
            _tp.set_ddp_join_mode(self._trainer.strategy.model, False)

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
        return (f"[rank {trainer.global_rank}] batch {batch} of training epoch {trainer.current_epoch} (ranks"
                f" {list(active)}) makes {_REFUSALS[reason]}, but ranks {joined} have no training data left"
                " (uneven inputs, MyDDPStrategy(uneven_inputs='join')). Move it out of the step (self.log with"
                " on_step=False, a sync at the epoch's end), or pass MyDDPStrategy(uneven_inputs='stop') (every"
                " rank stops at the shortest rank's last batch; the others' later batches are not trained), or"
                " give every rank the same number of batches.")

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
        box = [apply_to_collection(_pl.training_state(trainer), Tensor, Tensor.cpu)] if strategy.global_rank == source \
            else [None]
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
                dist.all_reduce(torch.full((a,), _neutral(_OPS[c], _DTYPES[b]), dtype=_DTYPES[b], device=device),
                                getattr(dist.ReduceOp, _OPS[c].upper()))
            elif kind == _BARRIER:
                dist.barrier()
            elif kind == _BROADCAST:
                dist.broadcast_object_list([None], src=a)
            elif kind == _AGREE:
                agree_on_rank_zero_failure(None, "saving a checkpoint", uneven._trainer.global_rank, device)

    def post_hook(self, is_last_joiner: bool) -> None:
        self.uneven._end_epoch(is_last_joiner)


def _neutral(op: str, dtype: torch.dtype) -> float | int | bool:
    """The value that leaves ``op``'s result unchanged: 0 for sum, 1 for product, the lowest for max, ..."""
    if op in ("sum", "product"):
        return int(op == "product")
    if dtype == torch.bool:
        return op == "min"
    info = torch.finfo(dtype) if dtype.is_floating_point else torch.iinfo(dtype)
    highest = float("inf") if dtype.is_floating_point else info.max
    lowest = -highest if dtype.is_floating_point else info.min
    return lowest if op == "max" else highest


class _EpochEnd(Callback):
    """Ends this rank's part of an uneven epoch before anything after its last batch: validation or the epoch's
    end (put first among the callbacks; the strategy's collectives check too, :meth:`UnevenInputs.tail_step`)."""

    def __init__(self, uneven: UnevenInputs) -> None:
        self.uneven = uneven

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        if self.uneven._join is not None and self.uneven.tail_step():  # an uneven epoch, not yet done here
            self.uneven.refuse(5)

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        self.uneven.finish()

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.uneven.epochs = {}

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        """Rank 0 logs, for the fit summary, the policy and the batches each rank trained in each uneven epoch."""
        uneven = self.uneven
        if uneven.epochs:
            divisor = "the world size" if uneven.divide_by_initial_world_size else "its number of ranks"
            rule = {"join": f"; a step's gradient sum divided by {divisor}",
                    "stop": "; the longer ranks' later batches not trained"}.get(uneven.policy, "")
            epochs = ", ".join(f"epoch {epoch}: {list(counts)}" for epoch, counts in uneven.epochs.items())
            rank_zero_info(f"Uneven inputs (uneven_inputs={uneven.policy!r}{rule}): batches trained per rank, {epochs}")
