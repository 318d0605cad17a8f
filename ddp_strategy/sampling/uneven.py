"""Uneven inputs: the policies for training epochs whose ranks' loaders yield different numbers of batches.

Where the strategy does not shard the training loader (the user's shards, sampler or ``IterableDataset``), an
epoch's batch counts can differ or be unknown; each epoch's start gathers them (:meth:`UnevenInputs.begin_epoch`,
after the epoch barrier). Equal known counts (the strategy's own shards) cost nothing. ``uneven_inputs="stop"`` ends
every rank's epoch with the first rank's last batch (known counts: cut at the start; unknown: one small all-reduce
per step); ``"error"`` refuses; ``"join"`` (default) runs the epoch under the join (:mod:`ddp_strategy.sampling.join`,
whose :class:`~ddp_strategy.sampling.join.StepJoin` :class:`UnevenInputs` extends), after refusing what a rank out of
data cannot take part in (an accumulation a shorter rank's last batch would end alone, a ``ZeroRedundancyOptimizer``,
SyncBatchNorm layers, torchmetrics metrics that sync every step). At such an epoch's end the batches each rank
trained are recorded (:attr:`UnevenInputs.epochs`, logged at the fit's end), and every rank takes the module and
training state of the rank that trained longest (:meth:`UnevenInputs.post_hook`).
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.distributed as dist
from lightning_utilities.core.apply_func import apply_to_collection
from torch.distributed.algorithms import Join
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.utils.data import IterableDataset

from ddp_strategy._compat import lightning_private as _pl
from ddp_strategy._compat import namespace as _namespace
from ddp_strategy._compat import torch_private as _tp
from ddp_strategy.process import boundaries
from ddp_strategy.sampling.join import StepJoin, UnevenInputsError, _Run
from ddp_strategy.sampling.loaders import flat_loaders

#: ``MyDDPStrategy(uneven_inputs=...)``'s values, the default first.
POLICIES = ("join", "stop", "error")
#: A rank's count in :meth:`UnevenInputs.begin_epoch` at the fit's end: above any number of batches.
_ENDED = 2**62


def _accumulation_message(trainer: Any, k: int, ranks: list[int]) -> str:
    """The error for ``accumulate_grad_batches=k`` whose accumulations ``ranks``' last batches end alone."""
    return (
        f"[rank {trainer.global_rank}] accumulate_grad_batches={k} on ranks with different numbers of"
        f" training batches (epoch {trainer.current_epoch}): the last batch of ranks {ranks} ends an"
        " accumulation (a gradient all-reduce) where the longer ranks accumulate on, so their all-reduces"
        f" cannot pair. Give every rank but the longest a multiple of {k} batches, or pass"
        " MyDDPStrategy(uneven_inputs='stop'), or accumulate_grad_batches=1."
    )


def _unshadowed(trainer: Any) -> list[str]:
    """What makes collectives of its own in a training step, not through the strategy, so that a rank out of data
    cannot take part in them under the join, named: a ``ZeroRedundancyOptimizer`` (its step broadcasts each rank's
    shard), SyncBatchNorm layers (their forward all-reduces the batch statistics), torchmetrics metrics with
    ``dist_sync_on_step=True`` (their forward gathers every rank's state)."""
    return (
        [
            f"optimizer {i} (a ZeroRedundancyOptimizer)"
            for i, optimizer in enumerate(trainer.optimizers)
            if isinstance(optimizer, ZeroRedundancyOptimizer)
        ]
        + [
            f"the SyncBatchNorm layer {name!r}"
            for name, module in trainer.lightning_module.named_modules()
            if "SyncBatchNorm" in type(module).__name__
        ]
        + [
            f"the metric {name!r} (dist_sync_on_step=True)"
            for name, module in trainer.lightning_module.named_modules()
            if getattr(module, "dist_sync_on_step", False) is True
        ]
    )


class UnevenInputs(StepJoin):
    """One strategy's policy for training epochs whose ranks hold different numbers of batches (module docstring),
    on the join of :class:`~ddp_strategy.sampling.join.StepJoin`, which it extends with the epochs' start and end.

    Args:
        policy: ``"join"``, ``"stop"`` or ``"error"``.
        divide_by_initial_world_size: ``"join"``'s tail step divides its gradient sum by W (True, DDP's default for
            ``DistributedDataParallel.join``: a sample weighs ``1 / (W * B)`` in every step) or by its ranks.
        step_round: the fit's per-step round (``process.boundaries.StepRound``), shared with the signal checks.
        until_teardown: an ``ExitStack`` closed at the strategy's teardown (the metrics' own sync given back there).

    Raises:
        ValueError: an unknown policy (``divide_by_initial_world_size`` is checked with the strategy's other
            arguments, :func:`ddp_strategy.options.strategy_options`).
    """

    def __init__(
        self, policy: str, divide_by_initial_world_size: bool, step_round: boundaries.StepRound, until_teardown: Any
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(
                f"MyDDPStrategy(uneven_inputs={policy!r}) is not one of {list(POLICIES)}: 'join' trains"
                " every batch of every rank, 'stop' ends the epoch at the shortest rank's last batch,"
                " 'error' refuses ranks with different numbers of batches."
            )
        super().__init__(divide_by_initial_world_size, step_round)
        self.policy = policy
        self.callback = _EpochEnd(self, until_teardown)  #: first among the callbacks: ends an uneven epoch or run
        self.epochs: dict[int, tuple[int, ...]] = {}  #: epoch whose counts differed -> batches each rank trained
        self._uncut: int | None = None  #: ``"stop"`` with known counts (the epoch cut at its start): its length

    def begin_epoch(self, trainer: Any, end: bool = False) -> None:
        """At a training epoch's start, on every rank, after the epoch barrier: gather every rank's batch count (-1:
        unknown, as any ``IterableDataset``'s, whose length is only a hint; one all-reduce of W integers), and where
        they differ or are unknown, set the epoch up for the policy (with one rank, nothing). At the fit's ``end``
        (``on_train_end``) the same all-reduce, with a mark in place of the count: it pairs with the others' next
        epoch where this rank ended the fit alone (``trainer.should_stop`` on some ranks only, after their epoch's
        last batch: under Lightning's ddp the others' next step fails once it exits, or waits out the timeout).

        Raises:
            RuntimeError: some ranks ended the fit while the others started an epoch (on every rank, naming both).
            ValueError: known, unequal counts under ``"error"``; under ``"join"``, ``accumulate_grad_batches`` not
                dividing a shorter rank's known count (its last batch would sync gradients alone), or what a rank
                out of data cannot take part in (:func:`_unshadowed`), each named, with ``uneven_inputs="stop"``;
                on unknown counts (a stream, even ones run as under Lightning's ddp) that is a rank-0 warning.
        """
        self._trainer, self._run, self._uncut = trainer, None, None
        unknown = trainer.num_training_batches == float("inf") or any(
            isinstance(getattr(dl, "dataset", None), IterableDataset) for dl in flat_loaders(trainer.train_dataloader)
        )
        counts = [
            c - 1 for c in self._flags(_ENDED + 1 if end else 0 if unknown else int(trainer.num_training_batches) + 1)
        ]
        if len({c == _ENDED for c in counts}) > 1:
            raise RuntimeError(
                f"[rank {trainer.global_rank}] ranks {[r for r, c in enumerate(counts) if c == _ENDED]} ended the fit"
                " (trainer.should_stop set there alone, after the epoch's last batch) while the others started training"
                f" epoch {trainer.current_epoch}. Decide the stop on every rank: trainer.should_stop ="
                " trainer.strategy.reduce_boolean_decision(stop, all=False), as EarlyStopping does."
            )
        if len(counts) == 1 or len(set(counts)) == 1 and -1 not in counts:  # one rank: nothing to agree
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
            message = (
                " and under MyDDPStrategy(uneven_inputs='join') a rank out of data takes part in the others' steps"
                " only through the strategy's collectives, not in the collectives these make in a step of their own:"
                f" {'; '.join(unshadowed)}. Pass MyDDPStrategy(uneven_inputs='stop') (every rank stops at the shortest"
                " rank's last batch), or give every rank the same known number of batches (let MyDDPStrategy shard"
                " the data), or leave them out (a metric: dist_sync_on_step=False)."
            )
            if known:  # unequal: such a run hangs under Lightning's ddp too
                raise ValueError(
                    f"[rank {trainer.global_rank}] the ranks' numbers of training batches in epoch {epoch} differ"
                    f" ({dict(enumerate(counts))}),{message}"
                )
            # an even stream runs as under ddp; an uneven one fails at the first step a rank lacks
            _namespace.rank_zero_warn(
                "The ranks' numbers of training batches are unknown (a loader without a length, or an"
                f" IterableDataset),{message} Where they turn out to differ, the first step a rank lacks fails there,"
                " naming the likely cause."
            )
        if self.policy == "stop" and known:  # cut here, no per-step work; the next epoch is cut anew
            self._uncut = trainer.num_training_batches
            _pl.cut_epoch(trainer, min(counts))
            self.epochs[epoch] = (min(counts),) * len(counts)
            return
        self._run = _Run(
            trainer.fit_loop.epoch_loop.batch_progress,
            Join([self]) if self.policy == "join" else None,
            known=known,
            ahead=(known or trainer.num_training_batches == float("inf"))  # else is_last_batch is a guess
            and (
                not trainer.enable_validation  # or the ranks validate at the same batches while all of them step:
                or (interval := getattr(trainer, "val_check_interval", None)) == 1.0  # (unset for a time interval)
                or isinstance(interval, int)
                and trainer.check_val_every_n_epoch is not None
            ),
        )
        if self._run.join is not None:
            self._run.join.__enter__()

    def step_start(self) -> None:
        """At a step's start (``batch_to_device``), training or evaluation, every rank with a batch: in a run under the
        join, the join's part (:meth:`StepJoin.join_step`), then, on unknown counts with ``accumulate_grad_batches >
        1``, one more blocking all-reduce, of whether each rank's backward syncs gradients; under ``"stop"`` and
        ``"error"`` on unknown counts, one blocking all-reduce of each rank's flag (a batch, its last batch, none).
        Nothing in an epoch whose counts agree. A ``training_step(dataloader_iter)`` (no ``batch_to_device``) does
        not start a step.

        Raises:
            UnevenInputsError: as the policy says; ranks validating at other batches; an accumulation a shorter
                rank's last batch ends alone. StopIteration: ``"stop"``, a rank has no batch: the epoch ends here.
        """
        run, trainer = self._run, self._trainer
        if run is None or trainer.training != (run.synced is None):  # (a validation run inside a training epoch)
            return
        run.trained += 1
        k = trainer.accumulate_grad_batches
        if run.join is not None:
            self.join_step()
            if k > 1 and not run.tail and not run.known and trainer.training:
                syncs = self._flags(1 + (run.progress.is_last_batch or (run.progress.current.ready + 1) % k == 0))
                if len(set(syncs)) > 1:
                    raise UnevenInputsError(
                        _accumulation_message(trainer, k, [r for r, f in enumerate(syncs) if f == 2])
                    )
            return
        flags = self._flags(1 + run.progress.is_last_batch)  # "stop" or "error": 1 a batch, 2 its last, 3 none
        if len(set(flags)) > 1 and self.policy == "error":
            raise UnevenInputsError(
                f"[rank {trainer.global_rank}] ranks {[r for r, f in enumerate(flags) if f >= 2]} reach the end"
                f" of their training data at batch {run.progress.current.ready + 1} of epoch"
                f" {trainer.current_epoch} while the others have more (MyDDPStrategy(uneven_inputs='error'))."
                " Pass uneven_inputs='join' (the default: every rank trains all its batches) or 'stop' (all stop"
                " there), or give every rank the same number."
            )
        if len(set(flags)) > 1:  # "stop" ends the epoch with this batch (before it, where a rank had none)
            self.epochs[trainer.current_epoch] = (run.trained - (3 in flags),) * trainer.world_size
        if 3 in flags:
            raise StopIteration
        run.progress.is_last_batch = max(flags) >= 2

    def end_epoch(self) -> None:
        """At a training epoch's or evaluation stage's end (the first callback's hooks; an evaluation's before its
        epoch-level values are reduced): a cut training epoch gets its length back; a run under the join ends, this
        rank taking part in the others' steps until all are done (:meth:`finish`; a training epoch's record and
        state copy follow, :meth:`post_hook`); under ``"stop"``/``"error"`` on unknown counts a rank without any
        batch answers the others' first step. A collective unless the counts agreed (or the join ended already:
        :meth:`announce`).

        Raises:
            UnevenInputsError: ``"error"``, this rank has no batch while others have some.
        """
        run, trainer = self._run, self._trainer
        if self._uncut is not None and trainer.training:
            _pl.cut_epoch(trainer, self._uncut)
        if run is None or trainer.training != (run.synced is None):
            return
        if run.join is None and run.trained == 0 and len(set(self._flags(3))) > 1:
            if self.policy == "error":
                raise UnevenInputsError(
                    f"[rank {trainer.global_rank}] this rank has no training batch in epoch"
                    f" {trainer.current_epoch} while others have some (MyDDPStrategy(uneven_inputs='error'))."
                    " Pass uneven_inputs='join' or 'stop', or give every rank batches."
                )
            self.epochs[trainer.current_epoch] = (0,) * trainer.world_size  # "stop": no rank trains one
        if run.join is not None:
            self.finish()
        else:
            self.abandon()

    def post_hook(self, is_last_joiner: bool) -> None:
        """``Join``'s post-hook, on every rank once all joined. After a training epoch whose ranks took different
        numbers of steps: record them, and every rank takes the module (parameters, buffers) and training state of
        the highest rank that trained longest. A collective after a training epoch."""
        if cast(_Run, self._run).synced is not None:  # an evaluation's: nothing to record or copy
            return
        trainer, steps = self._trainer, self._flags(cast(_Run, self._run).trained)
        if len(set(steps)) == 1:
            return
        self.epochs[trainer.current_epoch] = tuple(steps)
        source, module = max(r for r, s in enumerate(steps) if s == max(steps)), trainer.lightning_module
        _tp.broadcast_coalesced([t.detach() for t in (*module.parameters(), *module.buffers())], src=source)
        box: list[Any] = [
            apply_to_collection(_pl.training_state(trainer), torch.Tensor, torch.Tensor.cpu)
            if trainer.global_rank == source
            else None
        ]
        dist.broadcast_object_list(box, src=source)
        if trainer.global_rank != source:
            _pl.load_training_state(trainer, box[0])

    def _flags(self, flag: int) -> list[int]:
        """One all-reduce (MAX) of every rank's small flag (this rank's ``flag``, at least 0); returns them by rank."""
        flags = torch.tensor(
            [flag if r == self._trainer.global_rank else 0 for r in range(self._trainer.world_size)],
            device=self.join_device,
        )
        dist.all_reduce(flags, dist.ReduceOp.MAX)
        return flags.tolist()


class _EpochEnd(_namespace.Callback):
    """Ends this rank's part of an uneven epoch or evaluation run before anything after its last batch: validation or
    the epoch's end (put first among the callbacks; the strategy's collectives check too, :meth:`StepJoin.announce`);
    logs the fit's counts at its end."""

    def __init__(self, uneven: UnevenInputs, until_teardown: Any) -> None:
        self.uneven, self.until_teardown = uneven, until_teardown

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        self.uneven.announce("validation")

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        """At a training epoch's end, or an evaluation stage's (before its metrics are computed)."""
        self.uneven.end_epoch()

    on_validation_epoch_end = on_test_epoch_end = on_predict_epoch_end = on_train_epoch_end

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        """Forget the last fit's counts. Until the teardown, the module's torchmetrics metrics without a sync of their
        own (``dist_sync_fn``) sync through :meth:`StepJoin.gather`, which makes the strategy's round first: a metric
        synced on some ranks only, or where another rank makes another collective (a save on rank 0 alone at an
        epoch's end, the others computing their epoch-level metrics), is named at once, not at the timeout."""
        self.uneven.epochs = {}
        for metric in [m for m in pl_module.modules() if getattr(m, "dist_sync_fn", False) is None]:
            metric.dist_sync_fn = self.uneven.gather
            self.until_teardown.callback(setattr, metric, "dist_sync_fn", None)

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
