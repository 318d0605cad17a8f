"""The evaluation-step guard and batch-count agreement, in one process."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from ddp_strategy.evaluation import (
    BATCH_COUNTS_ATTR,
    EvaluationStepGuard,
    agree_batch_counts,
    current_loader,
    effective_counts,
)


def test_agree_batch_counts_without_process_group_records_the_local_length():
    """Without a process group the agreement is this rank's length, stored on the loader."""
    loader = DataLoader(TensorDataset(torch.arange(9)), batch_size=4)
    assert agree_batch_counts(loader) == (3,)
    assert getattr(loader, BATCH_COUNTS_ATTR) == (3,)


def test_effective_counts_follow_lightning_limits():
    """An int limit caps each rank's batches; a float takes a share; 1.0 keeps them."""
    assert effective_counts((3, 2), 2) == (2, 2)
    assert effective_counts((4, 2), 0.5) == (2, 1)
    assert effective_counts((3, 2), 1.0) == (3, 2)


def test_guard_refuses_collectives_only_inside_steps_on_uneven_loaders():
    """Uneven [2, 1]: a collective in the step raises with the counts; outside steps and on even loaders it passes."""
    guard = EvaluationStepGuard()
    uneven, even = DataLoader(range(3)), DataLoader(range(4))
    setattr(uneven, BATCH_COUNTS_ATTR, (2, 1))
    setattr(even, BATCH_COUNTS_ATTR, (2, 2))
    guard.check("reduce", 0)
    with guard.step("validation_step", even, 1.0):
        guard.check("reduce", 0)
    with guard.step("validation_step", uneven, 1):  # capped at 1 batch each: even
        guard.check("reduce", 0)
    with guard.step("validation_step", uneven, 1.0), pytest.raises(RuntimeError, match=r"\[rank 1\].*\[2, 1\]"):
        guard.check("reduce", 1)
    guard.check("reduce", 0)  # the step ended


def test_current_loader_uses_the_dataloader_index():
    """Lightning passes dataloader_idx third only with several loaders."""
    a, b = object(), object()
    assert current_loader(a, ("batch", 0), {}) is a
    assert current_loader([a, b], ("batch", 0, 1), {}) is b
    assert current_loader({"x": a, "y": b}, ("batch", 0), {"dataloader_idx": 1}) is b
    assert current_loader(None, (), {}) is None
