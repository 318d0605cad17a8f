"""Assertions DDP tests need, on the per-rank values :func:`~ddp_strategy.testing.run_on_ranks` returns.

Each raises ``AssertionError`` naming the rank and the entry that differ, so a failing test says where the ranks
went apart: parameters identical on every rank (what DDP guarantees after each optimizer step,
https://pytorch.org/docs/stable/notes/ddp.html), each sample read exactly once per epoch across ranks (what a
``DistributedSampler`` without padding guarantees), and a gathered value equal to the single-process one.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch


def _differences(a: Any, b: Any, where: str, atol: float, rtol: float) -> list[str]:
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        if set(a) != set(b):
            return [f"{where}: keys differ ({sorted(map(str, set(a) ^ set(b)))[:5]})"]
        return [d for key in a for d in _differences(a[key], b[key], f"{where}[{key!r}]", atol, rtol)]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{where}: lengths {len(a)} and {len(b)}"]
        pairs = enumerate(zip(a, b, strict=True))
        return [d for i, (x, y) in pairs for d in _differences(x, y, f"{where}[{i}]", atol, rtol)]
    if isinstance(a, torch.nn.Module):
        return _differences(a.state_dict(), b.state_dict(), where, atol, rtol)
    if isinstance(a, (torch.Tensor, float)) or isinstance(b, (torch.Tensor, float)):  # floats: within tolerance
        x, y = torch.as_tensor(a), torch.as_tensor(b)
        if x.shape != y.shape:
            return [f"{where}: shapes {tuple(x.shape)} and {tuple(y.shape)}"]
        same = torch.equal(x, y) if atol == rtol == 0 else torch.allclose(x.double(), y.double(), rtol, atol)
        return [] if same else [f"{where}: max abs difference {(x.double() - y.double()).abs().max().item():.3g}"]
    return [] if a == b else [f"{where}: {a!r} != {b!r}"]


def assert_same_on_every_rank(per_rank: Sequence[Any], what: str = "value", atol: float = 0.0,
                              rtol: float = 0.0) -> None:
    """Every rank's value equals rank 0's: tensors (exactly, or within ``atol``/``rtol``), modules (their state
    dicts), dicts, lists and plain values, compared entry by entry.

    Args:
        per_rank: ``[value of rank 0, ..., value of rank W-1]``, e.g. ``run_on_ranks``' result.
        what: what the values are, for the message (``"parameters"``).
        atol, rtol: tolerances for tensors; 0 = bitwise equal (default: DDP keeps replicas bitwise equal).

    Raises:
        AssertionError: naming each rank and entry that differs from rank 0's.
    """
    problems = [f"rank {rank} vs rank 0: {d}" for rank, value in enumerate(per_rank[1:], start=1)
                for d in _differences(value, per_rank[0], what, atol, rtol)]
    assert not problems, f"{what} differ between ranks:\n" + "\n".join(problems[:20])


def assert_each_sample_once(per_rank_indices: Sequence[Iterable[int]], num_samples: int) -> None:
    """Across the ranks, the sample indices ``0 .. num_samples - 1`` were each read exactly once.

    Args:
        per_rank_indices: the indices each rank read in one epoch (e.g. collected from its batches).
        num_samples: N, the data set's length.

    Raises:
        AssertionError: naming indices read twice (and by which ranks), missing, or out of range.
    """
    readers: dict[int, list[int]] = {}
    for rank, indices in enumerate(per_rank_indices):
        for index in indices:
            readers.setdefault(int(index), []).append(rank)
    twice = {i: ranks for i, ranks in readers.items() if len(ranks) > 1}
    missing = sorted(set(range(num_samples)) - set(readers))
    outside = sorted(i for i in readers if not 0 <= i < num_samples)
    problems = ([f"read more than once: {dict(list(sorted(twice.items()))[:10])} (index: ranks)"] if twice else []) + (
        [f"never read: {missing[:20]}"] if missing else []) + ([f"outside 0..{num_samples - 1}: {outside[:20]}"]
                                                                if outside else [])
    assert not problems, f"not every sample read exactly once across {len(per_rank_indices)} ranks: " + "; ".join(
        problems)


def assert_matches_single_process(distributed: Any, single_process: Any, what: str = "value", atol: float = 1e-6,
                                  rtol: float = 1e-5) -> None:
    """A value computed with W ranks (a gathered metric, the weights after a step) equals the one-process value.

    Args:
        distributed: the value from the ranks (one rank's, after a gather or a synchronised step).
        single_process: the same quantity computed in one process on all the data.
        what: what it is, for the message.
        atol, rtol: tensor tolerances (default 1e-6, 1e-5: the order of floating-point sums differs).

    Raises:
        AssertionError: naming each entry that differs.
    """
    problems = _differences(distributed, single_process, what, atol, rtol)
    assert not problems, f"{what} with several ranks differs from one process:\n" + "\n".join(problems[:20])
