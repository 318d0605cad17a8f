"""Sampler positions in checkpoints, and the mid-epoch (also elastic) resume they give.

Every checkpoint written while fitting stores one position per training loader, for every rank::

    {"version": 1, "loaders": [{"epoch": 3, "seed": 42, "length": 1438, "kind": "index",
                                "layers": [{"world_size": 2, "consumed": [96, 96]}]}]}

``consumed[r]`` counts the items rank ``r`` finished; a resume on any world size regenerates the epoch's stream
and reads exactly the items no rank consumed (see :mod:`~ddp_strategy.sampling.sampler`). Plain ints, strings and
lists: the file loads with ``torch.load(weights_only=True)``. Lightning does not fast-forward a loader on a
mid-epoch restart (it counts the batches it believes done), so :func:`restore_batch_counter` sets that count.
"""

from __future__ import annotations

import sys
import warnings
from contextlib import ExitStack
from typing import TYPE_CHECKING, Any

from ddp_strategy._compat import lightning_private as _pl
from ddp_strategy._compat.namespace import TrainerFn, rank_zero_info, rank_zero_warn
from ddp_strategy.sampling.loaders import flat_loaders, injected_sampler
from ddp_strategy.sampling.sampler import _EpochShards

if TYPE_CHECKING:
    from lightning.pytorch import Trainer

#: Checkpoint key under which the strategy stores the training samplers' positions.
CHECKPOINT_KEY = "ddp_strategy_sampler"
#: Format version of that entry.
STATE_VERSION = 1
#: Start of Lightning's warning about resuming mid-epoch with a loader that has no ``state_dict``; it does not
#: apply to loaders with our samplers, which resume from the checkpoint's sampler position.
LIGHTNING_NOT_RESUMABLE_WARNING = "You're resuming from a checkpoint that ended before the epoch ended"


def _train_samplers(trainer: Trainer) -> list[_EpochShards]:
    """The samplers MyDDPStrategy injected into ``trainer``'s training loaders (one, or lists/dicts of them)."""
    return [s for s in map(injected_sampler, flat_loaders(trainer.train_dataloader)) if s is not None]


def save_positions(trainer: Trainer | None, checkpoint: dict[str, Any]) -> None:
    """Add the training samplers' positions (every rank's, see
    :meth:`~ddp_strategy.sampling.sampler._EpochShards.position`) to ``checkpoint`` under :data:`CHECKPOINT_KEY`.

    While fitting with injected samplers; otherwise a no-op. No collective: each rank computes the same entry.
    """
    if trainer is None or trainer.state.fn != TrainerFn.FITTING or not (samplers := _train_samplers(trainer)):
        return
    # the batches whose step ran: where Lightning's loop resumes (a batch interrupted by an exception is counted
    # ready, not processed, and is run again)
    done = trainer.fit_loop.epoch_loop.batch_progress.current.processed
    if done >= trainer.num_training_batches:  # the epoch reached its end (or its limit_train_batches): no rest
        done = sys.maxsize
    checkpoint[CHECKPOINT_KEY] = {"version": STATE_VERSION, "loaders": [s.position(done) for s in samplers]}


def read_positions(checkpoint: dict[str, Any]) -> list[dict[str, Any]]:
    """The positions stored in ``checkpoint``, one per training loader (``[]`` if none).

    An entry this version cannot read is ignored with a warning (Lightning's ``ddp`` loads such a file): the
    epoch's data then restarts, as under Lightning.
    """
    entry = checkpoint.get(CHECKPOINT_KEY)
    readable = (
        isinstance(entry, dict) and entry.get("version") == STATE_VERSION and isinstance(entry.get("loaders"), list)
    )
    if entry is not None and not readable:
        rank_zero_warn(
            f"The checkpoint's {CHECKPOINT_KEY!r} entry is not a version-{STATE_VERSION} sampler position:"
            f" {entry!r}. It was written by another version of ddp_strategy. It is ignored: the checkpoint"
            " loads, and a mid-epoch resume restarts the epoch's data as under Lightning's ddp."
        )
    return list(entry["loaders"]) if readable else []  # type: ignore[index]


def restore_batch_counter(trainer: Trainer, until_teardown: ExitStack) -> None:
    """After a mid-epoch resume, set Lightning's batch counter to ``num_training_batches - batches left``.

    At ``on_train_start`` (after the fit loop's restart bookkeeping has set ``current_epoch``, before the epoch
    loop's reset); no collective. Needed after an elastic resume (each new rank has another number of batches left)
    and on Lightning 2.4 (``_pl.resumed_batch_count``). Under ``limit_train_batches``, and with several training
    loaders (each resumes at its own saved position, Lightning counts one for all), Lightning's restored counter
    is kept. Lightning's "dataloader is not resumable" warning, which does not apply, is silenced until
    ``until_teardown`` closes; where a loader cannot resume exactly it stays, with ours: one of several loaders
    that had read all its data this epoch (a ``CombinedLoader`` starts it again), or several on a new world size.
    """
    samplers, epoch, world_size = _train_samplers(trainer), trainer.current_epoch, trainer.world_size
    pending = [(s, left) for s in samplers if (left := s.pending_resume_batches(epoch)) is not None]
    if not pending:
        return
    resumed, limit, several = _pl.resumed_batch_count(trainer), trainer.limit_train_batches, len(samplers) > 1
    limited = isinstance(limit, int) or (isinstance(limit, float) and limit < 1.0)  # Lightning's count is kept
    done = resumed if several or limited else max(int(trainer.num_training_batches) - pending[0][1], 0)
    if several and (
        len(pending) < len(samplers) or any(s.resumed_layers(epoch)[-1]["world_size"] != world_size for s, _ in pending)
    ):
        rank_zero_warn(
            f"MyDDPStrategy: resuming epoch {epoch} mid-epoch, {len(pending)} of {len(samplers)} training loaders"
            f" continue at their saved sampler position on {world_size} processes; the others had read all their"
            " data and start it again, or the world size changed their remaining batch counts. This epoch's data"
            " is not exactly the uninterrupted run's; an end-of-epoch checkpoint resumes exactly."
        )
    else:
        until_teardown.enter_context(warnings.catch_warnings())
        warnings.filterwarnings("ignore", message=LIGHTNING_NOT_RESUMABLE_WARNING)
        rank_zero_info(
            f"MyDDPStrategy: resuming epoch {epoch} at the saved sampler position of {len(pending)} training"
            f" loader(s) on {world_size} processes (batch counter set to {done})."
        )
    _pl.shift_epoch_batch_progress(trainer, done - resumed)
    for injected, _ in pending:
        injected.batch_offset = done
