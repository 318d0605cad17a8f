"""``all_gather`` for tensors whose first dimension differs between the ranks, on Lightning's own gathers; the
strategy's all-reduce (:func:`all_reduce`: Lightning's, without its barrier).

Lightning's ``all_gather`` needs the same shape on every rank, but exact evaluation shards
(:func:`ddp_strategy.sampling.loaders.shard_for_evaluation`) make per-sample outputs uneven when N is not a
multiple of W. Rows are taken in the order a ``DistributedSampler`` deals them (row 0 of ranks 0..W-1, then row 1, ...):
:func:`all_gather_padded` gives ``(W, M, ...)`` with the missing rows filled as the sampler pads a data set (3
samples on 2 ranks: ``[[0, 2], [1, 0]]``, exactly Lightning's); :func:`all_gather_rows` every real row once.
Both are collectives; gradients flow back with ``sync_grads``, as in Lightning.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
import torch.distributed as dist

from ddp_strategy._compat import lightning_private as _pl
from ddp_strategy._compat.namespace import rank_zero_warn


def all_reduce(tensor: torch.Tensor, group: Any | None = None, reduce_op: Any = "mean") -> torch.Tensor:
    """``tensor`` all-reduced over ``group`` (default: the world) in place and returned, as Lightning's ``_sync_ddp``
    but without the barrier it makes first (``MyDDPStrategy.reduce`` makes its round there): ``"mean"``/``"avg"`` (any
    case) the sum divided by the group's size (what Lightning does under gloo, which has no average; under NCCL it
    asks for NCCL's average), another name the ``torch.distributed.ReduceOp`` of that name, a ``ReduceOp`` as it is.
    ``tensor`` itself without a process group. A collective.

    Raises:
        AttributeError: a name that is no ``ReduceOp`` (as Lightning's).
    """
    if not dist.is_initialized():
        return tensor
    mean = str(reduce_op).lower() in ("mean", "avg")
    op = getattr(dist.ReduceOp, "SUM" if mean else reduce_op.upper()) if isinstance(reduce_op, str) else reduce_op
    dist.all_reduce(tensor, op, group)
    return tensor.div_(dist.get_world_size(group)) if mean else tensor


def gather_shapes(tensor: torch.Tensor, group: Any | None = None) -> list[tuple[int, ...]]:
    """Every rank's ``tensor.shape``, in rank order (``[tensor.shape]`` without a group). A collective (Lightning's
    ``_gather_all_tensors``, so the ranks' tensors may differ in dimensions)."""
    if not dist.is_initialized():
        return [tuple(tensor.shape)]
    local = torch.tensor(tensor.shape, dtype=torch.long, device=tensor.device)
    return [tuple(shape.tolist()) for shape in _pl.gather_all_tensors(local, group)]


def check_gatherable(shapes: list[tuple[int, ...]], rank: int) -> None:
    """Raise ``ValueError`` (on every rank: they hold the same ``shapes``) unless only the first dimension
    differs."""
    first = shapes[0]
    if not all(len(s) == len(first) and len(s) > 0 and s[1:] == first[1:] for s in shapes):
        raise ValueError(
            f"[rank {rank}] all_gather needs tensors with the same number of dimensions and the same size in every"
            f" dimension but the first on every rank; got"
            f" {', '.join(f'rank {r}: {tuple(s)}' for r, s in enumerate(shapes))}."
            " Pad or reshape them to a common shape first (the first dimension may differ: the result is then"
            " padded, see ddp_strategy.process.collectives)."
        )


def _dealing_order(sizes: list[int]) -> list[tuple[int, int]]:
    """Real rows ``(rank, row)`` in the order a DistributedSampler deals them: row 0 of every rank, row 1, ..."""
    return [(r, i) for i in range(max(sizes)) for r, n in enumerate(sizes) if i < n]


def all_gather_padded(
    tensor: torch.Tensor,
    shapes: list[tuple[int, ...]],
    group: Any | None = None,
    sync_grads: bool = False,
    warn: bool = False,
) -> torch.Tensor:
    """Gather each rank's ``(n_r, *rest)`` tensor into ``(W, M, *rest)``, ``M = max n_r``, rows ``n_r..M-1`` filled
    as a ``DistributedSampler`` pads (module docstring). A collective; ``shapes`` from :func:`gather_shapes`;
    ``warn``: warn (rank 0) that ``flatten(0, 1)`` counts the repeats twice. ``ValueError``: see
    :func:`check_gatherable`."""
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
    padded = torch.cat([tensor, tensor.new_zeros((most - tensor.shape[0], *rest))])  # zeros up to M rows
    stacked = _pl.all_gather_ddp_if_available(padded, group=group, sync_grads=sync_grads).flatten(0, 1)  # (W * M, ...)
    missing = [(r, i) for i in range(most) for r in range(world) if i >= sizes[r]]  # in dealing order too
    fills = dict(zip(missing, itertools.cycle(_dealing_order(sizes)), strict=False))  # missing row -> real row
    source = [q * most + k for r in range(world) for i in range(most) for q, k in [fills.get((r, i), (r, i))]]
    index = torch.tensor(source, dtype=torch.long, device=stacked.device)
    return stacked.index_select(0, index).reshape(world, most, *rest)


def all_gather_rows(tensor: torch.Tensor, group: Any | None = None, sync_grads: bool = False) -> torch.Tensor:
    """Every rank's rows, each exactly once: ``self.all_gather(x).flatten(0, 1)`` without padding or repeats.

    Rows come in the order a ``DistributedSampler`` deals them: for a whole evaluation epoch with
    ``shuffle=False``, the data set's order. A collective: call it on every rank (e.g. in
    ``on_validation_epoch_end``). Without a process group it returns ``tensor``.

    Args:
        tensor: this rank's tensor, shape ``(n_r, *rest)``; ``rest`` equal on every rank.
        group: the process group; ``None`` = the world.
        sync_grads: let gradients flow through the gather.

    Returns:
        Shape ``(n_0 + ... + n_{W-1}, *rest)``.

    Raises:
        ValueError: the tensors differ in a dimension other than the first, or are 0-dimensional (on every rank).
    """
    if not dist.is_initialized():
        return tensor
    shapes = gather_shapes(tensor, group)
    padded = all_gather_padded(tensor, shapes, group, sync_grads)  # (W, M, *rest); its real rows are in place
    rows = [r * padded.shape[1] + i for r, i in _dealing_order([shape[0] for shape in shapes])]
    return padded.flatten(0, 1).index_select(0, torch.tensor(rows, dtype=torch.long, device=padded.device))
