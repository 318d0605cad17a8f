"""The distributed samplers: which items each rank reads, each epoch, and where a resumed epoch continues.

Every epoch is a *stream*: what the loader's original sampler yields for that epoch (indices, or whole batches
for a custom batch sampler), regenerated exactly from the shared seed and the epoch. Padded, it is extended by
repeating its head to a multiple of the world size W; rank ``r`` takes positions ``r, r + W, ...`` (PyTorch's
``DistributedSampler`` rule). Unpadded (exact evaluation) each item is read once. Each sampler reads the trainer's
epoch when an iterator is created (nobody calls ``set_epoch``), can start an epoch part-way from a saved position
and reports its own: a list of layers ``{"world_size": W, "consumed": [c_0, ..., c_{W-1}]}``, one per run that
read part of the epoch, each later one (after an elastic resume) sharding what the layers before it left.
:func:`shard_iterable` is the user's tool for ``IterableDataset`` streams, which have no indices to shard.
"""

from __future__ import annotations

import itertools
import math
import os
import random
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import BatchSampler, Dataset, DistributedSampler, Sampler, get_worker_info

from ddp_strategy._compat.namespace import isolate_rng, rank_zero_warn

#: Seed used for shuffling when neither the strategy nor ``seed_everything`` set one.
DEFAULT_SEED = 0


def shared_seed(seed: int | None = None) -> int:
    """The shuffle seed: ``seed`` if given, else ``seed_everything``'s (``PL_GLOBAL_SEED``), else 0."""
    return int(seed) if seed is not None else int(os.environ.get("PL_GLOBAL_SEED", DEFAULT_SEED))


@dataclass(frozen=True)
class Shard:
    """This rank's share of every epoch: rank ``rank`` (``0 <= rank < W``) of ``num_replicas`` = W, with the shuffle
    ``seed`` of every rank; ``epoch_fn`` returns the epoch (0-based) whenever an iterator is created (``None``: the
    caller calls ``set_epoch``); ``pad`` repeats items so every rank reads as many (training: equal optimizer steps),
    else each item is read once (exact evaluation)."""

    num_replicas: int
    rank: int
    seed: int = DEFAULT_SEED
    epoch_fn: Callable[[], int] | None = None
    pad: bool = True


def draw_epoch(source: Iterable[Any], seed: int, epoch: int) -> list[Any]:
    """Everything ``source`` (a sampler or batch sampler) yields for ``epoch``, drawn the same way on every rank.

    Calls ``source.set_epoch(epoch)`` if it exists, and draws with torch's, Python's and NumPy's global generators
    and any ``generator`` attribute of ``source`` or its ``.sampler`` (``RandomSampler``, ``WeightedRandomSampler``,
    ``SubsetRandomSampler``) seeded with ``seed + epoch``, all restored afterwards. A sampler that draws from
    anything else (the clock, ``os.urandom``) is not reproducible and not supported.
    """
    if callable(getattr(source, "set_epoch", None)):
        source.set_epoch(epoch)
    holders = [h for h in (source, getattr(source, "sampler", None)) if h is not None and hasattr(h, "generator")]
    saved = [h.generator for h in holders]
    with isolate_rng(include_cuda=False):  # Lightning's: torch's, Python's and NumPy's states restored on exit
        torch.manual_seed(seed + epoch)
        random.seed(seed + epoch)
        np.random.seed((seed + epoch) % 2**32)
        try:
            for holder in holders:
                holder.generator = torch.Generator().manual_seed(seed + epoch)
            return list(source)
        finally:
            for holder, generator in zip(holders, saved, strict=True):
                holder.generator = generator


def remaining_positions(length: int, layers: list[dict[str, Any]]) -> list[int]:
    """Stream positions (``0 <= p < N``) that no rank of any layer has consumed, in stream order.

    N = 10, one layer ``{"world_size": 2, "consumed": [2, 2]}``: the ranks took padded positions 0, 2 and 1, 3, so
    ``[4, ..., 9]`` are left (consumed positions past the end were padding). Integer arithmetic, no data loaded.
    """
    sequence = list(range(length))
    for layer in layers:
        world_size, consumed = int(layer["world_size"]), [int(c) for c in layer["consumed"]]
        done = {rank + world_size * j for rank, count in enumerate(consumed) for j in range(count)}
        sequence = [p for i, p in enumerate(sequence) if i not in done]
    return sequence


class _EpochShards:
    """Stream -> (resume) -> pad -> stride, and the position reached; subclasses give ``_stream(epoch)`` (the
    epoch's stream, a list) and :attr:`length` (N, the number of items the original sampler yields per epoch, read
    once, when built, as ``DistributedSampler`` and Lightning's wrapper read it)."""

    kind = "index"

    def _init_shards(self, shard: Shard, length: int) -> None:
        self.length = length
        self.num_replicas, self.rank, self.seed = shard.num_replicas, shard.rank, int(shard.seed)
        self.epoch_fn, self.pad, self.epoch = shard.epoch_fn, shard.pad, 0
        #: samples per batch (1 for a batch sampler) and the loader's drop_last; set by the injection.
        self.items_per_batch, self.drop_last_batch = 1, False
        #: Lightning's batch counter at the start of the current iterator (non-zero after a resume).
        self.batch_offset = 0
        self._resume: dict[str, Any] | None = None
        self._start_layers: list[dict[str, Any]] = []
        self._iter_epoch: int | None = None
        self._iter_total = 0  # stream positions dealt to all ranks this epoch (padding included)

    def set_epoch(self, epoch: int) -> None:
        """Use ``epoch``'s stream for the next iterator (``epoch_fn``, when given, overrides it then)."""
        self.epoch = int(epoch)

    def __len__(self) -> int:
        """Items this rank reads in a full epoch: ``ceil(N / W)`` padded, else its share of N."""
        n = self.length
        return math.ceil(n / self.num_replicas) if self.pad else len(range(self.rank, n, self.num_replicas))

    def __iter__(self) -> Iterator[Any]:
        if self.epoch_fn is not None:
            self.set_epoch(int(self.epoch_fn()))
        stream = self._stream(self.epoch)
        if len(stream) != self.length:  # Lightning's ddp reads the first len() items (fewer: IndexError)
            rank_zero_warn(
                f"{type(self).__name__}: the original sampler yielded {len(stream)} items in an epoch but its len() is"
                f" {self.length}. "
                + (
                    "The items past len() are not read, as under Lightning's ddp."
                    if len(stream) > self.length
                    else "The epoch reads only the items yielded (Lightning's ddp raises IndexError); the batch counts"
                    " and progress still come from len()."
                )
                + " Make __len__ return the number of items __iter__ yields."
            )
        n = min(len(stream), self.length)  # the items read: positions below n
        resume, self._resume = self._resume, None
        resuming = resume is not None and int(resume["epoch"]) == self.epoch
        if resume is not None and not resuming:
            rank_zero_warn(
                f"The checkpoint was saved in the middle of epoch {resume['epoch']} (stopped by max_time or"
                f" should_stop), which Lightning's fit loop counts as finished: it resumes at epoch {self.epoch}, and"
                f" the {len(remaining_positions(n, resume['layers']))} items of epoch {resume['epoch']} not read are"
                " skipped, as under Lightning's ddp. Resume with Trainer(max_steps=...) to finish that epoch first."
            )
        layers = resume["layers"] if resuming else []  # type: ignore[index]
        if not resuming:
            self.batch_offset = 0
        positions = remaining_positions(n, layers)
        if self.pad and (missing := -len(positions) % self.num_replicas):
            positions += (list(range(n)) * math.ceil(missing / n))[:missing]  # DistributedSampler's padding
        self._iter_epoch, self._start_layers, self._iter_total = self.epoch, layers, len(positions)
        return iter([stream[p] for p in positions[self.rank :: self.num_replicas]])

    def resume_from(self, position: dict[str, Any]) -> None:
        """Start the next iterator of ``position["epoch"]`` where ``position`` (a merged checkpoint entry) left off.

        A position with nothing left (saved at the end of its epoch) is ignored: there is no rest of an epoch to
        restore, so it resumes whatever the training data is now, as under Lightning's ``ddp``.

        A position saved mid-epoch for a stream of another length or kind (the data changed) is ignored with a
        warning: the epoch's data restarts, as under Lightning's ``ddp``.
        """
        if not remaining_positions(int(position["length"]), position["layers"]):
            return
        if (int(position["length"]), position["kind"]) != (self.length, self.kind):
            rank_zero_warn(
                f"The checkpoint's sampler position was written in the middle of epoch {position['epoch']} for a"
                f" training stream of {position['length']} items of kind {position['kind']!r}, but the training loader"
                f" now yields {self.length} of kind {self.kind!r} ('batch': a custom batch_sampler), so the rest of"
                " that epoch cannot be found. Its data restarts from its beginning, as under Lightning's ddp (from"
                " the restored batch count). Resume with the same training data to continue exactly."
            )
            return
        self.seed = int(position["seed"])  # the epoch's stream is regenerated with the saved seed
        self._resume = position

    def resumed_layers(self, epoch: int) -> list[dict[str, Any]]:
        """The saved layers ``epoch`` resumes from (``[]``: none), also once its iterator has begun (a loader's
        workers draw before Lightning's ``on_train_start``)."""
        resume = self._resume or {"epoch": self._iter_epoch, "layers": self._start_layers}
        return resume["layers"] if resume["epoch"] == epoch else []

    def pending_resume_batches(self, epoch: int) -> int | None:
        """Batches this rank reads in ``epoch`` if a resume applies to it, else ``None``; equal on every rank."""
        if not (layers := self.resumed_layers(epoch)):
            return None
        per_rank = math.ceil(len(remaining_positions(self.length, layers)) / self.num_replicas)
        return per_rank // self.items_per_batch if self.drop_last_batch else math.ceil(per_rank / self.items_per_batch)

    def position(self, batches_done: int) -> dict[str, Any]:
        """Every rank's place in the epoch after ``batches_done`` batches (Lightning's
        ``epoch_loop.batch_progress.current.ready``, less :attr:`batch_offset`), computed here without a collective:
        ``{"epoch", "seed", "length", "kind", "layers"}``, the last layer ``{"world_size": W, "consumed": [c_0, ...,
        c_{W-1}]}``. Every rank reads the same batches per epoch (the strategy checks it), so rank ``r`` consumed
        ``min(batches * items_per_batch, its shard's length)``."""
        done = max(batches_done - self.batch_offset, 0) * self.items_per_batch
        # before the first iterator nothing was dealt (_iter_total 0, no start layers): every rank consumed 0
        consumed = [min(done, len(range(r, self._iter_total, self.num_replicas))) for r in range(self.num_replicas)]
        return {
            "epoch": self.epoch if self._iter_epoch is None else self._iter_epoch,
            "seed": self.seed,
            "length": self.length,
            "kind": self.kind,
            "layers": [*self._start_layers, {"world_size": self.num_replicas, "consumed": consumed}],
        }


class EpochSeededDistributedSampler(_EpochShards, DistributedSampler):
    """A :class:`~torch.utils.data.distributed.DistributedSampler` that sets its own epoch and can resume.

    Sharding is PyTorch's: with ``shuffle=True`` the permutation of ``range(len(dataset))`` is drawn from a
    generator seeded with ``seed + epoch``, padded by repeating its head to a multiple of W, and rank ``r`` takes
    positions ``r, r + W, ...``. 5 samples, 2 ranks, ``shuffle=False``: rank 0 gets ``[0, 2, 4]``, rank 1
    ``[1, 3, 0]`` (0 is padding); with ``pad=False`` rank 1 gets ``[1, 3]``. With ``epoch_fn`` the epoch is the
    trainer's whenever an iterator is created (also after a resume and with persistent workers: sampling happens
    in the main process).

    Args:
        dataset: a map-style data set of length N.
        num_replicas, rank, seed, epoch_fn, pad: see :class:`Shard`.
        shuffle: reshuffle each epoch (True) or keep the data set's order (False).

    Raises:
        ValueError: ``rank`` outside ``[0, W)`` (PyTorch's check).
    """

    def __init__(
        self,
        dataset: Dataset,
        num_replicas: int,
        rank: int,
        shuffle: bool = True,
        seed: int = DEFAULT_SEED,
        epoch_fn: Callable[[], int] | None = None,
        pad: bool = True,
    ) -> None:
        DistributedSampler.__init__(self, dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed)
        self._init_shards(Shard(num_replicas, rank, seed, epoch_fn, pad), len(dataset))  # type: ignore[arg-type]
        # PyTorch's num_samples and total_size hold padded; unpadded, each sample once
        if not pad:
            self.num_samples, self.total_size = len(self), self.length

    def _stream(self, epoch: int) -> list[int]:
        generator = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(self.length, generator=generator).tolist() if self.shuffle else list(range(self.length))


class ShardedSampler(_EpochShards, Sampler[Any]):
    """Shards any sampler by position so the ranks read disjoint parts of one shared draw.

    Each epoch the original sampler is drawn once with :func:`draw_epoch` (the same draw on every rank), padded
    when ``shard.pad`` and strided: a draw ``[7, 7, 2, 9, 4]`` on 2 ranks gives rank 0 ``[7, 2, 4]`` and rank 1
    ``[7, 9, 7]`` (the last 7 is padding). Where ``len(sampler)`` is not what it yields, a warning: the items past
    ``len()`` are not read (Lightning's ddp's), and an epoch of fewer reads those.
    """

    def __init__(self, sampler: Iterable[Any], shard: Shard) -> None:
        self.sampler = sampler
        self._init_shards(shard, len(sampler))  # type: ignore[arg-type]

    def _stream(self, epoch: int) -> list[Any]:
        return draw_epoch(self.sampler, self.seed, epoch)


class ShardedBatchSampler(ShardedSampler):
    """Shards a custom batch sampler: whole batches, drawn once per epoch, by position.

    Rank ``r`` reads batches ``r, r + W, ...`` of the epoch's draw (padded with the first batches), as Accelerate's
    ``BatchSamplerShard`` does. Unpadded (exact evaluation) every rank still makes ``ceil(N / W)`` steps: a rank one
    batch short halves its first batch of 2+ samples (every sample read once; it reads a batch again, as Lightning's
    padding would, with a warning, only if all hold one sample). Batches ``[0, 1, 2], [3], [4, 5], [6, 7], [8]``
    on 2 ranks: rank 1 reads ``[3], [6], [7]``.
    """

    kind = "batch"

    def __len__(self) -> int:
        return math.ceil(self.length / self.num_replicas)

    def __iter__(self) -> Iterator[Any]:
        mine = [list(b) for b in super().__iter__()]
        if not self.pad and len(mine) < len(self):  # exact evaluation: this rank is one batch short
            split = next((j for j, b in enumerate(mine) if len(b) >= 2), None)
            if split is None:
                stream = self._stream(self.epoch)
                mine.append(list(stream[(len(mine) * self.num_replicas + self.rank) % len(stream)]))
                warnings.warn(
                    f"[rank {self.rank}] the custom batch sampler gives this rank one batch fewer than rank 0"
                    " and none of 2+ samples to halve, so one batch is evaluated twice (as under Lightning's ddp)"
                    " and metrics count it twice.",
                    UserWarning,
                    stacklevel=2,
                )
            else:
                half = len(mine[split]) // 2
                mine[split : split + 1] = [mine[split][:half], mine[split][half:]]
        return iter(mine)


class EqualCountBatchSampler(BatchSampler):
    """Batches an unpadded shard into as many batches as the longest rank's shard makes (exact evaluation).

    Every rank yields ``K = ceil(ceil(N / W) / B)`` batches, as Lightning's padded ``DistributedSampler`` gives: a
    shard one sample short gets a first batch of ``B - 1`` (as if Lightning's padding sample stood at its front).
    17 samples, B = 4, 2 ranks: rank 0 ``[0, 2, 4, 6], [8, 10, 12, 14], [16]``; rank 1 ``[1, 3, 5],
    [7, 9, 11, 13], [15]``. Needs ``B >= 2`` and ``N >= W`` whenever N is not a multiple of W.
    """

    def __init__(self, sampler: _EpochShards, batch_size: int) -> None:  # this rank's unpadded sampler, B
        super().__init__(sampler, batch_size, drop_last=False)
        self.longest = math.ceil(sampler.length / sampler.num_replicas)

    def __len__(self) -> int:
        return math.ceil(self.longest / self.batch_size)

    def __iter__(self) -> Iterator[list[Any]]:
        items = list(self.sampler)
        first = self.batch_size - (self.longest - len(items))
        assert first >= 1 or not items, "a loader without an exact layout must be padded instead"
        if items:
            yield items[:first]
        yield from BatchSampler(items[first:], self.batch_size, drop_last=False)


def shard_iterable(iterable: Iterable[Any], rank: int | None = None, world_size: int | None = None) -> Iterator[Any]:
    """Yield the items of ``iterable`` that belong to this rank and this ``DataLoader`` worker.

    An ``IterableDataset`` has no indices, so the strategy cannot shard it. Call this in its ``__iter__``: item
    ``i`` goes to shard ``i % (W * num_workers)``, shard ``rank * num_workers + worker_id``; 10 items, 2 ranks, no
    workers: rank 0 gets 0, 2, 4, 6, 8, rank 1 gets 1, 3, 5, 7, 9. For training every rank must make as many
    batches (DDP all-reduces every step): cut the stream to a multiple of ``W * num_workers * batch_size``.

    Args:
        iterable: the full stream, identical on every rank.
        rank: global rank; default: ``torch.distributed``'s rank, else 0.
        world_size: W; default: ``torch.distributed``'s world size, else 1.

    Yields:
        This rank's and worker's items, in stream order.
    """
    initialized = dist.is_available() and dist.is_initialized()
    rank = (dist.get_rank() if initialized else 0) if rank is None else rank
    world_size = (dist.get_world_size() if initialized else 1) if world_size is None else world_size
    info = get_worker_info()
    worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
    return itertools.islice(iterable, rank * workers + worker, None, world_size * workers)
