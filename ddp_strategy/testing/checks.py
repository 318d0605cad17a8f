"""Assertions DDP tests need, on the per-rank values :func:`~ddp_strategy.testing.run_on_ranks` returns.

Each raises ``AssertionError`` naming the rank and the entry that differ: parameters identical on every rank (DDP's
guarantee after each optimizer step, https://pytorch.org/docs/stable/notes/ddp.html), each sample read exactly once
per epoch across ranks (a ``DistributedSampler`` without padding), a gathered value equal to the one-process one.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch


def _array(value: Any) -> torch.Tensor | None:
    """``value`` as a CPU tensor if it is a tensor, a numeric NumPy array or scalar, or a float (float64); else None."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, float):
        return torch.tensor(value, dtype=torch.float64)
    # NumPy's arrays and scalars of numbers (told apart without importing NumPy), as torch.as_tensor takes them
    if hasattr(value, "__array_interface__") and getattr(getattr(value, "dtype", None), "kind", None) in tuple("biufc"):
        return torch.as_tensor(value)
    return None


def _tensor_differences(
    x: torch.Tensor, y: torch.Tensor, where: str, atol: float, rtol: float, same_dtype: bool
) -> list[str]:
    """NaN equals NaN at the same position (``torch.allclose(..., equal_nan=True)``); exactly also means one dtype."""
    if x.shape != y.shape:
        return [f"{where}: shapes {tuple(x.shape)} and {tuple(y.shape)}"]
    if same_dtype and atol == rtol == 0 and x.dtype != y.dtype:
        return [f"{where}: dtypes {x.dtype} and {y.dtype} (with atol=rtol=0 the values must be bitwise equal)"]
    nan_x, nan_y = torch.isnan(x), torch.isnan(y)
    if not torch.equal(nan_x, nan_y):
        return [f"{where}: NaN at different positions, first at index {(nan_x != nan_y).nonzero()[0].tolist()}"]
    wide = torch.promote_types(torch.promote_types(x.dtype, y.dtype), torch.float64)  # complex stays complex
    x, y = x[~nan_x].to(wide), y[~nan_y].to(wide)
    if torch.equal(x, y) if atol == rtol == 0 else torch.allclose(x, y, rtol, atol):
        return []
    return [f"{where}: max abs difference {(x - y).abs().max().item():.3g}"]


def _differences(a: Any, b: Any, where: str, atol: float, rtol: float) -> list[str]:
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        if set(a) != set(b):
            return [f"{where}: keys differ ({sorted(map(str, set(a) ^ set(b)))[:5]})"]
        return [d for key in a for d in _differences(a[key], b[key], f"{where}[{key!r}]", atol, rtol)]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{where}: lengths {len(a)} and {len(b)}"]
        return [
            d
            for i, (x, y) in enumerate(zip(a, b, strict=True))
            for d in _differences(x, y, f"{where}[{i}]", atol, rtol)
        ]
    if isinstance(a, torch.nn.Module) and isinstance(b, torch.nn.Module):
        return _differences(a.state_dict(), b.state_dict(), where, atol, rtol)
    x, y = _array(a), _array(b)
    if x is not None or y is not None:  # tensors, arrays and floats: within tolerance, NaN equal to NaN
        try:
            x, y = (torch.as_tensor(v) if t is None else t for v, t in ((a, x), (b, y)))
        except (TypeError, ValueError, RuntimeError):
            return [f"{where}: a {type(a).__name__} and a {type(b).__name__}"]
        # a dtype counts only when both are arrays: a Python number against a tensor is compared by value
        return _tensor_differences(
            x, y, where, atol, rtol, not isinstance(a, (int, float)) and not isinstance(b, (int, float))
        )
    return [] if a == b else [f"{where}: {a!r} != {b!r}"]


def assert_same_on_every_rank(
    per_rank: Sequence[Any], what: str = "value", atol: float = 0.0, rtol: float = 0.0
) -> None:
    """Every rank's value equals rank 0's, entry by entry: tensors and NumPy arrays (exactly, or within
    ``atol``/``rtol``; NaN equals NaN at the same position; floats as float64), modules (their state dicts),
    dicts, lists and plain values.

    Args:
        per_rank: ``[value of rank 0, ..., value of rank W-1]``, e.g. ``run_on_ranks``' result.
        what: what the values are, for the message (``"parameters"``).
        atol, rtol: tolerances for tensors; 0 (the default, as DDP keeps replicas) = bitwise, dtypes included.

    Raises:
        ValueError: ``per_rank`` is empty.
        AssertionError: naming each rank and entry that differs from rank 0's (a value, a NaN position, a shape,
            a dtype when the tolerances are 0, a key or a length).
    """
    per_rank = list(per_rank)
    if not per_rank:
        raise ValueError(
            f"assert_same_on_every_rank needs at least one rank's {what}, got none: pass the list"
            " run_on_ranks returned."
        )
    problems = [
        f"rank {rank} vs rank 0: {d}"
        for rank, value in enumerate(per_rank[1:], start=1)
        for d in _differences(value, per_rank[0], what, atol, rtol)
    ]
    assert not problems, f"{what} differ between ranks:\n" + "\n".join(problems[:20])


def assert_each_sample_once(per_rank_indices: Sequence[Any], num_samples: int) -> None:
    """Across the ranks, the sample indices ``0 .. num_samples - 1`` were each read exactly once.

    Args:
        per_rank_indices: per rank, the indices it read in one epoch: ints, or its batches as collected (index
            tensors, NumPy arrays, nested lists), flattened: ``[[tensor([0, 1]), tensor([2, 3])], [tensor([4])]]``.
        num_samples: N, the data set's length.

    Raises:
        TypeError: an index that is not an integer (a float with a fraction, a string, ...).
        AssertionError: naming indices read twice (and by which ranks), missing, or out of range.
    """
    readers: dict[int, list[int]] = {}
    for rank, indices in enumerate(per_rank_indices):
        for index in _flat_indices(indices, rank):
            readers.setdefault(index, []).append(rank)
    twice = {i: ranks for i, ranks in readers.items() if len(ranks) > 1}
    missing = sorted(set(range(num_samples)) - set(readers))
    outside = sorted(i for i in readers if not 0 <= i < num_samples)
    problems = (
        ([f"read more than once: {dict(list(sorted(twice.items()))[:10])} (index: ranks)"] if twice else [])
        + ([f"never read: {missing[:20]}"] if missing else [])
        + ([f"outside 0..{num_samples - 1}: {outside[:20]}"] if outside else [])
    )
    assert not problems, f"not every sample read exactly once across {len(per_rank_indices)} ranks: " + "; ".join(
        problems
    )


def _flat_indices(indices: Any, rank: int) -> list[int]:
    """One rank's indices as a flat list of ints, from ints, tensors, NumPy arrays and (nested) lists of them."""
    array = _array(indices)
    if array is None and isinstance(indices, Iterable) and not isinstance(indices, (str, bytes)):
        return [i for item in indices for i in _flat_indices(item, rank)]
    values = [indices] if array is None else array.flatten().tolist()
    wrong = [v for v in values if not isinstance(v, numbers.Integral) and not (isinstance(v, float) and v.is_integer())]
    if wrong:
        raise TypeError(
            f"assert_each_sample_once: rank {rank} read {wrong[0]!r}, which is not a sample index;"
            " pass each rank's integer indices (ints, integer tensors or arrays, lists of them)."
        )
    return [int(v) for v in values]


def assert_matches_single_process(
    distributed: Any, single_process: Any, what: str = "value", atol: float = 1e-6, rtol: float = 1e-5
) -> None:
    """A value computed with W ranks (a gathered metric, the weights after a step) equals the one-process value.

    Args:
        distributed: one rank's value, after a gather or a synchronised step.
        single_process: the same quantity computed in one process on all the data.
        what: what it is, for the message.
        atol, rtol: tensor tolerances (default 1e-6, 1e-5: the order of floating-point sums differs).

    Raises:
        AssertionError: naming each entry that differs.
    """
    problems = _differences(distributed, single_process, what, atol, rtol)
    assert not problems, f"{what} with several ranks differs from one process:\n" + "\n".join(problems[:20])
