"""Every use of Lightning's private (underscore) API, in one place, for either namespace.

Lightning does not promise these names across releases. ``tests/_compat/test_lightning_private.py`` checks each
one against the installed Lightning, in each namespace installed (``lightning.pytorch`` and
``pytorch_lightning``), so an upgrade that moves or changes one fails loudly there instead of deep inside a
training run. Tested with Lightning 2.4, 2.5 and 2.6 (the names and signatures used here are the same in
all three). Classes we derive from or construct are per namespace (see :mod:`ddp_strategy._compat.namespace`);
the namespace-neutral helpers come from the default namespace.
"""

from __future__ import annotations

import copy
import inspect
import sys
from typing import TYPE_CHECKING, Any

from torch.utils.data import BatchSampler, SequentialSampler

from ddp_strategy._compat import namespace as _namespace

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

#: Every private (or internal) Lightning name used, by path (see ``_namespace.Namespace.get``); the guard
#: tests resolve each in every installed namespace.
PRIVATE_NAMES: dict[str, str] = {
    "is_interactive": "fabric.utilities.imports:_IS_INTERACTIVE",
    "prepare_for_backward": "pytorch.overrides.distributed:prepare_for_backward",
    "MultiProcessingLauncher": "pytorch.strategies.launchers.multiprocessing:_MultiProcessingLauncher",
    "SubprocessScriptLauncher": "pytorch.strategies.launchers.subprocess_script:_SubprocessScriptLauncher",
    "ForwardRedirection": "pytorch.strategies.strategy:_ForwardRedirection",
    "update_dataloader": "pytorch.utilities.data:_update_dataloader",
    "given_hyperparameters": "pytorch.core.mixins.hparams_mixin:_given_hyperparameters",
    "collect_init_args": "pytorch.utilities.parsing:collect_init_args",
    "save_hyperparameters": "pytorch.utilities.parsing:save_hyperparameters",
    "cloud_load": "fabric.utilities.cloud_io:_load",
    "get_dataloader_init_args_and_kwargs": "pytorch.utilities.data:_get_dataloader_init_args_and_kwargs",
    "reinstantiate_wrapped_cls": "pytorch.utilities.data:_reinstantiate_wrapped_cls",
    "verify_strategy_supports_compile": "pytorch.trainer.trainer:_verify_strategy_supports_compile",
}

_default = _namespace.default


class SubprocessScriptLauncher(_namespace.lightning_base(PRIVATE_NAMES["SubprocessScriptLauncher"])):  # type: ignore[misc]
    """Lightning's launcher that re-runs the user's script once per extra local rank (``start_method="popen"``).

    Built for the namespace of the cluster environment it is given (the Trainer's).
    """


#: Lightning's launcher for ``spawn``, ``fork`` and ``forkserver`` (``torch.multiprocessing``): a base class
#: for the namespace of the strategy it is given.
MultiProcessingLauncher: type = _namespace.lightning_base(PRIVATE_NAMES["MultiProcessingLauncher"])
#: Base class that routes ``training_step`` and friends through the DDP wrapper's ``forward`` (plain Python,
#: namespace-neutral).
ForwardRedirection: type = _default.get(PRIVATE_NAMES["ForwardRedirection"])
prepare_for_backward = _default.get(PRIVATE_NAMES["prepare_for_backward"])
_IS_INTERACTIVE: bool = _default.get(PRIVATE_NAMES["is_interactive"])
#: ``update_dataloader(dataloader, sampler)``: re-create ``dataloader`` with ``sampler``, keeping its other arguments.
update_dataloader = _default.get(PRIVATE_NAMES["update_dataloader"])
_get_dataloader_init_args_and_kwargs = _default.get(PRIVATE_NAMES["get_dataloader_init_args_and_kwargs"])
_reinstantiate_wrapped_cls = _default.get(PRIVATE_NAMES["reinstantiate_wrapped_cls"])


def takes_weights_only(method: Any) -> bool:
    """Whether a Lightning checkpoint-loading method takes ``weights_only`` (Lightning 2.6; 2.4 and 2.5 do not)."""
    return "weights_only" in inspect.signature(method).parameters


def call_with_weights_only(method: Any, *args: Any, weights_only: bool | None, **kwargs: Any) -> Any:
    """Call ``method`` (e.g. ``Strategy.load_checkpoint``), passing ``weights_only`` only where it takes it.

    Lightning 2.4 and 2.5 have no ``Trainer.fit(weights_only=...)`` and their ``Strategy.load_checkpoint``
    takes only the path: the checkpoint IO's own default decides (True for :class:`DDPCheckpointIO`).
    """
    if takes_weights_only(method):
        return method(*args, weights_only=weights_only, **kwargs)
    return method(*args, **kwargs)


def load_checkpoint_with_weights_only(method: Any, path: Any, map_location: Any, weights_only: bool) -> Any:
    """``TorchCheckpointIO.load_checkpoint`` (``method``) honouring ``weights_only`` in every version.

    Lightning 2.6's takes ``weights_only``; 2.4's and 2.5's do not (they load remote files with
    ``weights_only=False``), so there: the same existence check, then Fabric's ``cloud_io._load``, which does.

    Raises:
        FileNotFoundError: no file at ``path``.
    """
    if takes_weights_only(method):
        return method(path, map_location=map_location, weights_only=weights_only)
    fs = _namespace.get_filesystem(path)
    if not fs.exists(path):
        raise FileNotFoundError(f"Checkpoint file not found: {path}")
    return _default.get(PRIVATE_NAMES["cloud_load"])(path, map_location=map_location, weights_only=weights_only)


class SavesPublicInitArgs:
    """Mixed into LightningModule/LightningDataModule flavours: ``save_hyperparameters()`` collects the
    ``__init__`` arguments of our public classes too.

    Lightning collects them from the frames of ``HyperparametersMixin`` subclasses, and a method of our public
    class runs with ``__class__`` the public class, which is not one; the rest is Lightning's own
    ``save_hyperparameters`` (``given_hparams`` from ``collect_init_args``, as its mixin does).
    """

    def save_hyperparameters(self, *args: Any, ignore: Any = None, frame: Any = None, logger: bool = True) -> None:
        """As Lightning's ``HyperparametersMixin.save_hyperparameters``."""
        if frame is None:
            current = inspect.currentframe()
            frame = current.f_back if current is not None else None
        namespace = _namespace.load(type(self)._ddp_namespace)  # type: ignore[attr-defined]
        given = namespace.get(PRIVATE_NAMES["given_hyperparameters"]).get()
        if given is None:
            given = {}
            classes = (namespace.get("pytorch.core.mixins:HyperparametersMixin"), _namespace.Flavoured)
            for local_args in namespace.get(PRIVATE_NAMES["collect_init_args"])(frame, [], classes=classes):
                given.update(local_args)
        self._log_hyperparams = logger
        namespace.get(PRIVATE_NAMES["save_hyperparameters"])(self, *args, ignore=ignore, frame=frame,
                                                              given_hparams=given)


_namespace.MIXINS.append(("pytorch.core.mixins:HyperparametersMixin", SavesPublicInitArgs))

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



def allow_compiled_models(namespace: _namespace.Namespace, strategy_cls: type) -> None:
    """Let ``Trainer.fit/validate/test/predict`` accept a ``torch.compile``'d LightningModule for ``strategy_cls``.

    The Trainer unwraps a compiled model with ``from_compiled`` (the LightningModule's ``forward`` and
    ``*_step`` methods stay compiled) and then refuses it unless the strategy is an instance of
    ``SingleDeviceStrategy``, ``DDPStrategy`` or ``FSDPStrategy`` (a fixed tuple inside
    ``lightning.pytorch.utilities.compile._verify_strategy_supports_compile``). ``strategy_cls`` wraps the
    LightningModule in DDP exactly as ``DDPStrategy`` does, so the check is replaced, in the trainer
    module's namespace only, by one that accepts ``strategy_cls`` and defers to Lightning's for every other
    strategy. Idempotent.

    Args:
        namespace: the Lightning namespace whose trainer module is patched.
        strategy_cls: the strategy class to accept (subclasses and every namespace's flavour too).
    """
    module_path, _, check_name = PRIVATE_NAMES["verify_strategy_supports_compile"].partition(":")
    trainer_module = namespace.get(module_path)
    original = getattr(trainer_module, check_name)
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
    setattr(trainer_module, check_name, verify_strategy_supports_compile)


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


def resumed_batch_count(trainer: pl.Trainer) -> int:
    """The number of batches of the current epoch that Lightning's training loop will count as done on restart.

    Every version resumes at ``completed`` (``reset_on_restart``). A checkpoint saved in
    ``on_train_batch_end`` holds ``completed = processed - 1``; Lightning 2.5+ first count that batch as
    completed (``RestartStage.RESTARTED_ON_TRAIN_BATCH_END``, same test on the ``total`` counters as
    ``_TrainingEpochLoop.update_restart_stage``), 2.4 does not and resumes one batch earlier. Read at
    ``on_train_start``, before the epoch loop's reset.
    """
    epoch_loop: Any = trainer.fit_loop.epoch_loop
    total = epoch_loop.batch_progress.total
    on_batch_end = total.started == total.ready == total.processed and total.completed == total.processed - 1
    counts_it = hasattr(epoch_loop, "restarted_on_train_batch_end") and on_batch_end
    return epoch_loop.batch_progress.current.completed + int(counts_it)


# Lightning's collectives (fabric/utilities/distributed.py): namespace-neutral, they act on torch.distributed.
PRIVATE_NAMES.update({
    "sync_ddp_if_available": "fabric.utilities.distributed:_sync_ddp_if_available",
    "all_gather_ddp_if_available": "fabric.utilities.distributed:_all_gather_ddp_if_available",
    "gather_all_tensors": "fabric.utilities.distributed:_gather_all_tensors",
})
#: ``(tensor, group=None, reduce_op=None)``: all-reduce in place (``"mean"``/``"avg"`` on gloo: sum, then divide);
#: the tensor itself without a process group. What Lightning's ``DDPStrategy.reduce`` calls.
sync_ddp_if_available = _default.get(PRIVATE_NAMES["sync_ddp_if_available"])
#: ``(tensor, group=None, sync_grads=False)``: ``(W, *shape)`` of equal shapes; what ``ParallelStrategy.all_gather``
#: calls.
all_gather_ddp_if_available = _default.get(PRIVATE_NAMES["all_gather_ddp_if_available"])
#: ``(tensor, group=None)``: every rank's tensor, shapes may differ in every dimension (padded, gathered, trimmed).
gather_all_tensors = _default.get(PRIVATE_NAMES["gather_all_tensors"])
