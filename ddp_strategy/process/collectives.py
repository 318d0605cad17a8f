"""``all_gather`` for tensors whose first dimension differs between the ranks, on Lightning's own gathers.

Lightning's ``all_gather`` stacks one tensor per rank into shape ``(W, *shape)`` and requires the same shape
everywhere (with gloo an uneven call kills a rank: "received data size doesn't match"). Exact evaluation shards
(:mod:`ddp_strategy.sampling.evaluation`) make per-sample outputs uneven whenever the data set size N is not a
multiple of W, and per-image outputs (detections, tokens) are uneven by nature. So, after :func:`gather_shapes`
(Lightning's ``_gather_all_tensors`` on the shape vectors):

* :func:`all_gather_padded` - the strategy's ``all_gather`` when shapes differ: ``(W, M, ...)``, M the largest
  first dimension, whose missing rows are filled **as** :class:`~torch.utils.data.distributed.DistributedSampler`
  **pads a data set**: real rows are read in the order the sampler deals them (row 0 of ranks 0..W-1, then row 1,
  ...) and the missing slots, in that same order, get the first real rows. For the per-sample outputs of an exact
  evaluation shard this is *exactly* the tensor Lightning's padded sampler gives. Example, 3 samples on 2 ranks:
  rank 0 holds samples ``[0, 2]``, rank 1 ``[1]``; the result is ``[[0, 2], [1, 0]]``, and Lightning's
  ``DistributedSampler`` gives rank 1 ``[1, 0]``;
* :func:`all_gather_rows` - every real row exactly once, shape ``(n_0 + ... + n_{W-1}, ...)``, in that dealing
  order (the data set's order for an evaluation loader with ``shuffle=False``).

Both are collectives: every rank of the group calls them. Gradients flow back with ``sync_grads``, as in
Lightning (``torch.distributed.nn.functional.all_gather``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ddp_strategy._compat import lightning_private as _pl
from ddp_strategy._compat.namespace import rank_zero_warn


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def gather_shapes(tensor: Tensor, group: Any | None = None) -> list[tuple[int, ...]]:
    """Every rank's ``tensor.shape``, ``[shape on rank 0, ..., shape on rank W-1]``; ``[tensor.shape]`` without a
    process group. A collective (Lightning's ``_gather_all_tensors`` on the shape vectors, which pads and trims
    vectors of different lengths, so the ranks' tensors may even differ in dimensions)."""
    if not _initialized():
        return [tuple(tensor.shape)]
    local = torch.tensor(tensor.shape, dtype=torch.long, device=tensor.device)
    return [tuple(shape.tolist()) for shape in _pl.gather_all_tensors(local, group)]


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


def _gather_stacked(tensor: Tensor, sizes: list[int], group: Any | None, sync_grads: bool) -> Tensor:
    """Every rank's rows padded with zeros to ``M = max(sizes)``, flattened: shape ``(W * M, *rest)``."""
    padding = tensor.new_zeros((max(sizes) - tensor.shape[0], *tensor.shape[1:]))
    stacked = _pl.all_gather_ddp_if_available(torch.cat([tensor, padding]), group=group, sync_grads=sync_grads)
    return stacked.flatten(0, 1)


def all_gather_padded(tensor: Tensor, shapes: list[tuple[int, ...]], group: Any | None = None,
                      sync_grads: bool = False, warn: bool = False) -> Tensor:
    """Gather tensors whose first dimension differs between the ranks into ``(W, M, *rest)``, ``M = max n_r``.

    A collective: every rank calls it with its own tensor and the same ``shapes`` (from :func:`gather_shapes`).
    Rank ``r``'s rows ``0..n_r-1`` are its tensor; its rows ``n_r..M-1`` are filled as a ``DistributedSampler``
    pads (module docstring), so ``result.flatten(0, 1)`` holds every real row once plus ``W * M - sum(n_r)``
    repeats of the first dealt rows.

    Args:
        tensor: this rank's tensor, shape ``(n_r, *rest)``.
        shapes: every rank's shape.
        group: the process group; ``None`` = the world.
        sync_grads: let gradients flow through the gather to every rank's original rows (Lightning's flag).
        warn: warn (rank 0) that ``flatten(0, 1)`` counts the repeated rows twice.

    Raises:
        ValueError: the tensors differ in a dimension other than the first (on every rank).
    """
    check_gatherable(shapes, dist.get_rank())
    sizes = [shape[0] for shape in shapes]
    world, most, rest = len(sizes), max(sizes), shapes[0][1:]
    if warn:
        rank_zero_warn(
            f"all_gather got first dimensions {sizes} on ranks 0..{world - 1}: the result has {most} rows per rank,"
            f" and the {world * most - sum(sizes)} missing row(s) repeat the first rows, as DistributedSampler pads a"
            " data set. For per-sample evaluation outputs this is what Lightning's ddp gives (its sampler evaluates"
            " those samples twice), so .flatten(0, 1) counts them twice. For every row exactly once use"
            " ddp_strategy.all_gather_rows(tensor), or a torchmetrics metric."
        )
    stacked = _gather_stacked(tensor, sizes, group, sync_grads)
    real = _dealing_order(sizes)
    source = list(range(world * most))
    missing = [(r, i) for i in range(most) for r in range(world) if i >= sizes[r]]
    for j, (r, i) in enumerate(missing):
        q, k = real[j % len(real)]
        source[r * most + i] = q * most + k
    index = torch.tensor(source, dtype=torch.long, device=stacked.device)
    return stacked.index_select(0, index).reshape(world, most, *rest)


def all_gather_rows(tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
    """Every rank's rows, each exactly once: shape ``(n_0 + ... + n_{W-1}, *rest)``.

    The exact counterpart of ``self.all_gather(x).flatten(0, 1)`` for per-sample outputs: nothing is padded or
    repeated. Rows come in the order a ``DistributedSampler`` deals them (row 0 of ranks 0..W-1, then row 1,
    ...): for the outputs of a whole evaluation epoch on a loader with ``shuffle=False`` that is the data set's
    order. A collective: call it on every rank (for example in ``on_validation_epoch_end``). Without a process
    group it returns ``tensor``.

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
    check_gatherable(shapes, dist.get_rank())
    sizes = [s[0] for s in shapes]
    if max(sizes) == 0:
        return tensor
    stacked = _gather_stacked(tensor, sizes, group, sync_grads)
    index = [r * max(sizes) + i for r, i in _dealing_order(sizes)]
    return stacked.index_select(0, torch.tensor(index, dtype=torch.long, device=stacked.device))


def on_global_zero(rank: int, device: torch.device, what: str, work: Callable[..., Any], *args: Any) -> None:
    """Run ``work(*args)`` on global rank 0, then agree on its outcome: one all-reduced flag (also a barrier), and
    rank 0's message only after a failure. A collective, for rank-0 side effects (a checkpoint write) whose failure
    every rank must see, so that none is left waiting in a later collective.

    Raises:
        Exception: ``work``'s error on rank 0; on the others a ``RuntimeError`` naming it.
    """
    error = None
    if rank == 0:
        try:
            work(*args)
        except Exception as e:
            error = e
    message = None if error is None else f"{type(error).__name__}: {error}"
    if _initialized():
        failed = torch.tensor([float(error is not None)], device=device)
        dist.all_reduce(failed, op=dist.ReduceOp.MAX)
        if failed.item():  # every rank knows now that it failed: rank 0's message for the others' error
            box = [message]
            dist.broadcast_object_list(box, 0)
            message = box[0]
    if error is not None:
        raise error
    if message is not None:
        raise RuntimeError(f"[rank {rank}] global rank 0 failed {what}: {message}")


__all__ = ["all_gather_padded", "all_gather_rows", "check_gatherable", "gather_shapes", "on_global_zero"]
