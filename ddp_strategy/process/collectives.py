"""``all_gather`` for tensors whose first dimension differs between the ranks.

Lightning's ``all_gather`` stacks one tensor per rank into shape ``(W, *shape)`` and requires the same shape
everywhere (with gloo an uneven call kills a rank: "received data size doesn't match"). Exact evaluation
shards (:mod:`ddp_strategy.sampling.evaluation`) make per-sample outputs uneven whenever the data set size N is not a
multiple of W, and per-image outputs (detections, tokens) are uneven by nature. So:

* :func:`gather_shapes` - every rank learns every rank's shape (one small all-gather of int64s);
* :func:`all_gather_padded` - the ``(W, M, ...)`` result, M the largest first dimension, whose missing rows
  are filled **as** :class:`~torch.utils.data.distributed.DistributedSampler` **pads a data set**: read the
  real rows in the order the sampler deals them (row 0 of ranks 0..W-1, then row 1 of ranks 0..W-1, ...) and
  give the missing slots, taken in that same order, the first real rows. For the per-sample outputs of an
  exact evaluation shard this is *exactly* the tensor Lightning's padded sampler would give. Example, 3
  samples on 2 ranks: rank 0 holds samples ``[0, 2]``, rank 1 ``[1]``; the result is ``[[0, 2], [1, 0]]``,
  Lightning's ``DistributedSampler`` gives rank 1 ``[1, 0]``;
* :func:`all_gather_rows` - every real row exactly once, shape ``(n_0 + ... + n_{W-1}, ...)``, in that
  dealing order (the data set order for an evaluation loader with ``shuffle=False``).
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

#: Dimensions a shape exchange carries; a tensor with more falls back to Lightning's equal-shape gather.
MAX_DIMS = 15


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def gather_shapes(tensor: Tensor, group: Any | None = None) -> list[tuple[int, ...]] | None:
    """Every rank's ``tensor.shape`` (a collective: every rank of ``group`` must call it).

    Args:
        tensor: this rank's tensor, any shape with at most :data:`MAX_DIMS` dimensions.
        group: the process group; ``None`` = the world.

    Returns:
        ``[shape on rank 0, ..., shape on rank W-1]``, or ``None`` if some rank's tensor has more than
        :data:`MAX_DIMS` dimensions. Without a process group: ``[tensor.shape]``.
    """
    if not _initialized():
        return [tuple(tensor.shape)]
    world = dist.get_world_size(group)
    ndim = tensor.dim() if tensor.dim() <= MAX_DIMS else -1
    local = torch.zeros(MAX_DIMS + 1, dtype=torch.long, device=tensor.device)
    local[0] = ndim
    if ndim > 0:
        local[1:ndim + 1] = torch.tensor(tensor.shape, dtype=torch.long)
    gathered = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(gathered, local, group=group)
    rows = [g.tolist() for g in gathered]
    if any(row[0] < 0 for row in rows):
        return None
    return [tuple(row[1:row[0] + 1]) for row in rows]


def check_gatherable(shapes: list[tuple[int, ...]], rank: int) -> None:
    """Raise on every rank (they all hold the same ``shapes``) unless only the first dimension differs.

    Raises:
        ValueError: naming every rank's shape and what to do.
    """
    first = shapes[0]
    if all(len(s) == len(first) and len(s) > 0 and s[1:] == first[1:] for s in shapes):
        return
    listed = ", ".join(f"rank {r}: {tuple(s)}" for r, s in enumerate(shapes))
    raise ValueError(
        f"[rank {rank}] all_gather needs tensors with the same number of dimensions and the same size in every"
        f" dimension but the first on every rank; got {listed}. Pad or reshape them to a common shape first"
        " (the first dimension may differ: the result is then padded, see ddp_strategy.process.collectives)."
    )


def _dealing_order(sizes: list[int]) -> list[tuple[int, int]]:
    """Real rows ``(rank, row)`` in the order a DistributedSampler deals them: row 0 of every rank, row 1, ..."""
    return [(r, i) for i in range(max(sizes)) for r, n in enumerate(sizes) if i < n]


def _gather_stacked(tensor: Tensor, group: Any | None, sync_grads: bool) -> Tensor:
    """Lightning's equal-shape gather (``lightning.fabric.utilities.distributed._all_gather_ddp_if_available``)."""
    from torch.distributed.nn.functional import all_gather

    with nullcontext() if sync_grads else torch.no_grad():
        parts = all_gather(tensor.contiguous(), group if group is not None else dist.group.WORLD)
    return torch.stack(parts)


def all_gather_padded(tensor: Tensor, sizes: list[int], group: Any | None = None,
                      sync_grads: bool = False) -> Tensor:
    """Gather tensors whose first dimension differs between the ranks into ``(W, M, *rest)``.

    A collective: every rank of ``group`` calls it with its own tensor and the same ``sizes`` (from
    :func:`gather_shapes`). Rank ``r``'s rows ``0..n_r-1`` are its tensor; its rows ``n_r..M-1`` are
    filled as a ``DistributedSampler`` pads (module docstring), so ``result.flatten(0, 1)`` holds every
    real row once plus ``W * M - sum(sizes)`` repeats of the first dealt rows. Gradients flow to the
    originals when ``sync_grads`` (as Lightning's ``sync_grads``).

    Args:
        tensor: this rank's tensor, shape ``(n_r, *rest)``.
        sizes: ``[n_0, ..., n_{W-1}]``, at least one of them > 0.
        group: the process group; ``None`` = the world.
        sync_grads: let gradients flow through the gather (Lightning's flag).

    Returns:
        Shape ``(W, M, *rest)`` with ``M = max(sizes)``, on ``tensor``'s device.
    """
    world, most = len(sizes), max(sizes)
    rest = tuple(tensor.shape[1:])
    padding = tensor.new_zeros((most - tensor.shape[0], *rest))
    stacked = _gather_stacked(torch.cat([tensor, padding]), group, sync_grads)
    real = _dealing_order(sizes)
    source = list(range(world * most))
    slots = [(r, i) for i in range(most) for r in range(world) if i >= sizes[r]]
    for j, (r, i) in enumerate(slots):
        q, k = real[j % len(real)]
        source[r * most + i] = q * most + k
    index = torch.tensor(source, dtype=torch.long, device=stacked.device)
    return stacked.reshape(world * most, *rest).index_select(0, index).reshape(world, most, *rest)


def all_gather_rows(tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
    """Every rank's rows, each exactly once: shape ``(n_0 + ... + n_{W-1}, *rest)``.

    The exact counterpart of ``self.all_gather(x).flatten(0, 1)`` for per-sample outputs: nothing is
    padded or repeated. Rows come in the order a ``DistributedSampler`` deals them (row 0 of ranks
    0..W-1, then row 1, ...): for the outputs of a whole evaluation epoch on a loader with
    ``shuffle=False`` that is the data set's order. A collective: call it on every rank (for example in
    ``on_validation_epoch_end``). Without a process group it returns ``tensor``.

    Args:
        tensor: this rank's tensor, shape ``(n_r, *rest)``; ``rest`` must be equal on every rank.
        group: the process group; ``None`` = the world.
        sync_grads: let gradients flow through the gather.

    Returns:
        Shape ``(sum of n_r, *rest)``.

    Raises:
        ValueError: the tensors differ in a dimension other than the first, or are 0-dimensional (on every rank).
    """
    if not _initialized():
        return tensor
    shapes = gather_shapes(tensor, group)
    rank = dist.get_rank()
    if shapes is None:
        raise ValueError(f"[rank {rank}] all_gather_rows supports tensors of at most {MAX_DIMS} dimensions.")
    check_gatherable(shapes, rank)
    sizes = [s[0] for s in shapes]
    if max(sizes) == 0:
        return tensor
    stacked = all_gather_padded(tensor, sizes, group, sync_grads)
    most = max(sizes)
    index = torch.tensor([r * most + i for r, i in _dealing_order(sizes)], dtype=torch.long, device=stacked.device)
    return stacked.reshape(len(sizes) * most, *shapes[0][1:]).index_select(0, index)


__all__ = ["MAX_DIMS", "all_gather_padded", "all_gather_rows", "check_gatherable", "gather_shapes"]
