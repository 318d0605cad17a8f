"""Exact evaluation with uneven shards: agree on batch counts, and refuse per-step collectives that would hang.

Validation, test and predict loaders are sharded without padding (:mod:`ddp_strategy.sampler`), so every
sample is evaluated exactly once, and ranks may hold different numbers of batches (23 samples, batch size 4,
2 ranks: 3 and 3 batches; 3 ranks with batch size 2: 4, 4 and 4 batches but 8, 8 and 7 samples; 21 samples,
batch size 4, 2 ranks: 3 and 2 batches).

What stays exact and hang-free:

* epoch-level ``self.log(..., sync_dist=True)``: Lightning accumulates ``sum(value * batch_size)`` and
  ``sum(batch_size)`` per rank and reduces both at epoch end, so the epoch value is the sample-weighted
  mean over all ranks, identical to one process's (``_ResultMetric.compute`` in
  ``lightning/pytorch/trainer/connectors/logger_connector/result.py``);
* torchmetrics metrics: their states (counts, sums) are summed across ranks when computed.

What cannot be exact: a collective inside the step itself (``self.log(..., on_step=True,
sync_dist=True)``, ``self.all_gather``, ``strategy.reduce/broadcast/barrier``). With uneven batch counts the
rank with more batches would make one collective more than the others; it would pair with the others'
epoch-end collective (a wrong value) or wait for ever. :class:`EvaluationStepGuard` therefore raises a
clear ``RuntimeError`` the moment such a collective is requested in a step of a loader whose ranks hold
different numbers of batches. Every rank runs the same step code on its first batch, so every rank raises
the same error before any rank enters the collective: nothing hangs. Collectives made with
``torch.distributed`` directly cannot be seen and are the user's responsibility.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

#: Attribute set on an evaluation loader: its number of batches on every rank, as a tuple.
BATCH_COUNTS_ATTR = "_ddp_strategy_batch_counts"


def agree_batch_counts(dataloader: object) -> tuple[int, ...] | None:
    """All-gather ``len(dataloader)`` from every rank; remember it on the loader and return it.

    A collective: every rank must call it for the same loader (Lightning processes each evaluation loader on
    every rank in the same order). Returns ``None`` (and still takes part in the collective) for a loader
    without ``len``.

    Args:
        dataloader: an evaluation loader after sampler injection.

    Returns:
        ``(batches on rank 0, ..., batches on rank W-1)``, or ``None`` if some rank's loader has no length.
    """
    try:
        local = len(dataloader)  # type: ignore[arg-type]
    except TypeError:
        local = -1
    counts = [local]
    if dist.is_available() and dist.is_initialized():
        gathered = [torch.zeros(1, dtype=torch.long) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, torch.tensor([local], dtype=torch.long))
        counts = [int(t.item()) for t in gathered]
    result = None if min(counts) < 0 else tuple(counts)
    try:
        setattr(dataloader, BATCH_COUNTS_ATTR, result)
    except AttributeError:  # loaders that forbid attributes: the guard then treats the counts as unknown
        pass
    return result


def effective_counts(counts: tuple[int, ...], limit: int | float) -> tuple[int, ...]:
    """Batch counts after Lightning's ``limit_*_batches`` / ``num_sanity_val_steps`` (int: a cap; float: a share)."""
    if isinstance(limit, float):
        return tuple(int(c * limit) if limit < 1.0 else c for c in counts)
    return tuple(min(c, int(limit)) for c in counts)


class EvaluationStepGuard:
    """Knows whether an evaluation step is running on a loader with uneven batch counts, and refuses collectives.

    The strategy wraps each ``validation_step``/``test_step``/``predict_step`` call in :meth:`step` and calls
    :meth:`check` at the top of each of its collectives (``reduce``, ``all_gather``, ``broadcast``,
    ``barrier``).
    """

    def __init__(self) -> None:
        self._active: tuple[str, tuple[int, ...]] | None = None

    @contextmanager
    def step(self, stage: str, dataloader: object, limit: int | float) -> Generator[None, None, None]:
        """Mark an evaluation step of ``stage`` (``"validation_step"``, ...) on ``dataloader`` as running."""
        counts = getattr(dataloader, BATCH_COUNTS_ATTR, None)
        previous = self._active
        if counts is not None:
            counts = effective_counts(counts, limit)
            self._active = (stage, counts) if len(set(counts)) > 1 else None
        try:
            yield
        finally:
            self._active = previous

    def check(self, collective: str, rank: int) -> None:
        """Raise if a collective is requested inside a step whose ranks hold different batch counts.

        Raises:
            RuntimeError: with the stage, the per-rank batch counts and what to do instead.
        """
        if self._active is None:
            return
        stage, counts = self._active
        raise RuntimeError(
            f"[rank {rank}] {stage} requested a collective ({collective}) on every step, but the ranks hold"
            f" different numbers of batches {list(counts)} (ranks 0..{len(counts) - 1}): evaluation shards are"
            " not padded, so that every sample is evaluated exactly once. A per-step collective would pair with a"
            " different step on the other ranks and hang or return a wrong value. Log with on_step=False (the"
            " epoch-level sync_dist value is exact), move the collective to on_validation_epoch_end /"
            " on_test_epoch_end, or make the data set size a multiple of world_size x batch_size."
        )


def current_loader(dataloaders: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> object | None:
    """The loader a step runs on: ``dataloaders[dataloader_idx]`` (Lightning passes the index third, if >1 loader)."""
    if dataloaders is None:
        return None
    loaders = list(dataloaders.values()) if isinstance(dataloaders, dict) else (
        list(dataloaders) if isinstance(dataloaders, (list, tuple)) else [dataloaders])
    index = kwargs.get("dataloader_idx", args[2] if len(args) > 2 else 0)
    return loaders[index] if isinstance(index, int) and 0 <= index < len(loaders) else None


__all__ = ["BATCH_COUNTS_ATTR", "EvaluationStepGuard", "agree_batch_counts", "current_loader", "effective_counts"]


def step_guard(trainer: Any, guard: EvaluationStepGuard, stage: str, args: Sequence[Any],
               kwargs: dict[str, Any]) -> Any:
    """The :class:`EvaluationStepGuard` context for one ``validation_step``, ``test_step`` or ``predict_step``.

    Finds the loader being evaluated and the batch limit Lightning applies to it (``limit_*_batches``, or
    ``num_sanity_val_steps`` during the sanity check).
    """
    assert trainer is not None
    if stage == "validation_step":
        loaders, limit = trainer.val_dataloaders, trainer.limit_val_batches
        if trainer.sanity_checking:
            limit = trainer.num_sanity_val_steps
    elif stage == "test_step":
        loaders, limit = trainer.test_dataloaders, trainer.limit_test_batches
    else:
        loaders, limit = trainer.predict_dataloaders, trainer.limit_predict_batches
    if isinstance(limit, int) and limit < 0:
        limit = 1.0
    return guard.step(stage, current_loader(loaders, args, kwargs), limit)
