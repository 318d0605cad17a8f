"""Every use of Lightning's private (underscore) API, in one place.

Lightning does not promise these names across releases. ``tests/test_lightning_private.py`` checks each
one against the installed Lightning, so an upgrade that moves or changes one fails loudly there instead of
deep inside a training run. Tested with Lightning 2.6.
"""

from __future__ import annotations

import inspect
import sys
from typing import TYPE_CHECKING, Any

from lightning.fabric.utilities.imports import _IS_INTERACTIVE
from lightning.pytorch.overrides.distributed import prepare_for_backward
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.strategies.strategy import _ForwardRedirection
from lightning.pytorch.utilities.data import _update_dataloader

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, Sampler

__all__ = [
    "ForwardRedirection",
    "MultiProcessingLauncher",
    "SubprocessScriptLauncher",
    "is_interactive",
    "prepare_for_backward",
    "set_lightning_sampler_injection",
    "shift_epoch_batch_progress",
    "update_dataloader",
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


def set_lightning_sampler_injection(trainer: pl.Trainer, enabled: bool, force: bool = False) -> bool:
    """Turn Lightning's own ``DistributedSampler`` injection on or off for ``trainer``.

    The strategy injects its sampler itself, so Lightning's must be off or the loader would be sharded
    twice. The user's ``Trainer(use_distributed_sampler=...)`` value is remembered on first call.

    Args:
        trainer: the trainer.
        enabled: True restores the user's setting, False disables Lightning's injection.
        force: with ``enabled=True``, turn Lightning's injection on whatever the user's setting (used for
            predict, where Lightning's ``UnrepeatedDistributedSamplerWrapper`` keeps prediction indices).

    Returns:
        The user's original ``use_distributed_sampler`` value.
    """
    connector: Any = trainer._accelerator_connector
    if not hasattr(connector, _USER_SAMPLER_FLAG):
        setattr(connector, _USER_SAMPLER_FLAG, connector.use_distributed_sampler)
    user_value = bool(getattr(connector, _USER_SAMPLER_FLAG))
    connector.use_distributed_sampler = (user_value or force) if enabled else False
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
