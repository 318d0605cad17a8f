"""Every way Lightning stops a fit in the middle of an epoch and saves resumes to the uninterrupted run's weights,
or warns at the resume that it does not; several training loaders resume too (issue 37 items 2 and 3).

One process (``devices=1``: the samplers are injected as on any world size; where the epoch resumes is decided
from Lightning's fit-loop counters alone, the same on every rank). 40 samples in batches of 4: 10 steps an epoch,
30 in all; each way stops at step 13, batch 3 of epoch 1. SIGTERM (``checkpoint_on_sigterm``) is tested on two
processes in tests/process/test_sigterm.py, the ``every_n_train_steps`` checkpoint on 1 to 3 processes in
tests/sampling/test_sampling_integration.py as well as here.
"""

from __future__ import annotations

import signal
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from ddp_testing import one_rank_trainer, pl, state_copy
from torch.utils.data import DataLoader, TensorDataset

from ddp_strategy import MyDDPStrategy
from ddp_strategy.sampling.sampler import remaining_positions
from ddp_strategy.sampling.state import CHECKPOINT_KEY

N, BATCH, MAX_STEPS, STOP = 40, 4, 30, 13


class Recorded(pl.LightningModule):
    """A linear model on shuffled indices; at step ``STOP`` it raises ``KeyboardInterrupt`` or sleeps ``sleep_s``;
    ``loaders`` > 1 gives a dict of loaders (a ``CombinedLoader``), the second of ``N // 2`` samples; ``workers``
    DataLoader workers each; ``n`` samples in the first."""

    def __init__(
        self, interrupt: bool = False, sleep_s: float = 0.0, loaders: int = 1, workers: int = 0, n: int = N
    ) -> None:
        super().__init__()
        self.layer, self.interrupt, self.sleep_s, self.loaders = torch.nn.Linear(1, 1), interrupt, sleep_s, loaders
        self.workers, self.n = workers, n

    def train_dataloader(self) -> Any:
        data = [
            DataLoader(TensorDataset(torch.arange(n).float()), BATCH, shuffle=True, num_workers=self.workers)
            for n in (self.n, N // 2)
        ]
        return data[0] if self.loaders == 1 else {"a": data[0], "b": data[1]}

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.global_step == STOP and self.interrupt:
            raise KeyboardInterrupt
        if self.global_step == STOP:
            time.sleep(self.sleep_s)
        x = torch.cat([b[0] for b in batch.values()]) if isinstance(batch, dict) else batch[0]
        return self.layer(x[:, None] / N).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class StopAt(pl.Callback):
    """Sets ``trainer.should_stop`` after step ``STOP`` (as ``EarlyStopping`` on a step metric would)."""

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        trainer.should_stop = trainer.should_stop or trainer.global_step == STOP


def _fit(root: Path, strategy: str, model: dict, ckpt_path: str | None = None, **kwargs: Any) -> dict[str, Any]:
    """Fit ``Recorded(**model)`` under ``strategy`` ("ours" or "ddp"), saving last.ckpt: weights, step, warnings."""
    pl.seed_everything(1)
    model = Recorded(**model)
    callbacks = [pl.callbacks.ModelCheckpoint(dirpath=root, save_last=True, **kwargs.pop("checkpoint", {}))]
    trainer = one_rank_trainer(
        root,
        MyDDPStrategy(timeout=30) if strategy == "ours" else "ddp",
        enable_checkpointing=True,
        callbacks=[*callbacks, *kwargs.pop("callbacks", [])],
        **kwargs,
    )
    handler = signal.getsignal(signal.SIGINT)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            trainer.fit(model, ckpt_path=ckpt_path)
        except SystemExit:  # Lightning's answer to KeyboardInterrupt
            pass
        finally:
            signal.signal(signal.SIGINT, handler)  # Lightning ignores SIGINT after a KeyboardInterrupt
    return {
        "global_step": trainer.global_step,
        "weights": state_copy(model),
        "warnings": [str(w.message) for w in caught],
    }


#: way -> (the stopping fit's model and Trainer arguments, its checkpoint's file name)
WAYS: dict[str, tuple[dict[str, Any], str]] = {
    "max_steps": ({"max_steps": STOP}, "last.ckpt"),
    "max_time": ({"max_time": "00:00:00:01", "sleep_s": 1.5}, "last.ckpt"),
    "should_stop": ({"max_steps": MAX_STEPS, "callbacks": [StopAt()]}, "last.ckpt"),
    "keyboard_interrupt": (
        {"max_steps": MAX_STEPS, "interrupt": True, "callbacks": [pl.callbacks.OnExceptionCheckpoint(".", "exc")]},
        "exc.ckpt",
    ),
    "every_n_train_steps": (
        {"max_steps": MAX_STEPS, "checkpoint": {"every_n_train_steps": STOP, "save_top_k": -1}},
        f"epoch=1-step={STOP}.ckpt",
    ),
}


def _stop_and_resume(root: Path, strategy: str, way: str, **resume: Any) -> dict[str, Any]:
    """Stop a fit ``way``, then resume its checkpoint in a new Trainer (``resume``: default ``max_steps=30``)."""
    arguments, name = WAYS[way]
    arguments = dict(arguments)
    model = {"interrupt": arguments.pop("interrupt", False), "sleep_s": arguments.pop("sleep_s", 0.0)}
    for callback in arguments.get("callbacks", []):
        if isinstance(callback, pl.callbacks.OnExceptionCheckpoint):
            callback.dirpath = str(root / "stop")
    stopped = _fit(root / "stop", strategy, model, **arguments)
    resumed = _fit(root / "resume", strategy, {}, str(root / "stop" / name), **(resume or {"max_steps": 30}))
    return {"stopped": stopped, **resumed}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict[str, Any]:
    return _fit(tmp_path_factory.mktemp("uninterrupted"), "ours", {}, max_steps=MAX_STEPS)


def _assert_same_weights(got: dict[str, Any], expected: dict[str, Any]) -> None:
    for name, value in expected["weights"].items():
        torch.testing.assert_close(got["weights"][name], value, rtol=0, atol=0, msg=name)


def test_max_steps_mid_epoch_resumes_exactly_where_ddp_reads_the_next_epoch(tmp_path, uninterrupted):
    """max_steps=13 (mid epoch 1) with save_last, then fit(ckpt_path=last) with max_steps=30: ours gives the
    uninterrupted run's weights (Lightning counts the saved epoch processed, not completed, and finishes it);
    under ddp the same code resumes too (its loader reads the rest of the epoch from the next epoch's order)."""
    ours, ddp = _stop_and_resume(tmp_path / "ours", "ours", "max_steps"), _stop_and_resume(tmp_path, "ddp", "max_steps")
    assert ours["stopped"]["global_step"] == ddp["stopped"]["global_step"] == STOP
    assert ours["global_step"] == ddp["global_step"] == MAX_STEPS
    _assert_same_weights(ours, uninterrupted)
    assert not any("skipped" in w for w in ours["warnings"])


@pytest.mark.slow
@pytest.mark.parametrize("way", ["max_time", "should_stop", "keyboard_interrupt", "every_n_train_steps"])
def test_every_way_of_stopping_mid_epoch_resumes_exactly(tmp_path, uninterrupted, way):
    """max_time, a callback's should_stop, KeyboardInterrupt with OnExceptionCheckpoint, every_n_train_steps: the
    resume (max_steps=30) gives the uninterrupted run's weights, with no warning about the data."""
    ours = _stop_and_resume(tmp_path, "ours", way)
    assert STOP <= ours["stopped"]["global_step"] <= MAX_STEPS and ours["global_step"] == MAX_STEPS
    _assert_same_weights(ours, uninterrupted)
    assert not any("skipped" in w or "not resumable" in w for w in ours["warnings"])


@pytest.mark.slow
def test_an_epoch_lightning_counts_finished_is_skipped_as_under_ddp_with_a_warning(tmp_path):
    """should_stop mid epoch 1, resumed with max_epochs=3 (no max_steps): Lightning counts epoch 1 finished and
    starts epoch 2 under both strategies (23 steps in all); ours says so at the resume, and how to finish it."""
    ours = _stop_and_resume(tmp_path / "ours", "ours", "should_stop", max_epochs=3)
    ddp = _stop_and_resume(tmp_path / "ddp", "ddp", "should_stop", max_epochs=3)
    assert ours["global_step"] == ddp["global_step"] == MAX_STEPS - (10 - 3)
    assert any("items of epoch 1 not read are skipped" in w and "max_steps" in w for w in ours["warnings"])


@pytest.mark.slow
def test_a_mid_epoch_resume_onto_other_data_restarts_the_epoch_as_under_ddp_with_a_warning(tmp_path):
    """max_steps=13 (mid epoch 1), resumed on 48 samples instead of 40: under both strategies the epoch's data restarts
    with Lightning's batch counter restored, and the fit ends at step 30; ours says what is lost. (The weights differ:
    Lightning's sampler reads the restarted epoch in epoch 2's order, ours in epoch 1's.)"""
    runs = {}
    for strategy in ("ours", "ddp"):
        _fit(tmp_path / strategy / "stop", strategy, {}, max_steps=STOP)
        checkpoint = str(tmp_path / strategy / "stop" / "last.ckpt")
        runs[strategy] = _fit(tmp_path / strategy / "resume", strategy, {"n": 48}, checkpoint, max_steps=MAX_STEPS)
    assert runs["ours"]["global_step"] == runs["ddp"]["global_step"] == MAX_STEPS
    assert any("stream of 40 items" in w and "restarts from its beginning" in w for w in runs["ours"]["warnings"])


def test_an_epoch_ended_by_limit_train_batches_resumes_the_next_epoch_without_a_warning(tmp_path):
    """limit_train_batches=5 (half of each epoch's 10 batches), max_epochs=1, then fit(ckpt_path=last) with
    max_epochs=2: the epoch ended at its limit, so its saved position has nothing left, nothing is "skipped"
    or warned, and the weights equal the uninterrupted 2-epoch run's."""
    limited = {"limit_train_batches": 5}
    uninterrupted = _fit(tmp_path / "whole", "ours", {}, max_epochs=2, **limited)
    _fit(tmp_path / "first", "ours", {}, max_epochs=1, **limited)
    (position,) = torch.load(tmp_path / "first" / "last.ckpt", weights_only=True)[CHECKPOINT_KEY]["loaders"]
    assert remaining_positions(position["length"], position["layers"]) == []
    resumed = _fit(tmp_path / "rest", "ours", {}, str(tmp_path / "first" / "last.ckpt"), max_epochs=2, **limited)
    assert resumed["global_step"] == uninterrupted["global_step"] == 10
    _assert_same_weights(resumed, uninterrupted)
    assert not any("skipped" in w or "resumable" in w for w in resumed["warnings"])


@pytest.fixture(scope="module")
def combined(tmp_path_factory) -> dict[str, Any]:
    """Two training loaders (10 and 5 batches, max_size_cycle): an uninterrupted fit saving at steps 13 and 17
    under each strategy, and ours resumed from both (13: loader b at batch 3; 17: b has cycled)."""
    root, runs = tmp_path_factory.mktemp("combined"), {}
    steps = {"every_n_train_steps": 1, "save_top_k": -1, "filename": "{step}"}
    for strategy in ("ours", "ddp"):
        runs[strategy] = _fit(root / strategy, strategy, {"loaders": 2}, max_steps=MAX_STEPS, checkpoint=steps)
    for strategy, step in (("ours", 13), ("ours", 17), ("ddp", 13)):
        ckpt = str(root / strategy / f"step={step}.ckpt")
        runs[strategy, step] = _fit(root / f"{strategy}{step}", strategy, {"loaders": 2}, ckpt, max_steps=30)
    return runs


def test_several_training_loaders_resume_mid_epoch_each_at_its_position(combined):
    """A dict of two training loaders resumed at step 13: ddp resumes (no error, as before ours refused); ours
    resumes each loader at its saved position: the uninterrupted run's weights, no warning."""
    assert combined["ddp", 13]["global_step"] == combined["ours", 13]["global_step"] == MAX_STEPS
    _assert_same_weights(combined["ours", 13], combined["ours"])
    assert not any("not exactly" in w or "not resumable" in w for w in combined["ours", 13]["warnings"])


def test_a_loader_that_had_cycled_restarts_its_data_with_a_warning(combined):
    """At step 17 the 5-batch loader had read all its data and cycled: it starts again, and ours warns."""
    assert combined["ours", 17]["global_step"] == MAX_STEPS
    assert any("not exactly the uninterrupted run's" in w for w in combined["ours", 17]["warnings"])


@pytest.mark.slow
def test_with_loader_workers_a_resumed_epoch_saves_its_position_again_exactly(tmp_path):
    """num_workers=1 (the workers draw the sampler before Lightning's on_train_start): resumed at step 13, the
    checkpoint of step 15 holds 5 of the epoch's 10 batches consumed (not 3 + 5), and no 'not resumable' warning."""
    steps = {"every_n_train_steps": 1, "save_top_k": -1, "filename": "{step}"}
    _fit(tmp_path / "full", "ours", {"workers": 1}, max_steps=STOP, checkpoint=steps)
    resumed = _fit(
        tmp_path / "resumed",
        "ours",
        {"workers": 1},
        str(tmp_path / "full" / f"step={STOP}.ckpt"),
        max_steps=15,
        checkpoint=steps,
    )
    assert not any("not resumable" in w for w in resumed["warnings"])
    (position,) = torch.load(tmp_path / "resumed" / "step=15.ckpt", weights_only=True)[CHECKPOINT_KEY]["loaders"]
    assert len(remaining_positions(N, position["layers"])) == N - 5 * BATCH
