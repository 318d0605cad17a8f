"""Mid-epoch resume: the glue between Lightning's loops and the samplers' saved positions.

The positions themselves (what is stored, how a new world size re-shards the rest of an epoch) are in
:mod:`ddp_strategy.sampling.state`; the samplers that use them are in :mod:`ddp_strategy.sampling.sampler`. This
module moves positions between the checkpoint, the training loaders the strategy injected, and Lightning's
batch counter.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

from ddp_strategy._compat import lightning_private as _pl
from ddp_strategy._compat.namespace import TrainerFn, rank_zero_info, rank_zero_warn
from ddp_strategy.sampling import injection, sampler
from ddp_strategy.sampling import state as sampler_state

if TYPE_CHECKING:
    from lightning.pytorch import Trainer


def train_samplers(trainer: Trainer) -> list[Any]:
    """The samplers MyDDPStrategy injected into ``trainer``'s training loaders, in Lightning's order."""
    loaders = injection.flatten_loaders(trainer.train_dataloader)
    return [s for s in (injection.injected_sampler(dl) for dl in loaders) if s is not None]


def hand_over_position(dataloader: object, pending: list[dict[str, Any]]) -> None:
    """Give the next saved position in ``pending`` (removed from it) to ``dataloader``'s injected sampler.

    Args:
        dataloader: a training loader the strategy just processed.
        pending: positions read from the checkpoint, one per training loader, in order; consumed here.
    """
    if not pending:
        return
    position = pending.pop(0)
    injected = injection.injected_sampler(dataloader)
    if injected is None:
        rank_zero_warn("The checkpoint holds a sampler position, but the training loader's sampler is not"
                       " injected by MyDDPStrategy (it is your own DistributedSampler): the rest of the"
                       " interrupted epoch is not restored exactly.")
        return
    injected.resume_from(position)


def restore_batch_counter(trainer: Trainer, world_size: int) -> None:
    """After a mid-epoch resume, set Lightning's batch counter to ``num_training_batches - batches left``.

    Lightning does not fast-forward the loader: it counts the batches it believes done and stops at
    ``num_training_batches``. With the same world size the counter is already right (on Lightning 2.5+;
    2.4 would resume one batch early, see ``_lightning_private.resumed_batch_count``); after an elastic
    resume each new rank has a different number of batches left, so the counter is moved (same on every
    rank, no collective). With ``limit_train_batches`` set (a fraction below 1.0, or a batch count),
    Lightning's restored counter is kept: the epoch ends at the limit, not at the loader's end, so an elastic
    resume under a limit keeps the saved count of batches done rather than the new world size's remainder.

    Raises:
        ValueError: a mid-epoch resume with more than one training loader.
    """
    samplers = train_samplers(trainer)
    epoch = trainer.fit_loop.epoch_progress.current.processed
    pending = [(s, s.pending_resume_batches(epoch)) for s in samplers]
    pending = [(s, left) for s, left in pending if left is not None]
    if not pending:
        return
    if len(samplers) != 1:
        raise ValueError(
            f"Resuming mid-epoch with {len(samplers)} training loaders is not supported: Lightning counts one"
            " batch position for all of them. Resume from an end-of-epoch checkpoint, or use one loader."
        )
    injected, left = pending[0]
    limit = trainer.limit_train_batches
    if isinstance(limit, int) or (isinstance(limit, float) and limit < 1.0):
        # limit_train_batches cuts every epoch short: Lightning's own counter (restored from the checkpoint)
        # already says how many of the limited batches are done, and the loader is never read to its end.
        saved = trainer.fit_loop.epoch_loop.batch_progress.current.ready
        _pl.shift_epoch_batch_progress(trainer, saved - _pl.resumed_batch_count(trainer))  # 0 but on 2.4
        injected.batch_offset = saved
        return
    done = max(int(trainer.num_training_batches) - left, 0)
    _pl.shift_epoch_batch_progress(trainer, done - _pl.resumed_batch_count(trainer))
    injected.batch_offset = done
    # Lightning warns that a plain DataLoader cannot resume mid-epoch; ours does, so say what happens instead.
    warnings.filterwarnings("ignore", message=sampler.LIGHTNING_NOT_RESUMABLE_WARNING)
    rank_zero_info(f"MyDDPStrategy: resuming epoch {epoch} at its saved sampler position: {left} batches per"
                   f" rank left on {world_size} processes (batch counter set to {done}).")


def add_sampler_positions(trainer: Trainer, checkpoint: dict[str, Any]) -> None:
    """Add every rank's training sampler position to ``checkpoint`` (gathered: a collective, every rank).

    The entry is plain ints and lists (see :mod:`ddp_strategy.sampling.state`), so the file still loads with
    ``torch.load(weights_only=True)``. Only while fitting with injected samplers; otherwise a no-op.
    """
    samplers = train_samplers(trainer) if trainer.state.fn == TrainerFn.FITTING else []
    if samplers:
        done = trainer.fit_loop.epoch_loop.batch_progress.current.ready
        local = [s.position(done) for s in samplers]
        checkpoint[sampler_state.CHECKPOINT_KEY] = sampler_state.checkpoint_entry(
            sampler_state.gather_positions(local))
