"""Guards every private Lightning name we use: a Lightning upgrade that changes one fails here, loudly."""

from __future__ import annotations

import lightning
import pytest
import torch
from lightning.pytorch import Trainer
from torch.utils.data import DataLoader, TensorDataset

from ddp_strategy import _lightning_private as _pl


def test_tested_lightning_minor():
    """We test Lightning 2.6; setup.cfg pins >=2.6,<2.7 because of the names below."""
    assert lightning.__version__.startswith("2.6.")


def test_launchers_keep_their_signatures():
    """The launchers we construct take the arguments we pass."""
    assert _pl.signature_of(_pl.SubprocessScriptLauncher) == ["cluster_environment", "num_processes", "num_nodes"]
    assert _pl.signature_of(_pl.MultiProcessingLauncher) == ["strategy", "start_method"]


def test_forward_redirection_hooks_exist():
    """Our DDP forward redirection overrides these two hooks of Lightning's base class."""
    for hook in ("on_after_inner_forward", "on_after_outer_forward", "__call__"):
        assert callable(getattr(_pl.ForwardRedirection, hook))
    assert _pl.signature_of(_pl.prepare_for_backward) == ["model", "output"]


def test_update_dataloader_replaces_the_sampler():
    """Lightning's loader re-instantiation still keeps batch_size and takes our sampler."""
    loader = DataLoader(TensorDataset(torch.arange(6)), batch_size=3)
    sampler = list(reversed(range(6)))
    new = _pl.update_dataloader(loader, sampler)
    assert new.batch_size == 3 and [b[0].tolist() for b in new] == [[5, 4, 3], [2, 1, 0]]


def test_sampler_injection_flag_lives_on_the_accelerator_connector():
    """Turning Lightning's own sampler injection off and back on restores the user's value."""
    trainer = Trainer(accelerator="cpu", devices=1, use_distributed_sampler=True, logger=False)
    assert _pl.set_lightning_sampler_injection(trainer, enabled=False) is True
    assert trainer._accelerator_connector.use_distributed_sampler is False
    _pl.set_lightning_sampler_injection(trainer, enabled=True)
    assert trainer._accelerator_connector.use_distributed_sampler is True


def test_is_interactive_needs_a_running_ipython_not_just_an_import(monkeypatch):
    """pytest is not interactive; importing ipykernel is not either; a running IPython shell is."""
    import sys
    import types

    assert _pl.is_interactive() is False
    monkeypatch.setitem(sys.modules, "ipykernel", types.ModuleType("ipykernel"))
    fake = types.ModuleType("IPython")
    fake.get_ipython = lambda: None
    monkeypatch.setitem(sys.modules, "IPython", fake)
    assert _pl.is_interactive() is False
    fake.get_ipython = lambda: object()
    assert _pl.is_interactive() is True


def test_sampler_injection_keeps_the_users_false():
    """Enabling Lightning's injection (predict) restores the user's use_distributed_sampler=False, never forces True."""
    trainer = Trainer(accelerator="cpu", devices=1, use_distributed_sampler=False, logger=False)
    assert _pl.set_lightning_sampler_injection(trainer, enabled=True) is False
    assert trainer._accelerator_connector.use_distributed_sampler is False


def test_update_dataloader_batch_sampler_keeps_subclass_arguments():
    """A DataLoader subclass with its own __init__ argument is re-created around a given batch sampler: the
    subclass, its argument, num_workers and collate_fn stay; Lightning's private resolution helpers still exist."""
    from lightning.pytorch.utilities import data as pl_data

    class Tagged(DataLoader):
        def __init__(self, dataset, tag, **kwargs):
            super().__init__(dataset, **kwargs)
            self.tag = tag

    class Odd(torch.utils.data.Sampler):
        def __iter__(self):
            return iter([[1], [3, 5]])

        def __len__(self):
            return 2

    def collate(items):
        return torch.stack([t[0] for t in items]) * 10

    loader = Tagged(TensorDataset(torch.arange(6)), tag="x", batch_sampler=Odd(), collate_fn=collate)
    new = _pl.update_dataloader_batch_sampler(loader, [[0, 2], [4]])
    assert type(new) is Tagged and new.tag == "x" and new.collate_fn is collate
    assert [b.tolist() for b in new] == [[0, 20], [40]]
    assert loader.batch_sampler.__class__ is Odd  # the user's loader is untouched
    for name in ("_get_dataloader_init_args_and_kwargs", "_reinstantiate_wrapped_cls"):
        assert callable(getattr(pl_data, name))


def test_compiled_models_are_accepted_for_our_strategy_only():
    """Lightning's trainer module calls _verify_strategy_supports_compile(model, strategy) in fit/validate/test/
    predict; our replacement accepts MyDDPStrategy and still refuses a compiled model on other strategies."""
    import inspect

    from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy
    from lightning.pytorch.trainer import trainer as trainer_module
    from lightning.pytorch.utilities import compile as pl_compile

    from ddp_strategy import DigitsClassifier, MyDDPStrategy

    assert inspect.signature(pl_compile._verify_strategy_supports_compile).parameters.keys() == {"model", "strategy"}
    for method in (Trainer.fit, Trainer.validate, Trainer.test, Trainer.predict):
        assert "_verify_strategy_supports_compile" in method.__code__.co_names
    check = trainer_module._verify_strategy_supports_compile
    assert MyDDPStrategy in check._ddp_strategy_accepts
    model = DigitsClassifier()
    model._compiler_ctx = {"compiler": "dynamo"}
    check(model, MyDDPStrategy())
    check(model, SingleDeviceStrategy("cpu"))
    assert not issubclass(MyDDPStrategy, DDPStrategy)  # accepted by the replacement, not by Lightning's list
    with pytest.raises(RuntimeError, match="Using a compiled model is incompatible with the current strategy"):
        check(model, object())  # any strategy outside Lightning's list is still refused
    _pl.allow_compiled_models(MyDDPStrategy)  # idempotent
    assert trainer_module._verify_strategy_supports_compile is check


def test_epoch_batch_progress_counters_shift_together():
    """The epoch loop's batch progress has current/total trackers with the four counters we shift."""
    trainer = Trainer(accelerator="cpu", devices=1, logger=False)
    progress = trainer.fit_loop.epoch_loop.batch_progress
    progress.current.ready = progress.total.ready = 5
    _pl.shift_epoch_batch_progress(trainer, -2)
    assert progress.current.ready == progress.total.ready == 3
    assert progress.current.completed == progress.total.completed == -2
    assert {"ready", "started", "processed", "completed"} <= set(vars(progress.current))


def test_not_resumable_warning_text_is_still_lightnings():
    """The strategy silences Lightning's 'dataloader is not resumable' warning by its text; the text must match."""
    import inspect

    from lightning.pytorch.loops import training_epoch_loop

    from ddp_strategy.sampler import LIGHTNING_NOT_RESUMABLE_WARNING

    assert LIGHTNING_NOT_RESUMABLE_WARNING in inspect.getsource(training_epoch_loop)


def test_base_class_attributes_the_strategy_sets_or_reads():
    """MyDDPStrategy uses four underscore attributes of Lightning's Strategy/ParallelStrategy, as Lightning's own
    DDPStrategy does: _launcher, _checkpoint_io, _layer_sync (filled by Trainer(sync_batchnorm=True)) and
    _forward_redirection (routes training_step through DDP's forward)."""
    from lightning.pytorch.strategies import ParallelStrategy
    from lightning.pytorch.strategies.strategy import _ForwardRedirection

    from ddp_strategy import MyDDPStrategy

    s = MyDDPStrategy()
    for name in ("_launcher", "_checkpoint_io", "_layer_sync", "_forward_redirection"):
        assert name in vars(s), f"Lightning's Strategy no longer sets {name}"
    assert isinstance(s._forward_redirection, _ForwardRedirection)
    assert callable(getattr(ParallelStrategy, "_configure_launcher", None))
    trainer = Trainer(accelerator="cpu", devices=2, strategy=MyDDPStrategy(start_method="spawn"), sync_batchnorm=True,
                      logger=False)
    assert type(trainer.strategy._layer_sync).__name__ == "TorchSyncBatchNorm"
    assert trainer.strategy._launcher is trainer.strategy.launcher


def test_multiprocessing_launcher_worker_signature():
    """launching.CheckedMultiProcessingLauncher overrides Lightning's private _wrapping_function (to run the
    strategy's on_exception inside each rank): its leading parameters must stay (process_idx, trainer, function)."""
    params = _pl.signature_of(_pl.MultiProcessingLauncher._wrapping_function)
    assert params[:4] == ["self", "process_idx", "trainer", "function"]
    assert params[4:] == ["args", "kwargs", "return_queue", "global_states"]
