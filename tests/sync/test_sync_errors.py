"""Wrapping errors (ddp_strategy/sync/): a model with nothing to train and parameters that get no gradient are
refused with what to do, and each fix the error suggests trains. One process (``Trainer(devices=1)``); the 2-rank
unused-parameter error is in tests/sync/test_ddp_equivalence.py.
"""

from __future__ import annotations

import re

import pytest
import torch
from ddp_testing import Regressor, error_of, fit_steps, loader, one_rank_trainer

from ddp_strategy import MyDDPStrategy

pytestmark = pytest.mark.timeout(120)


def test_unused_parameters_error_each_suggested_fix_trains(tmp_path, caplog):
    """'received no gradient': find_unused_parameters=True, freezing them, and static_graph=True each train 3 steps."""
    message = error_of(lambda: fit_steps(tmp_path, Regressor(unused=True)), caplog)
    assert re.match(r"RuntimeError: .* Pass MyDDPStrategy\(find_unused_parameters=True\)", message, re.S), message
    assert fit_steps(tmp_path, Regressor(unused=True), MyDDPStrategy(timeout=30, find_unused_parameters=True)) == 3
    frozen = Regressor(unused=True)
    frozen.b.requires_grad_(False)
    assert fit_steps(tmp_path, frozen) == 3
    assert fit_steps(tmp_path, Regressor(unused=True), MyDDPStrategy(timeout=30, static_graph=True)) == 3


def test_nothing_to_train_error_suggestions_work(tmp_path, caplog):
    """No parameter requires a gradient: refused (before DDP's own, less helpful, error) naming the module; for a
    frozen model fit refuses, trainer.validate runs as suggested, and after unfreezing, fit trains 3 steps."""
    model = Regressor()
    model.requires_grad_(False)
    message = error_of(lambda: one_rank_trainer(tmp_path, max_steps=3).fit(model, loader()), caplog)
    wanted = "ValueError: Regressor has no parameters that require a gradient.* Unfreeze .* or use trainer.validate"
    assert re.match(wanted, message, re.S), message
    (metrics,) = one_rank_trainer(tmp_path).validate(model, loader(), verbose=False)
    expected = torch.stack([model.a(x).pow(2).mean() for (x,) in loader()]).mean()
    assert metrics["val"] == pytest.approx(expected.item(), rel=1e-5)
    model.requires_grad_(True)
    assert fit_steps(tmp_path, model) == 3
