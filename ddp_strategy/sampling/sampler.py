"""Distributed sampler injection, per-epoch seeding and resumable positions.

Each rank must read a disjoint shard of the data, and the shuffle must change every epoch. Every epoch is a
*stream* - the sequence the loader's original sampler yields for that epoch - regenerated exactly from the
shared seed and the epoch; it is padded by repeating its head to a multiple of the world size W and rank
``r`` takes positions ``r, r + W, ...`` (the rule of PyTorch's
:class:`~torch.utils.data.distributed.DistributedSampler`,
https://pytorch.org/docs/stable/data.html#torch.utils.data.distributed.DistributedSampler). Three samplers
implement it:

* :class:`EpochSeededDistributedSampler` for ``shuffle=True/False`` loaders (a ``DistributedSampler``);
* :class:`ShardedSampler` for any other sampler (weighted, subset, user classes): the original sampler is
  drawn once per epoch under a generator seeded with ``seed + epoch`` - identical on every rank - and the
  draw is sharded by position, so the ranks read disjoint parts of *one* draw;
* :class:`ShardedBatchSampler` for a custom ``batch_sampler``: whole batches are sharded the same way.

Each reads the trainer's epoch when an iterator is created (so nobody has to call ``set_epoch``), can start
an epoch part-way from a saved position (:mod:`ddp_strategy.sampling.state`), and reports its own position.
:mod:`ddp_strategy.sampling.injection` puts them into the user's loaders; :func:`shard_iterable` is the user's tool
for ``IterableDataset`` streams, which have no indices to shard.
"""

from __future__ import annotations

import itertools
import math
import os
import random
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import Dataset, Sampler, get_worker_info
from torch.utils.data.distributed import DistributedSampler

from ddp_strategy.sampling import state as sampler_state

#: Seed used for shuffling when neither the strategy nor ``seed_everything`` set one.
DEFAULT_SEED = 0
#: Start of Lightning's warning about resuming mid-epoch with a loader that has no ``state_dict``; it does not
#: apply to loaders with our samplers, which resume from the checkpoint's sampler position.
LIGHTNING_NOT_RESUMABLE_WARNING = "You're resuming from a checkpoint that ended before the epoch ended"
_MISSING = object()


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


@contextmanager
def _seeded_global_rngs(seed: int) -> Iterator[None]:
    """Seed torch's, Python's and NumPy's global generators with ``seed``; restore them afterwards."""
    py_state = random.getstate()
    try:
        import numpy as np
        np_state: Any = np.random.get_state()
    except ImportError:  # pragma: no cover - numpy is a dependency of torch's tests, not of torch
        np, np_state = None, None
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        random.seed(seed)
        if np is not None:
            np.random.seed(seed % 2**32)
        try:
            yield
        finally:
            random.setstate(py_state)
            if np is not None:
                np.random.set_state(np_state)


def draw_epoch(source: Iterable[Any], seed: int, epoch: int) -> list[Any]:
    """Everything ``source`` yields for ``epoch``, drawn the same way on every rank.

    ``source.set_epoch(epoch)`` is called if it exists. While drawing, torch's, Python's and NumPy's global
    generators are seeded with ``seed + epoch`` (and restored afterwards, so training randomness is not
    disturbed), and a ``generator`` attribute on ``source`` or on its ``.sampler`` is temporarily replaced
    by ``torch.Generator().manual_seed(seed + epoch)`` - that covers ``RandomSampler``,
    ``WeightedRandomSampler``, ``SubsetRandomSampler`` and ``BatchSampler`` around them. A user class that
    draws from anything else (the clock, ``os.urandom``) is not reproducible and is not supported.

    Args:
        source: a sampler or batch sampler.
        seed: the shared seed.
        epoch: the epoch, 0-based.

    Returns:
        The items, as a list.
    """
    if callable(getattr(source, "set_epoch", None)):
        source.set_epoch(epoch)  # type: ignore[attr-defined]
    holders = [h for h in (source, getattr(source, "sampler", None)) if h is not None and hasattr(h, "generator")]
    saved = [h.generator for h in holders]
    with _seeded_global_rngs(seed + epoch):
        try:
            for holder in holders:
                holder.generator = torch.Generator().manual_seed(seed + epoch)
            return list(source)
        finally:
            for holder, generator in zip(holders, saved, strict=True):
                holder.generator = generator


class _EpochShards:
    """The shared machinery: stream -> (resume) -> pad -> stride, plus the position this rank reached.

    Subclasses define :meth:`_stream` (the epoch's items) and :meth:`stream_length` (its length, without
    drawing). ``num_replicas``, ``rank``, ``seed``, ``epoch``, ``pad``, ``epoch_fn`` and ``items_per_batch``
    are set by :meth:`_init_shards`.
    """

    kind = "index"
    num_replicas: int
    rank: int
    seed: int
    epoch: int

    def _init_shards(self, num_replicas: int, rank: int, seed: int, epoch_fn: Callable[[], int] | None,
                     pad: bool) -> None:
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank={rank} is outside [0, {num_replicas}); pass 0 <= rank < num_replicas.")
        self.num_replicas, self.rank, self.seed = num_replicas, rank, int(seed)
        self.epoch = getattr(self, "epoch", 0)
        self.epoch_fn, self.pad = epoch_fn, pad
        #: samples per batch (1 for a batch sampler, whose items are batches); set by the injection.
        self.items_per_batch = 1
        #: the DataLoader drops an incomplete last batch.
        self.drop_last_batch = False
        #: Lightning's batch counter at the start of the current iterator (non-zero after a resume).
        self.batch_offset = 0
        self._resume: dict[str, Any] | None = None
        self._start_layers: list[dict[str, Any]] = []
        self._iter_epoch: int | None = None
        self._iter_len = 0

    # ----------------------------------------------------------------------------------------- streams
    def _stream(self, epoch: int) -> list[Any]:
        raise NotImplementedError

    def stream_length(self) -> int:
        """N: the number of items the original sampler yields per epoch."""
        raise NotImplementedError

    def set_epoch(self, epoch: int) -> None:
        """Use ``epoch``'s stream for the next iterator (``epoch_fn``, when given, overrides it then)."""
        self.epoch = int(epoch)

    def _shard_len(self) -> int:
        n = self.stream_length()
        return math.ceil(n / self.num_replicas) if self.pad else len(range(self.rank, n, self.num_replicas))

    def __len__(self) -> int:
        """Items this rank reads in a full epoch: ``ceil(N / W)`` padded, else its share of N."""
        return self._shard_len()

    def _shard_items(self) -> list[Any]:
        if self.epoch_fn is not None:
            self.set_epoch(int(self.epoch_fn()))
        stream = self._stream(self.epoch)
        if len(stream) != self.stream_length():
            raise RuntimeError(
                f"{type(self).__name__}: the original sampler yielded {len(stream)} items for epoch {self.epoch}"
                f" but its len() is {self.stream_length()}. Batch counts come from len(); make them agree."
            )
        layers: list[dict[str, Any]] = []
        if self._resume is not None:
            if int(self._resume["epoch"]) == self.epoch:
                layers = self._resume["layers"]
            else:
                self.batch_offset = 0
            self._resume = None
        else:
            self.batch_offset = 0
        head = list(range(len(stream)))
        positions = sampler_state.remaining_positions(len(stream), layers) if layers else head
        mine = sampler_state.shard_positions(positions, head, self.num_replicas, self.rank, self.pad)
        self._iter_epoch, self._start_layers, self._iter_len = self.epoch, layers, len(mine)
        return [stream[p] for p in mine]

    def __iter__(self) -> Iterator[Any]:
        return iter(self._shard_items())

    # --------------------------------------------------------------------------------------- positions
    def resume_from(self, position: dict[str, Any]) -> None:
        """Start the next iterator of ``position["epoch"]`` where ``position`` left off.

        A position with nothing left (saved at the end of its epoch) is ignored: there is no rest of an epoch
        to restore, so it resumes whatever the training data is now, as under Lightning's ``ddp``.

        Raises:
            ValueError: ``position`` was saved mid-epoch for a stream of another length or kind.
        """
        if not sampler_state.remaining_positions(int(position["length"]), position["layers"]):
            return
        sampler_state.check_position(position, self.stream_length(), self.kind)
        if int(position["seed"]) != self.seed:
            self.seed = int(position["seed"])  # the epoch's stream must be regenerated with the old seed
        self._resume = position

    def pending_resume_batches(self, epoch: int) -> int | None:
        """Batches this rank will read in ``epoch`` if a resume applies to it, else ``None``.

        Equal on every rank (the remainder is padded), so Lightning's batch counter can be set from it.
        """
        if self._resume is None or int(self._resume["epoch"]) != epoch:
            return None
        left = len(sampler_state.remaining_positions(self.stream_length(), self._resume["layers"]))
        items = math.ceil(left / self.num_replicas)
        rounding = math.floor if self.drop_last_batch else math.ceil
        return int(rounding(items / self.items_per_batch))

    def position(self, batches_done: int) -> dict[str, Any]:
        """This rank's place in its current epoch, for :func:`sampler_state.gather_positions`.

        Args:
            batches_done: Lightning's count of finished training batches in this epoch
                (``epoch_loop.batch_progress.current.ready``); :attr:`batch_offset` is subtracted.

        Returns:
            ``{"epoch", "seed", "length", "kind", "layers", "consumed"}`` with plain ints and lists.
        """
        if self._iter_epoch is None:
            return {"epoch": self.epoch, "seed": self.seed, "length": self.stream_length(), "kind": self.kind,
                    "layers": [], "consumed": 0}
        consumed = min(max(batches_done - self.batch_offset, 0) * self.items_per_batch, self._iter_len)
        return {"epoch": self._iter_epoch, "seed": self.seed, "length": self.stream_length(), "kind": self.kind,
                "layers": self._start_layers, "consumed": int(consumed)}


class EpochSeededDistributedSampler(_EpochShards, DistributedSampler):
    """A :class:`~torch.utils.data.distributed.DistributedSampler` that sets its own epoch and can resume.

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
        drop_last: drop the tail of the stream to a multiple of W instead of padding (each rank then gets
            ``N // W`` samples).
        epoch_fn: returns the current epoch (0-based); ``None`` leaves ``set_epoch`` to the caller.
        pad: repeat samples so all ranks get the same count (True, needed for training: every rank must
            take the same number of optimizer steps), or not (False, for exact evaluation).

    Raises:
        ValueError: ``rank`` outside ``[0, W)``, or ``pad=False`` combined with ``drop_last=True``.
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
        if not pad and drop_last:
            raise ValueError("pad=False keeps every sample exactly once; it cannot be combined with drop_last=True.")
        DistributedSampler.__init__(self, dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle,
                                    seed=seed, drop_last=drop_last)
        self._init_shards(num_replicas, rank, seed, epoch_fn, pad)
        self.num_samples = self._shard_len()
        self.total_size = self.num_samples * num_replicas if pad else self.stream_length()

    def stream_length(self) -> int:
        n = len(self.dataset)  # type: ignore[arg-type]
        return n - n % self.num_replicas if self.drop_last else n

    def _stream(self, epoch: int) -> list[int]:
        n = len(self.dataset)  # type: ignore[arg-type]
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + epoch)
            indices = torch.randperm(n, generator=generator).tolist()
        else:
            indices = list(range(n))
        return indices[: self.stream_length()]

    def __len__(self) -> int:
        return self._shard_len()


class ShardedSampler(_EpochShards, Sampler[Any]):
    """Shards any sampler by position so the ranks read disjoint parts of one shared draw.

    Each epoch the original sampler is drawn once with :func:`draw_epoch` (same seed on every rank, so
    every rank computes the same draw), padded to a multiple of W when ``pad`` and strided. For a
    ``WeightedRandomSampler(weights, num_samples=5)`` on 2 ranks whose epoch draw is ``[7, 7, 2, 9, 4]``,
    rank 0 reads ``[7, 2, 4]`` and rank 1 ``[7, 9, 7]`` (the last 7 is padding).

    Args:
        sampler: the original sampler; must have ``len()`` equal to what it yields.
        num_replicas, rank, seed, epoch_fn, pad: as for :class:`EpochSeededDistributedSampler`.
    """

    def __init__(self, sampler: Sampler[Any], num_replicas: int, rank: int, seed: int = DEFAULT_SEED,
                 epoch_fn: Callable[[], int] | None = None, pad: bool = True) -> None:
        self.sampler = sampler
        self._init_shards(num_replicas, rank, seed, epoch_fn, pad)

    def stream_length(self) -> int:
        return len(self.sampler)  # type: ignore[arg-type]

    def _stream(self, epoch: int) -> list[Any]:
        return draw_epoch(self.sampler, self.seed, epoch)


class ShardedBatchSampler(ShardedSampler):
    """Shards a custom batch sampler: whole batches, drawn once per epoch, by position.

    Rank ``r`` reads batches ``r, r + W, ...`` of the epoch's draw (padded with the first batches when
    ``pad``), as Accelerate's ``BatchSamplerShard`` does. Batch sizes are the original sampler's.
    """

    kind = "batch"


def shard_iterable(iterable: Iterable[Any], rank: int | None = None, world_size: int | None = None) -> Iterator[Any]:
    """Yield the items of ``iterable`` that belong to this rank and this ``DataLoader`` worker.

    An ``IterableDataset`` has no indices, so the strategy cannot shard it: every rank (and every worker)
    would read the whole stream. Call this in the data set's ``__iter__``: item ``i`` goes to shard
    ``i % (W * num_workers)``, shard ``rank * num_workers + worker_id``. For 10 items, 2 ranks and no
    workers rank 0 gets items 0, 2, 4, 6, 8 and rank 1 gets 1, 3, 5, 7, 9.

    For training, every rank must produce the same number of batches (DDP all-reduces every step); when
    the stream length is not a multiple of ``W * num_workers * batch_size``, cut it (for example with
    ``itertools.islice``) to a length that is.

    Args:
        iterable: the full stream, identical on every rank.
        rank: global rank; default: ``torch.distributed``'s rank, else 0.
        world_size: W; default: ``torch.distributed``'s world size, else 1.

    Yields:
        This rank's and worker's items, in stream order.
    """
    initialized = dist.is_available() and dist.is_initialized()
    if rank is None:
        rank = dist.get_rank() if initialized else 0
    if world_size is None:
        world_size = dist.get_world_size() if initialized else 1
    info = get_worker_info()
    worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
    return itertools.islice(iterable, rank * workers + worker, None, world_size * workers)

