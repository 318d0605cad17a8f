"""Wrapping errors (ddp_strategy/sync/): a model with nothing to train and parameters that get no gradient are
refused with what to do, and each fix the error suggests trains. One process (``Trainer(devices=1)``); the 2-rank
unused-parameter error is in tests/sync/test_ddp_equivalence.py.
"""

from __future__ import annotations

import re
from pathlib import Path

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


#: The start of the text Lightning's ``ddp`` raises in place of DDP's "Expected to have finished reduction ...".
LIGHTNING_UNUSED = "It looks like your LightningModule has parameters that were not used in producing the loss"


class FrozenAfterFirstStep(Regressor):
    """``a`` and ``b`` both train in the first step; ``b`` is frozen before the second, after DDP wrapped it."""

    def __init__(self) -> None:
        super().__init__(unused=True)

    def on_train_batch_start(self, batch, batch_idx):
        if batch_idx == 1:
            self.b.requires_grad_(False)

    def training_step(self, batch, batch_idx):
        return (self.a(batch[0]) + self.b(batch[0])).pow(2).mean()


def test_what_lightnings_ddp_shows_for_a_parameter_without_gradient_is_what_the_docs_quote(tmp_path, caplog):
    """Under strategy="ddp", a parameter unused from the start and one frozen after the first step both end the fit
    with Lightning's "It looks like your LightningModule has parameters ..." in place of DDP's text, naming neither
    the parameter nor its index; docs/differences.md quotes that text (not DDP's). Ours names the unused one (above)
    and trains on through the freeze."""
    for model in (Regressor(unused=True), FrozenAfterFirstStep()):
        message = error_of(lambda model=model: fit_steps(tmp_path, model, "ddp"), caplog)
        assert message.startswith(f"RuntimeError: {LIGHTNING_UNUSED} returned by training_step."), message
        assert "Expected to have finished reduction" not in message and "indices" not in message
    assert fit_steps(tmp_path, FrozenAfterFirstStep()) == 3
    differences = (Path(__file__).parents[2] / "docs" / "differences.md").read_text()
    assert differences.count(f'"{LIGHTNING_UNUSED}') == 3 and "DDP's own `RuntimeError`" not in differences
