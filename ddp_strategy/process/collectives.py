"""The strategy's collectives (barrier, broadcast, reduce, all_gather), and ``all_gather`` for uneven tensors.

:class:`Collectives` gives :class:`~ddp_strategy.strategy.MyDDPStrategy` its ``barrier``, ``broadcast``,
``reduce`` and ``all_gather``, each a no-op (or the input) without a process group, and
:meth:`Collectives.raise_on_every_rank` for rank-0-only work whose failure every rank must see.

``all_gather`` for tensors whose first dimension differs between the ranks:

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

from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ddp_strategy._compat.namespace import rank_zero_warn
from ddp_strategy.process import group as process_group

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


class Collectives:
    """The collectives of one strategy: every method must be called on every rank (world size 1 included).

    Args:
        check: called as ``check(collective_name, rank)`` before each of ``barrier``, ``broadcast``, ``reduce``
            and ``all_gather``; raises to refuse it (the strategy passes the evaluation-step guard of
            :class:`ddp_strategy.sampling.LoaderSharding`, which refuses per-step collectives on uneven loaders).
    """

    def __init__(self, check: Callable[[str, int], None] | None = None) -> None:
        self._check = check or (lambda collective, rank: None)
        self._warned_padded_gather = False

    def barrier(self, device: torch.device, rank: int) -> None:
        """Wait for every rank; NCCL gets this rank's device id. A no-op without a process group."""
        self._check("barrier", rank)
        if not _initialized():
            return
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=process_group.device_ids(device))
        else:
            dist.barrier()

    def broadcast(self, obj: Any, src: int, rank: int) -> Any:
        """Rank ``src``'s ``obj`` on every rank (pickled); ``obj`` itself without a process group."""
        self._check("broadcast", rank)
        if not _initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

    def reduce(self, tensor: Tensor | Any, group: Any | None, reduce_op: Any | None, rank: int) -> Tensor | Any:
        """All-reduce ``tensor`` over the world (``reduce_op`` ``"mean"`` by default); non-tensors pass through.

        Raises:
            ValueError: ``group`` is given (only the world is supported), or ``reduce_op`` is unknown.
        """
        self._check("reduce (e.g. self.log(..., on_step=True, sync_dist=True))", rank)
        if group is not None:
            raise ValueError("MyDDPStrategy.reduce only reduces over the world process group; pass group=None.")
        if not isinstance(tensor, Tensor):
            return tensor
        return process_group.all_reduce(tensor, op=reduce_op or "mean")

    def all_gather(self, tensor: Tensor, group: Any | None, sync_grads: bool, rank: int,
                   equal_shapes: Callable[[], Tensor]) -> Tensor:
        """Shape ``(W, *shape)``; the first dimension may differ between ranks (then ``(W, max n_r, *rest)``).

        ``equal_shapes()`` (Lightning's own gather) gives the result when every shape is equal or there is
        no process group; otherwise the missing rows are filled as ``DistributedSampler`` pads a data set
        (:func:`all_gather_padded`), and rank 0 warns once that ``flatten(0, 1)`` then counts rows twice.

        Raises:
            ValueError: the tensors differ in another dimension (on every rank).
            RuntimeError: refused by ``check`` (inside an evaluation step whose ranks hold different batch counts).
        """
        self._check("all_gather", rank)
        if not _initialized():
            return equal_shapes()
        shapes = gather_shapes(tensor, group)
        if shapes is None or len(set(shapes)) == 1:
            return equal_shapes()
        check_gatherable(shapes, rank)
        sizes = [shape[0] for shape in shapes]
        if not self._warned_padded_gather:
            self._warned_padded_gather = True
            repeats = len(sizes) * max(sizes) - sum(sizes)
            rank_zero_warn(
                f"all_gather got first dimensions {sizes} on ranks 0..{len(sizes) - 1}: the result has"
                f" {max(sizes)} rows per rank, and the {repeats} missing row(s) repeat the first rows, as"
                " DistributedSampler pads a data set. For per-sample evaluation outputs this is what Lightning's"
                " ddp gives (its sampler evaluates those samples twice), so .flatten(0, 1) counts them twice. For"
                " every row exactly once use ddp_strategy.all_gather_rows(tensor), or a torchmetrics metric."
            )
        return all_gather_padded(tensor, sizes, group, sync_grads)

    def on_rank_zero(self, work: Callable[[], Any], what: str, rank: int) -> None:
        """Run ``work`` on global rank 0 only, then agree on its outcome (a collective, so also a barrier).

        For rank-0-only side effects (writing a checkpoint) whose failure every rank must see, so none is left
        waiting in a later collective.

        Raises:
            Exception: ``work``'s error on rank 0; on the others a ``RuntimeError`` naming it.
        """
        error = None
        if rank == 0:
            try:
                work()
            except Exception as e:
                error = e
        self.raise_on_every_rank(error, what, rank)

    def raise_on_every_rank(self, error: Exception | None, what: str, rank: int) -> None:
        """Broadcast rank 0's outcome (a collective, so also a barrier); raise on every rank if it failed.

        Raises:
            Exception: ``error`` itself on rank 0; on the others a ``RuntimeError`` naming rank 0's error.
        """
        message = self.broadcast(None if error is None else f"{type(error).__name__}: {error}", 0, rank)
        if error is not None:
            raise error
        if message is not None:
            raise RuntimeError(f"[rank {rank}] global rank 0 failed {what}: {message}")


__all__ = ["MAX_DIMS", "Collectives", "all_gather_padded", "all_gather_rows", "check_gatherable", "gather_shapes"]
