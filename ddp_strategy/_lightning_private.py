"""Every use of Lightning's private (underscore) API, in one place.

Lightning does not promise these names across releases. ``tests/test_lightning_private.py`` checks each
one against the installed Lightning, so an upgrade that moves or changes one fails loudly there instead of
deep inside a training run. Tested with Lightning 2.6.
"""

from __future__ import annotations

import copy
import inspect
import sys
from typing import TYPE_CHECKING, Any

from lightning.fabric.utilities.imports import _IS_INTERACTIVE
from lightning.pytorch.overrides.distributed import prepare_for_backward
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.strategies.strategy import _ForwardRedirection
from lightning.pytorch.trainer import trainer as _trainer_module
from lightning.pytorch.utilities.data import (
    _get_dataloader_init_args_and_kwargs,
    _reinstantiate_wrapped_cls,
    _update_dataloader,
)
from torch.utils.data import BatchSampler, SequentialSampler

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, Sampler

__all__ = [
    "ForwardRedirection",
    "allow_compiled_models",
    "MultiProcessingLauncher",
    "SubprocessScriptLauncher",
    "is_interactive",
    "prepare_for_backward",
    "set_lightning_sampler_injection",
    "shift_epoch_batch_progress",
    "update_dataloader",
    "update_dataloader_batch_sampler",
]

#: Lightning's launcher that re-runs the user's script once per extra local rank (``start_method="popen"``).
SubprocessScriptLauncher = _SubprocessScriptLauncher
#: Lightning's launcher for ``spawn``, ``fork`` and ``forkserver`` (``torch.multiprocessing``).
MultiProcessingLauncher = _MultiProcessingLauncher
#: Base class that routes ``training_step`` and friends through the DDP wrapper's ``forward``.
ForwardRedirection = _ForwardRedirection

_USER_SAMPLER_FLAG = "_ddp_strategy_user_use_distributed_sampler"


def is_interactive() -> bool:
    """Whether Python runs interactively: a REPL, ``python -i``, or an IPython shell or Jupyter kernel.

    Merely importing a notebook client (which imports ``ipykernel``) does not count: an IPython shell must
    be running (``IPython.get_ipython()`` is not None).
    """
    if _IS_INTERACTIVE:
        return True
    ipython = sys.modules.get("IPython")
    return ipython is not None and getattr(ipython, "get_ipython", lambda: None)() is not None


def update_dataloader(dataloader: DataLoader, sampler: Sampler) -> DataLoader:
    """Re-create ``dataloader`` with ``sampler``, keeping its other arguments (Lightning's logic)."""
    return _update_dataloader(dataloader, sampler)


def update_dataloader_batch_sampler(dataloader: DataLoader, batch_sampler: Any) -> DataLoader:
    """Re-create ``dataloader`` (a ``DataLoader`` or any subclass) around ``batch_sampler``, keeping the rest.

    Lightning's re-instantiation (``_get_dataloader_init_args_and_kwargs``: the ``__init__`` arguments it
    captured when a ``*_dataloader`` hook built the loader, else the loader's attributes) gives the other
    arguments, subclass arguments included. Lightning itself would re-create the user's *batch sampler* with
    a new sampler, which needs that batch sampler's constructor arguments; here the given batch sampler is
    used as it is, so any batch sampler works. The loader's own batch sampler is hidden from Lightning's
    resolution (on a shallow copy) so it is not re-created.

    Args:
        dataloader: the user's loader (not modified).
        batch_sampler: yields lists of indices; replaces the loader's ``batch_sampler``.

    Returns:
        A new loader of the same class with ``batch_sampler`` (``batch_size=1``, ``shuffle=False``,
        ``sampler=None`` and ``drop_last=False``, as ``DataLoader`` requires with a batch sampler).

    Raises:
        MisconfigurationException: Lightning cannot find the subclass's ``__init__`` arguments (its message
            says which are missing).
    """
    placeholder = SequentialSampler(range(0))
    proxy = copy.copy(dataloader)
    object.__setattr__(proxy, "batch_sampler", BatchSampler(placeholder, 1, False))
    args, kwargs = _get_dataloader_init_args_and_kwargs(proxy, placeholder)
    kwargs.update(batch_sampler=batch_sampler, sampler=None, shuffle=False, batch_size=1, drop_last=False)
    return _reinstantiate_wrapped_cls(dataloader, *args, **kwargs)


#: Lightning's check that refuses compiled models on strategies outside its own list.
_LIGHTNING_COMPILE_CHECK = "_verify_strategy_supports_compile"


def allow_compiled_models(strategy_cls: type) -> None:
    """Let ``Trainer.fit/validate/test/predict`` accept a ``torch.compile``'d LightningModule for ``strategy_cls``.

    The Trainer unwraps a compiled model with ``from_compiled`` (the LightningModule's ``forward`` and
    ``*_step`` methods stay compiled) and then refuses it unless the strategy is an instance of
    ``SingleDeviceStrategy``, ``DDPStrategy`` or ``FSDPStrategy`` (a fixed tuple inside
    ``lightning.pytorch.utilities.compile._verify_strategy_supports_compile``). ``strategy_cls`` wraps the
    LightningModule in DDP exactly as ``DDPStrategy`` does, so the check is replaced, in the trainer
    module's namespace only, by one that accepts ``strategy_cls`` and defers to Lightning's for every other
    strategy. Idempotent.

    Args:
        strategy_cls: the strategy class to accept (subclasses too).
    """
    original = getattr(_trainer_module, _LIGHTNING_COMPILE_CHECK)
    accepted = getattr(original, "_ddp_strategy_accepts", ())
    lightning_check = getattr(original, "_ddp_strategy_original", original)
    if strategy_cls in accepted:
        return
    accepted = (*accepted, strategy_cls)

    def verify_strategy_supports_compile(model: Any, strategy: Any) -> None:
        if isinstance(strategy, accepted):
            return
        lightning_check(model, strategy)

    verify_strategy_supports_compile._ddp_strategy_accepts = accepted  # type: ignore[attr-defined]
    verify_strategy_supports_compile._ddp_strategy_original = lightning_check  # type: ignore[attr-defined]
    setattr(_trainer_module, _LIGHTNING_COMPILE_CHECK, verify_strategy_supports_compile)


def set_lightning_sampler_injection(trainer: pl.Trainer, enabled: bool) -> bool:
    """Turn Lightning's own ``DistributedSampler`` injection on or off for ``trainer``.

    The strategy injects its sampler itself for fit, validate and test, so Lightning's must be off there or
    the loader would be sharded twice. For predict it is left to Lightning (its
    ``UnrepeatedDistributedSamplerWrapper`` keeps prediction batch indices). The user's
    ``Trainer(use_distributed_sampler=...)`` value is remembered on first call.

    Args:
        trainer: the trainer.
        enabled: True restores the user's setting, False disables Lightning's injection.

    Returns:
        The user's original ``use_distributed_sampler`` value.
    """
    connector: Any = trainer._accelerator_connector
    if not hasattr(connector, _USER_SAMPLER_FLAG):
        setattr(connector, _USER_SAMPLER_FLAG, connector.use_distributed_sampler)
    user_value = bool(getattr(connector, _USER_SAMPLER_FLAG))
    connector.use_distributed_sampler = user_value if enabled else False
    return user_value


#: The counters of ``_BatchProgress.current`` / ``.total`` that move together.
_PROGRESS_FIELDS = ("ready", "started", "processed", "completed")


def shift_epoch_batch_progress(trainer: pl.Trainer, delta: int) -> None:
    """Add ``delta`` to every counter of the training epoch loop's batch progress (``current`` and ``total``).

    Lightning restarts a mid-epoch checkpoint by counting the batches its loop believes are done
    (``fit_loop.epoch_loop.batch_progress.current``) and stopping at ``num_training_batches``; it does not
    fast-forward the loader. After an elastic resume the number of batches each new rank has left differs
    from what the old ranks had, so the strategy moves the counters to ``num_training_batches - left``.
    Shifting every field by the same amount keeps Lightning's restart-stage checks (which compare the
    fields) unchanged. Must be called before the epoch loop's ``reset`` (the strategy's ``on_train_start``).

    Args:
        trainer: the trainer, fitting.
        delta: batches to add (may be negative).
    """
    progress: Any = trainer.fit_loop.epoch_loop.batch_progress
    for tracker in (progress.current, progress.total):
        for field in _PROGRESS_FIELDS:
            setattr(tracker, field, getattr(tracker, field) + delta)


def signature_of(obj: Any) -> list[str]:
    """Parameter names of ``obj`` (used by the test that guards this module)."""
    return list(inspect.signature(obj).parameters)
