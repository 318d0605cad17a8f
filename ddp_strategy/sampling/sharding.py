"""Step 2 for the strategy: one object that shards every loader, and carries sampler positions through checkpoints.

:class:`LoaderSharding` is the only thing :class:`~ddp_strategy.strategy.MyDDPStrategy` calls for data. A
training loader goes down :mod:`~ddp_strategy.sampling.injection` (a ``DistributedSampler`` that keeps the
loader's order semantics, re-seeded each epoch) and :mod:`~ddp_strategy.sampling.resume` (a saved mid-epoch
position); an evaluation loader goes down :mod:`~ddp_strategy.sampling.evaluation` (exact shards with equal
batch counts). Positions for a checkpoint come back up through :meth:`LoaderSharding.add_positions` and in
through :meth:`LoaderSharding.take_positions`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ddp_strategy._compat import lightning_private as _pl
from ddp_strategy._compat.namespace import RunningStage, TrainerFn, rank_zero_warn
from ddp_strategy.sampling import evaluation, injection, resume
from ddp_strategy.sampling import state as sampler_state

if TYPE_CHECKING:
    from lightning.pytorch import Trainer


class LoaderSharding:
    """Shards one strategy's loaders (state kept across stages: the guard, saved positions).

    Args:
        exact_evaluation: validation/test loaders without padding, every sample once, with equal batch counts
            on every rank (True, default); False shards them as Lightning's ``ddp`` does (padded).
    """

    def __init__(self, exact_evaluation: bool = True) -> None:
        self.exact_evaluation = exact_evaluation
        #: Refuses per-step collectives on evaluation loaders with uneven batch counts.
        self.guard = evaluation.EvaluationStepGuard()
        self._pending_positions: list[dict[str, Any]] = []
        self._injecting = True

    def take_over(self, trainer: Trainer) -> None:
        """Turn Lightning's own sampler injection off (kept for predict) and remember whether the user wants any.

        ``Trainer(use_distributed_sampler=False)`` is honoured: loaders are then left as they are.
        """
        predicting = trainer.state.fn == TrainerFn.PREDICTING
        self._injecting = _pl.set_lightning_sampler_injection(trainer, enabled=predicting)

    def hand_back(self, trainer: Trainer | None) -> None:
        """Give Lightning its sampler injection back and forget unused positions (at teardown)."""
        if trainer is not None:
            _pl.set_lightning_sampler_injection(trainer, enabled=True)
        self._pending_positions = []

    def prepare(self, dataloader: object, trainer: Trainer, world_size: int, rank: int, seed: int) -> object:
        """Return ``dataloader`` sharded for ``rank`` of ``world_size`` in the trainer's current stage.

        Training loaders are padded so every rank takes the same number of steps and resume from the
        checkpoint's sampler position if any; validation and test loaders hold each sample once with the same
        number of batches on every rank (padded as Lightning does with ``exact_evaluation=False``); predict
        loaders are Lightning's (``UnrepeatedDistributedSamplerWrapper``). Evaluation and predict loaders
        then agree on their batch counts (a collective, every rank). Anything that cannot be sharded (a list
        of batches, an ``IterableDataset``) is read whole by every rank, as under Lightning's ``ddp``, with a
        rank-0 warning.
        """
        training = trainer.state.stage == RunningStage.TRAINING
        if not self._injecting:  # Trainer(use_distributed_sampler=False): the user shards, as under Lightning
            if not training:
                evaluation.agree_batch_counts(dataloader)
            return dataloader
        injection.warn_if_not_shardable(dataloader, world_size)
        if trainer.state.fn == TrainerFn.PREDICTING:
            evaluation.agree_batch_counts(dataloader)
            return dataloader

        def epoch_fn() -> int:
            return trainer.fit_loop.epoch_progress.current.processed

        if training:
            injection.warn_if_order_kept(dataloader, world_size, trainer.overfit_batches)
            dataloader = injection.inject_distributed_sampler(dataloader, num_replicas=world_size, rank=rank,
                                                              seed=seed, epoch_fn=epoch_fn, pad=True)
            resume.hand_over_position(dataloader, self._pending_positions)
            return dataloader
        stage = "test" if trainer.state.stage == RunningStage.TESTING else "validation"
        if self.exact_evaluation:
            dataloader = evaluation.shard_for_evaluation(dataloader, world_size, rank, seed, epoch_fn, stage)
        else:
            dataloader = injection.inject_distributed_sampler(dataloader, num_replicas=world_size, rank=rank,
                                                              seed=seed, epoch_fn=epoch_fn, pad=True, training=False)
        evaluation.agree_batch_counts(dataloader)
        return dataloader

    def step(self, trainer: Trainer | None, stage: str, args: Any, kwargs: dict[str, Any]) -> Any:
        """Context for one ``validation_step``/``test_step``/``predict_step``: refuses per-step collectives on
        uneven loaders (:class:`~ddp_strategy.sampling.evaluation.EvaluationStepGuard`)."""
        return evaluation.step_guard(trainer, self.guard, stage, args, kwargs)

    def end_stage(self) -> None:
        """Forget the stage's uneven batch counts (kept until then for the error of a collective that fails)."""
        self.guard.last_uneven = None

    def add_positions(self, trainer: Trainer | None, checkpoint: dict[str, Any]) -> None:
        """Gather every rank's sampler position into ``checkpoint`` (a collective, every rank)."""
        if trainer is not None:
            resume.add_sampler_positions(trainer, checkpoint)

    def take_positions(self, checkpoint: dict[str, Any]) -> None:
        """Keep ``checkpoint``'s sampler positions for the training loaders built next.

        An entry this version cannot read is ignored with a warning (Lightning's ``ddp`` loads such a file):
        the epoch's data then restarts, as under Lightning.
        """
        entry = checkpoint.get(sampler_state.CHECKPOINT_KEY)
        try:
            self._pending_positions = list(sampler_state.loader_positions(entry)) if entry is not None else []
        except ValueError as e:
            rank_zero_warn(f"{e} It is ignored: the checkpoint loads, and a mid-epoch resume restarts the"
                           " epoch's data as under Lightning's ddp.")
            self._pending_positions = []

    def on_train_start(self, trainer: Trainer | None, world_size: int) -> None:
        """Restore Lightning's batch counter after a mid-epoch resume (see :mod:`ddp_strategy.sampling.resume`)."""
        if trainer is not None:
            resume.restore_batch_counter(trainer, world_size)
