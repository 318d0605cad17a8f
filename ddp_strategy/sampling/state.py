"""Where each rank is in its epoch, as plain data: record it, gather it, check it, and cut the remainder.

An epoch is a *stream*: the sequence of N items the original sampler yields for that epoch (sample indices,
or whole batches for a custom batch sampler), regenerated exactly from ``(seed, epoch)``. With W ranks the
stream is padded by repeating its head to a multiple of W and rank ``r`` takes positions ``r, r + W, ...``
(PyTorch's ``DistributedSampler`` rule). After rank ``r`` has consumed ``c_r`` items, the positions
``r + W * j`` (``j < c_r``) of the padded stream are done.

A *position* in a checkpoint is a list of layers, one per run that consumed part of the epoch::

    {"epoch": 3, "seed": 42, "length": 1438, "kind": "index",
     "layers": [{"world_size": 2, "consumed": [96, 96]}]}

The first layer shards the whole stream; each later layer (written after an elastic resume) shards what the
layers before it left. :func:`remaining_positions` replays the layers on ``range(N)`` - integer arithmetic,
no data is loaded - so a resume on any world size regenerates the stream and keeps exactly the items no
rank has consumed. Everything is plain ints, strings, lists and dicts, so a checkpoint holding it loads with
``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import math
from typing import Any

import torch.distributed as dist

#: Checkpoint key under which the strategy stores the training samplers' positions.
CHECKPOINT_KEY = "ddp_strategy_sampler"
#: Format version of that entry.
STATE_VERSION = 1


def pad_cyclic(items: list[Any], world_size: int, head: list[Any]) -> list[Any]:
    """Return ``items`` followed by the first elements of ``head`` (repeated if needed) up to a multiple of W.

    Args:
        items: the list to pad.
        world_size: W >= 1.
        head: where padding comes from (the epoch's stream, as in ``DistributedSampler``).

    Returns:
        A new list of length ``ceil(len(items) / W) * W``.

    Raises:
        ValueError: padding is needed but ``head`` is empty.
    """
    missing = (-len(items)) % world_size
    if missing == 0:
        return list(items)
    if not head:
        raise ValueError(f"Cannot pad {len(items)} items to a multiple of {world_size}: nothing to repeat.")
    repeats = head * math.ceil(missing / len(head))
    return list(items) + repeats[:missing]


def remaining_positions(length: int, layers: list[dict[str, Any]]) -> list[int]:
    """Stream positions (``0 <= p < N``) that no rank of any layer has consumed, in stream order.

    For N = 10, one layer ``{"world_size": 2, "consumed": [2, 2]}``: ranks took padded positions 0, 2 and
    1, 3, so the result is ``[4, 5, 6, 7, 8, 9]``. Positions that were padding (past the end) are ignored:
    they were repeats.

    Args:
        length: N, the stream's length.
        layers: as in the module docstring; ``consumed[r]`` counts items rank ``r`` finished.

    Returns:
        The positions left, in order.
    """
    sequence = list(range(length))
    for layer in layers:
        world_size = int(layer["world_size"])
        consumed = [int(c) for c in layer["consumed"]]
        if len(set(consumed)) == 1:  # the usual case: every rank took the same number of steps
            sequence = sequence[world_size * consumed[0]:]
            continue
        done = {rank + world_size * j for rank, count in enumerate(consumed) for j in range(count)}
        sequence = [p for i, p in enumerate(sequence) if i not in done]
    return sequence


def shard_positions(positions: list[int], head: list[int], world_size: int, rank: int, pad: bool) -> list[int]:
    """Rank ``rank``'s part of ``positions``: padded with ``head`` to a multiple of W (if ``pad``), then strided.

    Args:
        positions: stream positions to distribute.
        head: positions used for padding (the whole stream, ``range(N)``).
        world_size: W.
        rank: this rank, ``0 <= rank < W``.
        pad: equal shard lengths (training) or each position exactly once (evaluation).

    Returns:
        The positions this rank reads, in order.
    """
    items = pad_cyclic(positions, world_size, head) if pad else positions
    return items[rank::world_size]


def make_position(epoch: int, seed: int, length: int, kind: str, layers: list[dict[str, Any]]) -> dict[str, Any]:
    """Build one loader's position entry (see the module docstring) from plain values."""
    return {"epoch": int(epoch), "seed": int(seed), "length": int(length), "kind": str(kind),
            "layers": [{"world_size": int(la["world_size"]), "consumed": [int(c) for c in la["consumed"]]}
                       for la in layers]}


def merge_rank_positions(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """Merge what each rank reported for one loader into one position with a new layer.

    Args:
        per_rank: for ranks 0..W-1, ``{"epoch", "seed", "length", "kind", "layers", "consumed"}`` where
            ``layers`` are the layers this epoch started from (identical on all ranks) and ``consumed`` is
            the number of items this rank finished since.

    Returns:
        A position whose last layer is ``{"world_size": W, "consumed": [c_0, ..., c_{W-1}]}``.

    Raises:
        RuntimeError: the ranks disagree on epoch, seed, length, kind or earlier layers (a bug, or ranks
            that were given different data).
    """
    first = per_rank[0]
    for rank, entry in enumerate(per_rank):
        for key in ("epoch", "seed", "length", "kind", "layers"):
            if entry[key] != first[key]:
                raise RuntimeError(
                    f"Sampler positions disagree between rank 0 and rank {rank} on {key!r}: {first[key]!r} vs"
                    f" {entry[key]!r}. Every rank must build its training loader from the same data set."
                )
    layers = list(first["layers"]) + [{"world_size": len(per_rank), "consumed": [e["consumed"] for e in per_rank]}]
    return make_position(first["epoch"], first["seed"], first["length"], first["kind"], layers)


def gather_positions(local: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Gather every rank's positions (one entry per training loader) and merge them per loader.

    A collective when a process group exists: every rank must call it, with the same number of loaders.
    Every rank gets the same merged list back; without a process group the local list is merged alone.

    Args:
        local: this rank's entries, as :func:`merge_rank_positions` expects.

    Returns:
        One merged position per loader.

    Raises:
        RuntimeError: ranks report different numbers of loaders or disagree (see
            :func:`merge_rank_positions`).
    """
    if dist.is_available() and dist.is_initialized():
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, local)
    else:
        gathered = [local]
    counts = {len(g) for g in gathered}
    if len(counts) != 1:
        raise RuntimeError(f"Ranks have different numbers of training loaders with a sampler position: {counts}.")
    return [merge_rank_positions([g[i] for g in gathered]) for i in range(len(local))]


def checkpoint_entry(positions: list[dict[str, Any]]) -> dict[str, Any]:
    """The value stored under :data:`CHECKPOINT_KEY`: ``{"version": 1, "loaders": positions}``."""
    return {"version": STATE_VERSION, "loaders": positions}


def loader_positions(entry: Any) -> list[dict[str, Any]]:
    """Read and check the entry stored under :data:`CHECKPOINT_KEY`.

    Raises:
        ValueError: the entry has an unknown version or shape.
    """
    if not isinstance(entry, dict) or entry.get("version") != STATE_VERSION or not isinstance(
            entry.get("loaders"), list):
        raise ValueError(
            f"The checkpoint's {CHECKPOINT_KEY!r} entry is not a version-{STATE_VERSION} sampler position: {entry!r}."
            " It was written by another version of ddp_strategy."
        )
    return entry["loaders"]


def check_position(position: dict[str, Any], length: int, kind: str) -> None:
    """Raise if ``position`` cannot describe a loader whose stream has ``length`` items of ``kind``.

    Raises:
        ValueError: different stream length (another data set, or a sampler whose length changed) or kind.
    """
    if int(position["length"]) != int(length):
        raise ValueError(
            f"The checkpoint's sampler position was written for a training stream of {position['length']} items,"
            f" but the training loader now yields {length}. The data set (or sampler) changed since the checkpoint"
            " was saved, so the rest of its epoch cannot be found. Resume with the same training data, or resume"
            " from a checkpoint saved at the end of an epoch (ModelCheckpoint's default), which holds no partial"
            " epoch and resumes with any data."
        )
    if position["kind"] != kind:
        raise ValueError(
            f"The checkpoint's sampler position is for a {position['kind']!r} sampler, but the training loader now"
            f" uses a {kind!r} one ('index' = a sampler of indices, 'batch' = a custom batch_sampler)."
        )
