"""Distributed sampler injection and per-epoch seeding.

Each rank must read a disjoint shard of the data set, and the shuffle must change every epoch. PyTorch's
:class:`~torch.utils.data.distributed.DistributedSampler` does the sharding; it reshuffles only when
``set_epoch`` is called before each epoch's iterator is made
(https://pytorch.org/docs/stable/data.html#torch.utils.data.distributed.DistributedSampler). Forgetting that
call is the classic DDP bug (the same order every epoch), so the sampler below reads the epoch from the
trainer itself each time an iterator is created.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
from lightning.fabric.utilities.distributed import DistributedSamplerWrapper
from torch.utils.data import DataLoader, Dataset, IterableDataset, RandomSampler, SequentialSampler
from torch.utils.data.distributed import DistributedSampler

from ddp_strategy import _lightning_private as _pl

#: Seed used for shuffling when neither the strategy nor ``seed_everything`` set one.
DEFAULT_SEED = 0


def shared_seed(seed: int | None = None) -> int:
    """Return the shuffle seed: ``seed`` if given, else ``seed_everything``'s (``PL_GLOBAL_SEED``), else 0.

    Args:
        seed: an explicit seed, or ``None``.

    Returns:
        The seed as an int. The strategy broadcasts rank 0's value so every rank uses the same one.
    """
    if seed is not None:
        return int(seed)
    return int(os.environ.get("PL_GLOBAL_SEED", DEFAULT_SEED))


class EpochSeededDistributedSampler(DistributedSampler):
    """A :class:`~torch.utils.data.distributed.DistributedSampler` that sets its own epoch.

    Sharding is PyTorch's: with ``shuffle=True`` the permutation of ``range(len(dataset))`` is drawn from a
    generator seeded with ``seed + epoch``; the list is padded by repeating its head to a multiple of
    ``num_replicas``; rank ``r`` takes positions ``r, r + num_replicas, ...``. For 5 samples, 2 ranks and
    ``shuffle=False``: rank 0 gets ``[0, 2, 4]`` and rank 1 gets ``[1, 3, 0]`` (index 0 is padding).

    With ``pad=False`` (used for evaluation) nothing is repeated: rank ``r`` takes positions
    ``r, r + W, ...`` of the unpadded list, so every sample is evaluated exactly once across ranks and ranks
    may get one sample less than others (rank 0 ``[0, 2, 4]``, rank 1 ``[1, 3]`` in the example above).

    When ``epoch_fn`` is given, ``__iter__`` calls ``set_epoch(epoch_fn())`` first, so the epoch used is the
    trainer's current epoch whenever an iterator is created (also on the first epoch after a resume, and
    with persistent workers, since sampling happens in the main process). Explicit ``set_epoch`` calls with
    the same value, as Lightning's loops make, are harmless.

    Args:
        dataset: a map-style data set of length N.
        num_replicas: world size W.
        rank: this process's global rank, ``0 <= rank < W``.
        shuffle: reshuffle each epoch (True) or keep the data set's order (False).
        seed: shuffle seed, identical on every rank.
        drop_last: drop the tail instead of padding (each rank then gets ``N // W`` samples).
        epoch_fn: returns the current epoch (0-based); ``None`` leaves ``set_epoch`` to the caller.
        pad: repeat samples so all ranks get the same count (True, needed for training: every rank must
            take the same number of optimizer steps), or not (False, for exact evaluation).

    Raises:
        ValueError: from :class:`DistributedSampler` when ``rank`` is outside ``[0, W)``, or when
            ``pad=False`` is combined with ``drop_last=True``.
    """

    def __init__(
        self,
        dataset: Dataset,
        num_replicas: int,
        rank: int,
        shuffle: bool = True,
        seed: int = DEFAULT_SEED,
        drop_last: bool = False,
        epoch_fn: Callable[[], int] | None = None,
        pad: bool = True,
    ) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed,
                         drop_last=drop_last)
        if not pad and drop_last:
            raise ValueError("pad=False keeps every sample exactly once; it cannot be combined with drop_last=True.")
        self.epoch_fn = epoch_fn
        self.pad = pad
        if not pad:
            self.num_samples = len(range(rank, len(dataset), num_replicas))  # type: ignore[arg-type]
            self.total_size = len(dataset)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[int]:
        if self.epoch_fn is not None:
            self.set_epoch(int(self.epoch_fn()))
        if self.pad:
            return super().__iter__()
        # Same permutation as the padded case, without the padding: each index lands on exactly one rank.
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + self.epoch)
            indices = torch.randperm(len(self.dataset), generator=generator).tolist()  # type: ignore[arg-type]
        else:
            indices = list(range(len(self.dataset)))  # type: ignore[arg-type]
        return iter(indices[self.rank::self.num_replicas])


def loader_shuffles(dataloader: DataLoader) -> bool:
    """Whether ``dataloader`` was built to shuffle (``shuffle=True`` makes a ``RandomSampler``).

    Args:
        dataloader: a :class:`~torch.utils.data.DataLoader`.

    Returns:
        True for a ``RandomSampler``, False for a ``SequentialSampler`` or any other sampler.
    """
    return isinstance(dataloader.sampler, RandomSampler)


def distributed_sampler_for(
    dataloader: DataLoader,
    num_replicas: int,
    rank: int,
    seed: int,
    epoch_fn: Callable[[], int] | None = None,
    pad: bool = True,
) -> Any:
    """Build the distributed sampler that replaces ``dataloader``'s sampler, keeping its shuffle setting.

    ``RandomSampler`` and ``SequentialSampler`` (what ``shuffle=True/False`` create) become an
    :class:`EpochSeededDistributedSampler` over the data set; any other sampler is wrapped in Lightning's
    ``DistributedSamplerWrapper``, which shards the sampler's output by position.

    Args:
        dataloader: the user's loader.
        num_replicas: world size W.
        rank: global rank.
        seed: shuffle seed shared by all ranks.
        epoch_fn, pad: see :class:`EpochSeededDistributedSampler`.

    Returns:
        A sampler with ``set_epoch``.
    """
    if isinstance(dataloader.sampler, (RandomSampler, SequentialSampler)):
        return EpochSeededDistributedSampler(
            dataloader.dataset, num_replicas=num_replicas, rank=rank, shuffle=loader_shuffles(dataloader),
            seed=seed, epoch_fn=epoch_fn, pad=pad,
        )
    return DistributedSamplerWrapper(dataloader.sampler, num_replicas=num_replicas, rank=rank, shuffle=False,
                                     seed=seed)


def check_dataloader_type(dataloader: object, world_size: int) -> None:
    """Refuse loaders the strategy cannot shard: every rank would silently see the same data.

    Args:
        dataloader: what a ``*_dataloader`` hook returned (one loader; Lightning unpacks collections).
        world_size: W; with W == 1 anything goes.

    Raises:
        TypeError: ``dataloader`` is not a :class:`~torch.utils.data.DataLoader` and W > 1.
    """
    if world_size > 1 and not isinstance(dataloader, DataLoader):
        raise TypeError(
            f"MyDDPStrategy got a {type(dataloader).__name__} where a torch.utils.data.DataLoader was expected."
            f" With {world_size} processes each one needs its own shard of the data, which the strategy can only"
            " arrange for a DataLoader. Wrap your data in a Dataset and a DataLoader (or, if you shard it yourself"
            " by rank, in a DataLoader over an IterableDataset)."
        )


def needs_distributed_sampler(dataloader: object) -> bool:
    """Whether :func:`inject_distributed_sampler` would replace ``dataloader``'s sampler.

    Args:
        dataloader: anything a ``*_dataloader`` hook returned.

    Returns:
        False for non-``DataLoader`` objects, iterable-style data sets (which have no indices to shard) and
        loaders whose sampler is already a ``DistributedSampler`` (the user's own is respected).
    """
    return (
        isinstance(dataloader, DataLoader)
        and not isinstance(dataloader.dataset, IterableDataset)
        and not isinstance(dataloader.sampler, DistributedSampler)
        and not isinstance(getattr(dataloader.batch_sampler, "sampler", None), DistributedSampler)
    )


def inject_distributed_sampler(
    dataloader: object,
    num_replicas: int,
    rank: int,
    seed: int,
    epoch_fn: Callable[[], int] | None = None,
    pad: bool = True,
) -> object:
    """Return ``dataloader`` rebuilt with a distributed sampler, or unchanged when it needs none.

    The loader is re-created with Lightning's own re-instantiation logic, so its batch size, workers,
    collate function and ``DataLoader`` subclass arguments are kept. ``batch_size`` stays the per-device
    batch size B: the global batch is ``B * num_replicas``.

    Args:
        dataloader: the user's loader (see :func:`needs_distributed_sampler` for what is left alone).
        num_replicas: world size W.
        rank: global rank.
        seed: shuffle seed shared by all ranks.
        epoch_fn, pad: see :class:`EpochSeededDistributedSampler`; pass ``pad=False`` for evaluation loaders.

    Returns:
        The new loader, or ``dataloader`` itself.
    """
    if not needs_distributed_sampler(dataloader):
        return dataloader
    assert isinstance(dataloader, DataLoader)
    sampler = distributed_sampler_for(dataloader, num_replicas, rank, seed, epoch_fn, pad)
    return _pl.update_dataloader(dataloader, sampler)
