"""Putting the distributed samplers into the user's loaders: which loaders, which sampler, and bad input.

For each ``DataLoader`` a ``*_dataloader`` hook returns, :func:`inject_distributed_sampler` decides whether it
needs sharding (not when it already has a distributed sampler, one of ours, or an ``IterableDataset``),
checks that the shards make sense (:func:`check_shard_sizes`), builds the matching sampler from
:mod:`ddp_strategy.sampling.sampler` and rebuilds the loader around it with its other arguments kept.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler, SequentialSampler
from torch.utils.data.distributed import DistributedSampler

from ddp_strategy._compat import lightning_private as _pl
from ddp_strategy._compat.namespace import rank_zero_warn
from ddp_strategy.sampling.sampler import (
    EpochSeededDistributedSampler,
    ShardedBatchSampler,
    ShardedSampler,
    _EpochShards,
)


def loader_shuffles(dataloader: DataLoader) -> bool:
    """Whether ``dataloader`` was built to shuffle (``shuffle=True`` makes a ``RandomSampler``).

    Args:
        dataloader: a :class:`~torch.utils.data.DataLoader`.

    Returns:
        True for a ``RandomSampler``, False for a ``SequentialSampler`` or any other sampler.
    """
    return isinstance(original_sampler(dataloader), RandomSampler)


def original_sampler(dataloader: DataLoader) -> Any:
    """The sampler of indices behind ``dataloader``, or ``None`` when it has a custom batch sampler.

    ``DataLoader(batch_size=B)`` and ``DataLoader(batch_sampler=BatchSampler(s, B, drop_last))`` both read
    indices from a sampler; any other ``batch_sampler`` yields whole batches itself.
    """
    batch_sampler = dataloader.batch_sampler
    if batch_sampler is None:
        return dataloader.sampler
    if type(batch_sampler) is BatchSampler:
        return batch_sampler.sampler
    return None


def _is_plain_permutation(sampler: Any) -> bool:
    """A ``RandomSampler`` as ``shuffle=True`` makes it: one permutation of the data set, no replacement."""
    return (isinstance(sampler, RandomSampler) and not sampler.replacement
            and getattr(sampler, "_num_samples", None) is None)


def distributed_sampler_for(
    dataloader: DataLoader,
    num_replicas: int,
    rank: int,
    seed: int,
    epoch_fn: Callable[[], int] | None = None,
    pad: bool = True,
) -> Any:
    """Build the distributed (batch) sampler that replaces ``dataloader``'s, keeping its order semantics.

    ``RandomSampler`` and ``SequentialSampler`` (what ``shuffle=True/False`` create) become an
    :class:`EpochSeededDistributedSampler`; any other sampler a :class:`ShardedSampler`; a custom batch
    sampler a :class:`ShardedBatchSampler`.

    Args:
        dataloader: the user's loader.
        num_replicas: world size W.
        rank: global rank.
        seed: shuffle seed shared by all ranks.
        epoch_fn, pad: see :class:`EpochSeededDistributedSampler`.

    Returns:
        The sampler (for a custom batch sampler: the batch sampler), with ``set_epoch``.
    """
    source = original_sampler(dataloader)
    built: _EpochShards
    if source is None:
        built = ShardedBatchSampler(dataloader.batch_sampler, num_replicas, rank, seed, epoch_fn, pad)
    elif _is_plain_permutation(source) or isinstance(source, SequentialSampler):
        built = EpochSeededDistributedSampler(dataloader.dataset, num_replicas=num_replicas, rank=rank,
                                              shuffle=isinstance(source, RandomSampler), seed=seed,
                                              epoch_fn=epoch_fn, pad=pad)
    else:
        built = ShardedSampler(source, num_replicas, rank, seed, epoch_fn, pad)
    if source is not None and dataloader.batch_sampler is not None:
        built.items_per_batch = int(dataloader.batch_sampler.batch_size)  # type: ignore[attr-defined]
        built.drop_last_batch = bool(dataloader.batch_sampler.drop_last)  # type: ignore[attr-defined]
    return built


#: Start of the warning :func:`warn_if_order_kept` gives: ``warnings.filterwarnings("ignore", message=...)`` with
#: it silences the warning where the loader's order is intended.
ORDER_KEPT_WARNING = "MyDDPStrategy keeps the training loader's order"


def warn_if_order_kept(dataloader: object, world_size: int, overfit_batches: int | float = 0) -> None:
    """Warn once (rank 0) when the training batches differ from Lightning's ``ddp`` because the order is kept.

    Lightning's ``ddp`` shuffles every training loader it shards, whatever the loader was built with: its
    ``_process_dataloader`` passes ``shuffle=True`` for training to the ``DistributedSampler`` it injects (a
    ``DistributedSamplerWrapper`` around any other sampler, whose draw is then shuffled), except with
    ``overfit_batches``, where it reads the data in order. :func:`distributed_sampler_for` shuffles only a loader
    built with ``shuffle=True`` (the same permutation and shards as Lightning's, so the same weights) and keeps
    any other loader's order (docs/differences.md): ``shuffle=False``, order-preserving or random samplers of
    the user's and custom batch samplers. There, the batches each rank reads, and so the trained weights,
    differ from a run with ``strategy="ddp"``; the warning says so and what gives Lightning's batches.

    Args:
        dataloader: the training loader, before injection (anything a ``train_dataloader`` hook returns).
        world_size: W.
        overfit_batches: ``Trainer.overfit_batches``; when set, Lightning's ``ddp`` keeps the order too.
    """
    if overfit_batches or not needs_distributed_sampler(dataloader):
        return
    assert isinstance(dataloader, DataLoader)
    source = original_sampler(dataloader)
    if _is_plain_permutation(source):
        return
    shards = (f"rank r of {world_size} reads positions r, r + {world_size}, r + {2 * world_size}, ..." if world_size > 1
              else "the one process reads every position")
    if isinstance(source, SequentialSampler):
        what = f"its sampler is a SequentialSampler (shuffle=False), so {shards} of the data set, every epoch"
        lightning = ("shuffles training data even with shuffle=False (its DistributedSampler for training always has"
                     " shuffle=True)")
        advice = "For Lightning's batches and weights pass shuffle=True to the training DataLoader"
    elif source is not None:
        what = (f"its sampler is a {type(source).__name__}, drawn once per epoch (the same draw on every rank), and"
                f" {shards} of that draw, in its order")
        lightning = ("has each rank draw with its own global random state and shuffles the positions (its"
                     " DistributedSamplerWrapper for training always has shuffle=True)")
        advice = "MyDDPStrategy has no setting that gives Lightning's batches here"
    else:
        what = (f"its batch sampler is a {type(dataloader.batch_sampler).__name__}, whose batches are read whole and"
                f" in order ({shards} of each epoch's batches)")
        lightning = ("re-creates the batch sampler around a shuffling DistributedSampler (or raises TypeError where"
                     " it cannot)")
        advice = "MyDDPStrategy has no setting that gives Lightning's batches here"
    rank_zero_warn(
        f"{ORDER_KEPT_WARNING}: {what}. Lightning's strategy='ddp' {lightning}, so the batches each rank reads, and"
        f" the trained weights, differ from a run with strategy='ddp'. {advice}; if the order is intended, silence"
        f" this with warnings.filterwarnings('ignore', message=\"{ORDER_KEPT_WARNING}\")."
    )


def injected_sampler(dataloader: object) -> _EpochShards | None:
    """The sampler this module injected into ``dataloader`` (sampler or batch sampler), else ``None``."""
    for candidate in (getattr(dataloader, "batch_sampler", None), getattr(dataloader, "sampler", None),
                      getattr(getattr(dataloader, "batch_sampler", None), "sampler", None)):
        if isinstance(candidate, _EpochShards):
            return candidate
    return None


def _is_distributed(obj: object) -> bool:
    """A user's ``DistributedSampler``, or a batch sampler that shards itself (has ``num_replicas``/``rank``)."""
    return isinstance(obj, DistributedSampler) or (hasattr(obj, "num_replicas") and hasattr(obj, "rank"))


def needs_distributed_sampler(dataloader: object) -> bool:
    """Whether :func:`inject_distributed_sampler` would replace ``dataloader``'s sampler.

    Args:
        dataloader: anything a ``*_dataloader`` hook returned.

    Returns:
        False for non-``DataLoader`` objects, iterable-style data sets (which have no indices to shard,
        see :func:`shard_iterable`), loaders that already carry one of our samplers (injection happens once)
        and loaders whose sampler or batch sampler is already distributed (the user's own is respected).
    """
    if not isinstance(dataloader, DataLoader) or isinstance(dataloader.dataset, IterableDataset):
        return False
    if injected_sampler(dataloader) is not None:
        return False
    batch_sampler = dataloader.batch_sampler
    return not any(_is_distributed(s) for s in (dataloader.sampler, batch_sampler,
                                                getattr(batch_sampler, "sampler", None)) if s is not None)


def check_shard_sizes(dataloader: DataLoader, num_replicas: int, training: bool, pad: bool | None = None) -> None:
    """Raise early (the same error on every rank) when ``dataloader`` cannot be sharded sensibly.

    Args:
        dataloader: the user's loader (before injection).
        num_replicas: world size W.
        training: True for the training loader (padded shards, equal step counts).
        pad: whether the shards are padded (default: ``training``); an evaluation loader is padded, as
            Lightning pads it, when it has fewer samples than ranks.

    Warns (rank 0) when a padded loader has fewer items than ranks (some ranks then read only repeats), and for
    training when a ``batch_size`` is larger than each rank's shard (every step sees a short batch); Lightning's
    ``ddp`` runs both.

    Raises:
        ValueError: fewer items than ranks on an unpadded loader;
            ``drop_last=True`` with a shard smaller than one batch (no batch at all).
    """
    source = original_sampler(dataloader)
    n = len(source if source is not None else dataloader.batch_sampler)  # type: ignore[arg-type]
    what = "samples" if source is not None else "batches"
    pad = training if pad is None else pad
    if n < num_replicas and not pad:
        raise ValueError(
            f"The loader has {n} {what} but there are {num_replicas} ranks: some rank would get nothing."
            f" Use a data set with at least {num_replicas} {what}, or fewer devices."
        )
    if n < num_replicas:
        # Lightning's ddp pads such a loader with repeats (DistributedSampler): run it, but say so.
        rank_zero_warn(
            f"The loader has {n} {what} but there are {num_replicas} ranks: the shards are padded with repeats"
            f" (as Lightning's DistributedSampler pads them), so some ranks read the same {what}. Use a data set"
            f" with at least {num_replicas} {what}, or fewer devices."
        )
    batch_sampler = dataloader.batch_sampler
    if source is None or batch_sampler is None:
        return
    batch_size, drop_last = int(batch_sampler.batch_size), bool(batch_sampler.drop_last)  # type: ignore[attr-defined]
    smallest_shard = math.ceil(n / num_replicas) if pad else n // num_replicas
    if drop_last and smallest_shard < batch_size:
        raise ValueError(
            f"drop_last=True with batch_size={batch_size}, but a rank's shard has only {smallest_shard} samples"
            f" ({n} samples over {num_replicas} ranks): that rank would get no batch at all. Lower batch_size"
            f" to at most {smallest_shard}, set drop_last=False, or use fewer devices."
        )
    if training and smallest_shard < batch_size:
        # Lightning's ddp runs this (one short batch per rank and epoch): say so, do not refuse it.
        rank_zero_warn(
            f"batch_size={batch_size} is per device, but each rank's training shard has only {smallest_shard}"
            f" samples ({n} samples over {num_replicas} ranks), so every step sees a short batch. Lower"
            f" batch_size to at most {smallest_shard} (the global batch is batch_size x {num_replicas}), or use"
            " fewer devices."
        )


def _rebuild_with_batch_sampler(dataloader: DataLoader, batch_sampler: Any) -> DataLoader:
    """Re-create ``dataloader`` (any ``DataLoader`` subclass) with ``batch_sampler`` and its other arguments."""
    return _pl.update_dataloader_batch_sampler(dataloader, batch_sampler)


def inject_distributed_sampler(
    dataloader: object,
    num_replicas: int,
    rank: int,
    seed: int,
    epoch_fn: Callable[[], int] | None = None,
    pad: bool = True,
    training: bool | None = None,
) -> object:
    """Return ``dataloader`` rebuilt with a distributed sampler, or unchanged when it needs none.

    The loader is re-created with Lightning's own re-instantiation logic where it can (so ``DataLoader``
    subclass arguments are kept), else with the same workers, collate function and pinning. ``batch_size``
    stays the per-device batch size B: the global batch is ``B * num_replicas``.

    Args:
        dataloader: the user's loader (see :func:`needs_distributed_sampler` for what is left alone).
        num_replicas: world size W.
        rank: global rank.
        seed: shuffle seed shared by all ranks.
        epoch_fn, pad: see :class:`EpochSeededDistributedSampler`; pass ``pad=False`` for evaluation loaders.
        training: whether this is the training loader, for :func:`check_shard_sizes`; default ``pad``
            (an evaluation loader padded as Lightning pads it passes ``pad=True, training=False``).

    Returns:
        The new loader, or ``dataloader`` itself.

    Raises:
        ValueError: see :func:`check_shard_sizes`.
        MisconfigurationException: a ``DataLoader`` subclass whose ``__init__`` arguments Lightning cannot
            find (as under Lightning's own sampler injection).
    """
    if not needs_distributed_sampler(dataloader):
        return dataloader
    assert isinstance(dataloader, DataLoader)
    check_shard_sizes(dataloader, num_replicas, training=pad if training is None else training, pad=pad)
    built = distributed_sampler_for(dataloader, num_replicas, rank, seed, epoch_fn, pad)
    if isinstance(built, ShardedBatchSampler):
        return _rebuild_with_batch_sampler(dataloader, built)
    if dataloader.batch_sampler is not None and dataloader.batch_size is None:
        # DataLoader(batch_sampler=BatchSampler(s, B, drop_last)): keep B and drop_last.
        batch_sampler = BatchSampler(built, built.items_per_batch, built.drop_last_batch)
        return _rebuild_with_batch_sampler(dataloader, batch_sampler)
    return _pl.update_dataloader(dataloader, built)


def flatten_loaders(loaders: Any) -> list[Any]:
    """The loaders in ``loaders`` (one loader, or lists/tuples/dicts of them, as Lightning's hooks return)."""
    if loaders is None:
        return []
    if isinstance(loaders, dict):
        return [dl for value in loaders.values() for dl in flatten_loaders(value)]
    if isinstance(loaders, (list, tuple)):
        return [dl for value in loaders for dl in flatten_loaders(value)]
    return [loaders]


def warn_if_not_shardable(dataloader: object, world_size: int) -> None:
    """Warn once (rank 0) when ``dataloader`` cannot be sharded, so every rank reads all of it.

    Lightning accepts any iterable as a loader (``trainer.test(model, [batch])``: it flattens the list and
    iterates each tensor; a custom iterable; a ``DataLoader`` over an ``IterableDataset``). None of these has
    indices to shard. As under Lightning's ``ddp``, every rank iterates the whole of it, which is what the
    warning says, with what to do to shard it. An empty list (Lightning's "no loader") and ``DataLoader``
    objects over map-style data sets are not warned about.

    Args:
        dataloader: what a ``*_dataloader`` hook (or ``dataloaders=``) gave, one loader after Lightning's
            flattening.
        world_size: W; with W == 1 there is nothing to shard and no warning.
    """
    if world_size == 1 or (isinstance(dataloader, (list, tuple)) and not dataloader):
        return
    if isinstance(dataloader, DataLoader):
        if isinstance(dataloader.dataset, IterableDataset):
            rank_zero_warn(
                f"{type(dataloader.dataset).__name__} is an IterableDataset: it has no indices, so MyDDPStrategy"
                " cannot shard it and every rank reads whatever its __iter__ yields. Shard it yourself in __iter__"
                " with ddp_strategy.shard_iterable (by rank and DataLoader worker), or every rank sees the same data."
            )
        return
    rank_zero_warn(
        f"MyDDPStrategy got a {type(dataloader).__name__} as a loader, not a torch.utils.data.DataLoader: it cannot"
        f" be sharded, so each of the {world_size} ranks iterates all of it (as under Lightning's ddp) and sees the"
        " same batches. To give every rank its own part, wrap the data in a Dataset and a DataLoader."
    )
