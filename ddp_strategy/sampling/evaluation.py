"""Exact evaluation shards with the same number of batches on every rank; a guard where that cannot be had.

Validation and test loaders are sharded without padding (:mod:`ddp_strategy.sampling.sampler`), so every sample is
evaluated exactly once. Their batches are then laid out by :class:`EqualCountBatchSampler` so that every rank
takes the same number of steps, ``K = ceil(ceil(N / W) / B)`` - the number Lightning's padded
``DistributedSampler`` gives: a rank whose shard is one sample shorter makes its *first* batch one sample
smaller. 17 samples, batch size 4, 2 ranks:

* rank 0: ``[0, 2, 4, 6]``, ``[8, 10, 12, 14]``, ``[16]``;
* rank 1: ``[1, 3, 5]``, ``[7, 9, 11, 13]``, ``[15]`` (Lightning: ``[1, 3, 5, 7]``, ``[9, 11, 13, 15]``,
  ``[0]``, sample 0 a second time).

So every per-step collective meets (``self.log(..., on_step=True, sync_dist=True)``, ``self.all_gather``,
``strategy.reduce/broadcast/barrier``, torchmetrics' ``dist_sync_on_step=True``), and with
:func:`ddp_strategy.process.collectives.all_gather_padded` the rows an uneven ``all_gather`` lacks are exactly the
padding samples Lightning's sampler would have added - in the first step, which holds them.

Where no such layout exists - ``batch_size=1`` or no batching, fewer samples than ranks, ``drop_last=True`` -
and N is not a multiple of W, the loader is sharded exactly as Lightning's ddp shards it (padded by repeating
the first samples) and a one-time warning on rank 0 says that metrics then count those samples twice. A
custom ``batch_sampler`` (whole batches sharded) gets the missing batch by halving one of the rank's batches.

The ranks also agree on their batch counts (:func:`agree_batch_counts`). Where they still differ (the
user's own distributed sampler, an ``IterableDataset``, predict with Lightning's
``UnrepeatedDistributedSamplerWrapper``), :class:`EvaluationStepGuard` raises a clear ``RuntimeError`` the
moment a step requests a strategy collective, before any rank enters it, and the counts are named in the
error of a collective that timed out (one made with ``torch.distributed`` directly).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Generator, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import BatchSampler, DataLoader

from ddp_strategy._compat.namespace import rank_zero_warn
from ddp_strategy.sampling import injection
from ddp_strategy.sampling.sampler import ShardedBatchSampler, _EpochShards

#: Attribute set on an evaluation loader: its number of batches on every rank, as a tuple.
BATCH_COUNTS_ATTR = "_ddp_strategy_batch_counts"


class EqualCountBatchSampler(BatchSampler):
    """Batches this rank's exact shard into as many batches as the longest rank's shard makes.

    Rank ``r`` holds ``n_r`` samples, ``ceil(N / W)`` or one fewer. It yields
    ``K = ceil(ceil(N / W) / batch_size)`` batches on every rank: a full-length shard is batched as usual;
    a shard one sample shorter gets a first batch of ``batch_size - 1`` samples, then full ones (it is
    batched as if Lightning's padding sample stood at its front, then that sample is left out). Needs
    ``batch_size >= 2`` and ``N >= W`` whenever N is not a multiple of W (see :func:`needs_padding`).

    Args:
        sampler: the injected, unpadded evaluation sampler of this rank.
        batch_size: B, the loader's per-device batch size.
    """

    def __init__(self, sampler: _EpochShards, batch_size: int) -> None:
        super().__init__(sampler, batch_size, drop_last=False)  # type: ignore[arg-type]
        self.longest = math.ceil(sampler.stream_length() / sampler.num_replicas)

    def __len__(self) -> int:
        """K: the same on every rank."""
        return math.ceil(self.longest / self.batch_size)

    def __iter__(self) -> Iterator[list[Any]]:
        items = list(self.sampler)
        first = self.batch_size - (self.longest - len(items))
        assert first >= 1 or not items, "needs_padding() should have sent this loader to the padded sampler"
        if items:
            yield items[:first]
        for start in range(first, len(items), self.batch_size):
            yield items[start:start + self.batch_size]


class EqualCountBatches:
    """A custom batch sampler sharded by whole batches, with as many batches on every rank.

    Rank ``r`` reads batches ``r, r + W, ...`` of the epoch's draw (:class:`ShardedBatchSampler`), so it may
    hold one batch fewer than rank 0. It then halves its first batch of two or more samples (every sample
    still read once). Only if all its batches hold one sample (or it has none) does it read the draw's
    first batch again, as Lightning's padding would, and warn.

    Args:
        batches: this rank's unpadded :class:`ShardedBatchSampler`.
    """

    def __init__(self, batches: ShardedBatchSampler) -> None:
        self.sampler = batches  # where Lightning and the injection look for the sampler
        self.batch_size = getattr(batches.sampler, "batch_size", None)
        self.drop_last = False

    def __len__(self) -> int:
        return math.ceil(self.sampler.stream_length() / self.sampler.num_replicas)

    def __iter__(self) -> Iterator[list[Any]]:
        mine = [list(b) for b in self.sampler]
        while len(mine) < len(self):
            split = next((j for j, b in enumerate(mine) if len(b) >= 2), None)
            if split is None:
                stream = self.sampler._stream(self.sampler.epoch)
                position = len(mine) * self.sampler.num_replicas + self.sampler.rank
                mine.append(list(stream[position % len(stream)]))  # DistributedSampler's padding rule
                warnings.warn(f"[rank {self.sampler.rank}] the custom batch sampler gives this rank fewer batches"
                              " than rank 0, each of one sample, so one batch is evaluated twice (as under"
                              " Lightning's ddp) and metrics count it twice.", UserWarning, stacklevel=2)
                continue
            half = len(mine[split]) // 2
            mine[split:split + 1] = [mine[split][:half], mine[split][half:]]
        yield from mine


def needs_padding(dataloader: DataLoader, num_replicas: int) -> str | None:
    """Why ``dataloader`` cannot be evaluated exactly with equal batch counts, or ``None`` if it can.

    Only index-based loaders are judged here (a custom batch sampler is handled by
    :class:`EqualCountBatches`). With N samples, W ranks and batch size B, an exact layout exists when N is a
    multiple of W, or when B >= 2, N >= W and the incomplete last batch is kept (``drop_last=False``).

    Returns:
        A phrase naming the reason (for the warning), or ``None``.
    """
    source = injection.original_sampler(dataloader)
    if source is None:
        return None
    n = len(source)
    if n % num_replicas == 0:
        return None
    batch_sampler = dataloader.batch_sampler
    if batch_sampler is None:
        return "the loader does not batch (batch_size=None)"
    if bool(getattr(batch_sampler, "drop_last", False)):
        return "the loader drops its incomplete last batch (drop_last=True)"
    if int(getattr(batch_sampler, "batch_size", 1)) < 2:
        return "batch_size=1 leaves a shorter rank no batch to make one sample smaller"
    if n < num_replicas:
        return f"there are fewer samples ({n}) than ranks ({num_replicas})"
    return None


def shard_for_evaluation(dataloader: object, num_replicas: int, rank: int, seed: int,
                         epoch_fn: Callable[[], int] | None, stage: str) -> object:
    """Shard a validation or test loader exactly, with the same number of batches on every rank.

    Index-based loaders get an unpadded sampler and :class:`EqualCountBatchSampler`; custom batch samplers
    :class:`EqualCountBatches`. Where :func:`needs_padding` finds no exact layout, the loader is sharded as
    Lightning's ddp shards it (padded) and rank 0 warns once. Loaders the strategy does not shard (see
    :func:`ddp_strategy.sampling.injection.needs_distributed_sampler`) are returned unchanged.

    Args:
        dataloader: the user's loader.
        num_replicas, rank, seed, epoch_fn: as for :func:`ddp_strategy.sampling.injection.inject_distributed_sampler`.
        stage: ``"validation"`` or ``"test"``, for the warning.

    Returns:
        The sharded loader.
    """
    if not injection.needs_distributed_sampler(dataloader):
        return injection.inject_distributed_sampler(dataloader, num_replicas, rank, seed, epoch_fn, pad=False)
    assert isinstance(dataloader, DataLoader)
    reason = needs_padding(dataloader, num_replicas)
    if reason is not None:
        n = len(injection.original_sampler(dataloader))
        repeats = -n % num_replicas
        rank_zero_warn(
            f"The {stage} loader has {n} samples for {num_replicas} ranks and {reason}, so the ranks cannot"
            f" hold the same number of batches with every sample exactly once. Like Lightning's ddp, its shards"
            f" are padded: {repeats} sample(s) are evaluated twice, and {stage} metrics count them twice."
            f" For exact metrics use batch_size >= 2 and drop_last=False with at least {num_replicas} samples,"
            f" or a data set whose size is a multiple of {num_replicas}."
        )
        return injection.inject_distributed_sampler(dataloader, num_replicas, rank, seed, epoch_fn, pad=True,
                                                    training=False)
    loader = injection.inject_distributed_sampler(dataloader, num_replicas, rank, seed, epoch_fn, pad=False)
    built = injection.injected_sampler(loader)
    batch_sampler = getattr(loader, "batch_sampler", None)
    if isinstance(built, ShardedBatchSampler) and batch_sampler is built:
        _set_batch_sampler(loader, EqualCountBatches(built))
    elif built is not None and type(batch_sampler) is BatchSampler and batch_sampler.sampler is built:
        _set_batch_sampler(loader, EqualCountBatchSampler(built, int(batch_sampler.batch_size)))
    return loader


def _set_batch_sampler(loader: object, batch_sampler: object) -> None:
    """Replace a built ``DataLoader``'s batch sampler in place.

    ``DataLoader.__setattr__`` forbids it after construction, but the loader reads ``batch_sampler`` only
    when it creates an iterator and for ``len()``, so replacing it keeps every other argument, also those
    of a ``DataLoader`` subclass, which a re-construction could lose.
    """
    object.__setattr__(loader, "batch_sampler", batch_sampler)


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
        #: the last step that ran on a loader with uneven batch counts: (stage, counts); kept for error messages.
        self.last_uneven: tuple[str, tuple[int, ...]] | None = None

    @contextmanager
    def step(self, stage: str, dataloader: object, limit: int | float) -> Generator[None, None, None]:
        """Mark an evaluation step of ``stage`` (``"validation_step"``, ...) on ``dataloader`` as running."""
        counts = getattr(dataloader, BATCH_COUNTS_ATTR, None)
        previous = self._active
        if counts is not None:
            counts = effective_counts(counts, limit)
            self._active = (stage, counts) if len(set(counts)) > 1 else None
            if self._active is not None:
                self.last_uneven = self._active
        try:
            yield
        finally:
            self._active = previous

    def describe_uneven(self) -> str | None:
        """A sentence naming the last uneven evaluation loader's batch counts, for a collective's error."""
        if self.last_uneven is None:
            return None
        stage, counts = self.last_uneven
        return (
            f"The ranks were running {stage} on a loader whose ranks hold different numbers of batches"
            f" {list(counts)} (ranks 0..{len(counts) - 1}), so a collective made in every step directly with"
            " torch.distributed (for example a torchmetrics metric with dist_sync_on_step=True) waits on the ranks"
            " with fewer batches: sync at epoch end instead (dist_sync_on_step=False), or give every rank the same"
            " number of batches."
        )

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
            f" different numbers of batches {list(counts)} (ranks 0..{len(counts) - 1}) - predict shards (Lightning's"
            " UnrepeatedDistributedSamplerWrapper), your own distributed sampler and IterableDatasets are not evened"
            " out. A per-step collective would pair with a different step on the other ranks and hang or return a"
            " wrong value. Log with on_step=False (the epoch-level sync_dist value is exact), move the collective"
            " to the epoch-end hook (on_predict_epoch_end, ...), or give every rank the same number of batches."
        )


def current_loader(dataloaders: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> object | None:
    """The loader a step runs on: ``dataloaders[dataloader_idx]`` (Lightning passes the index third, if >1 loader)."""
    if dataloaders is None:
        return None
    loaders = list(dataloaders.values()) if isinstance(dataloaders, dict) else (
        list(dataloaders) if isinstance(dataloaders, (list, tuple)) else [dataloaders])
    index = kwargs.get("dataloader_idx", args[2] if len(args) > 2 else 0)
    return loaders[index] if isinstance(index, int) and 0 <= index < len(loaders) else None


__all__ = ["BATCH_COUNTS_ATTR", "EqualCountBatchSampler", "EqualCountBatches", "EvaluationStepGuard",
           "agree_batch_counts", "current_loader", "effective_counts", "needs_padding", "shard_for_evaluation"]


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
