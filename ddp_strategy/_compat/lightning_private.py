"""Every use of Lightning's private (underscore) API, for either namespace (Lightning 2.4, 2.5 and 2.6).

``tests/_compat/test_lightning_private.py`` checks each name in every installed namespace, so an upgrade that
moves one fails there, not inside a run. Classes we derive from are per namespace; helpers come from the default.
"""

from __future__ import annotations

import atexit
import copy
import inspect
import os
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING, Any, cast

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
    "ChildProcessObserver": "fabric.strategies.launchers.subprocess_script:_ChildProcessObserver",
    "set_num_threads_if_needed": "fabric.utilities.distributed:_set_num_threads_if_needed",
    "DDPForwardRedirection": "pytorch.strategies.ddp:_DDPForwardRedirection",
    "update_dataloader": "pytorch.utilities.data:_update_dataloader",
    "cloud_load": "fabric.utilities.cloud_io:_load",
    "get_dataloader_init_args_and_kwargs": "pytorch.utilities.data:_get_dataloader_init_args_and_kwargs",
    "reinstantiate_wrapped_cls": "pytorch.utilities.data:_reinstantiate_wrapped_cls",
    "verify_strategy_supports_compile": "pytorch.trainer.trainer:_verify_strategy_supports_compile",
    "BatchNormXd": "pytorch.plugins.layer_sync:_BatchNormXd",
    # Lightning's collectives (fabric/utilities/distributed.py): namespace-neutral, they act on torch.distributed.
    "all_gather_ddp_if_available": "fabric.utilities.distributed:_all_gather_ddp_if_available",
    "gather_all_tensors": "fabric.utilities.distributed:_gather_all_tensors",
    # Lightning's SIGTERM handling; the strategy agrees on a SIGTERM at a step boundary itself (process/boundaries.py).
    "sigterm_notifier": "pytorch.trainer.connectors.signal_connector:_SignalConnector._sigterm_notifier_fn",
    "optimizers_to_device": "fabric.utilities.optimizer:_optimizers_to_device",
}


#: Seconds the popen launching process has, after a rank it launched exited non-zero, to name it and exit by itself
#: before :class:`Supervisor` SIGKILLs it and every rank (Lightning's observer: at its next 5 s poll); and how long,
#: at its exit, it waits for the ranks it launched before SIGKILLing them.
GRACE_S = 30.0


class SubprocessScriptLauncher(_namespace.get(PRIVATE_NAMES["SubprocessScriptLauncher"])):  # type: ignore[misc]
    """Lightning's launcher that re-runs the user's script per extra local rank (``start_method="popen"``), with
    :class:`Supervisor` watching the ranks it starts in place of Lightning's ``_ChildProcessObserver``."""

    def launch(self, function: Any, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        """Lightning's ``launch`` (2.4-2.6, compared by the guard test), starting :class:`Supervisor` as observer."""
        self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        if not self.cluster_environment.creates_processes_externally:
            self._call_children_scripts()
            supervisor = Supervisor(os.getpid(), self.procs)
            supervisor.start()
            atexit.register(supervisor.stop)
        _set_num_threads_if_needed(num_processes=self.num_processes)
        return function(*args, **kwargs)


class Supervisor(_namespace.get(PRIVATE_NAMES["ChildProcessObserver"])):  # type: ignore[misc]
    """The one supervisor of the ranks popen's launching process starts (once per process: later launches find
    ``LOCAL_RANK`` set and start none). Lightning's observer, a daemon thread that polls them every 5 s (its
    ``_sleep_period``), except:

    - when one exited non-zero, it SIGKILLs them and this process only if this process still runs
      :data:`GRACE_S` later (Lightning's does at once, before this rank could name the failed one and its
      error reach the user's ``except``/``finally``); the failure protocol ends the run well before that;
    - :meth:`stop`, at this process's exit (``atexit``), waits up to :data:`GRACE_S` for them, then SIGKILLs and
      reaps those still running (a stalled rank), so that no rank outlives the launching process (Lightning's
      leaves them running).
    """

    def __init__(self, main_pid: int, child_processes: list[Any]) -> None:
        super().__init__(main_pid, child_processes)
        self._stopping = threading.Event()

    def run(self) -> None:
        """Lightning's poll, every 5 s until the ranks exited or one failed, woken at once by :meth:`stop`."""
        while not self._stopping.wait(self._sleep_period) and not self._run():
            pass

    def _terminate_all(self) -> None:
        if not self._stopping.wait(GRACE_S):  # stop() reaps the ranks itself; this process is exiting anyway
            super()._terminate_all()

    def stop(self) -> None:
        """Wait up to :data:`GRACE_S` for the ranks to exit, SIGKILL those left, reap them all, end the started thread
        (this process's exit; the thread is gone when it returns, as a test suite's leaked-thread check expects)."""
        deadline = time.monotonic() + GRACE_S
        while any(proc.poll() is None for proc in self._child_processes) and time.monotonic() < deadline:
            time.sleep(0.1)
        for local_rank, proc in enumerate(self._child_processes, start=1):
            if proc.poll() is None:
                _namespace.rank_zero_warn(
                    f"local rank {local_rank} (pid {proc.pid}) is still running {GRACE_S:.0f} s after the"
                    " launching process: SIGKILL"
                )
                proc.kill()
                proc.wait()
        self._stopping.set()
        self.join()


#: Lightning's launcher for ``spawn``, ``fork`` and ``forkserver`` (``torch.multiprocessing``): a base class
#: for the namespace of the strategy it is given.
MultiProcessingLauncher: type = _namespace.get(PRIVATE_NAMES["MultiProcessingLauncher"])
#: Base class that routes ``training_step`` and friends through the DDP wrapper's ``forward``, turning DDP's
#: gradient sync off inside it under manual optimization (plain Python, namespace-neutral).
DDPForwardRedirection: type = _namespace.get(PRIVATE_NAMES["DDPForwardRedirection"])
prepare_for_backward = _namespace.get(PRIVATE_NAMES["prepare_for_backward"])
_set_num_threads_if_needed = _namespace.get(PRIVATE_NAMES["set_num_threads_if_needed"])
#: The BatchNorm Lightning's ``TorchSyncBatchNorm.revert`` gives back: any input rank (a torch ``_BatchNorm``).
BatchNormXd: type = _namespace.get(PRIVATE_NAMES["BatchNormXd"])
#: ``update_dataloader(dataloader, sampler)``: re-create ``dataloader`` with ``sampler``, keeping its other arguments.
update_dataloader = _namespace.get(PRIVATE_NAMES["update_dataloader"])


def call_with_weights_only(method: Any, *args: Any, weights_only: bool | None, **kwargs: Any) -> Any:
    """Call ``method`` (e.g. ``Strategy.load_checkpoint``), passing ``weights_only`` only where it takes it.

    Lightning 2.4 and 2.5 have no ``Trainer.fit(weights_only=...)`` and their ``Strategy.load_checkpoint``
    takes only the path: the checkpoint IO's own default decides (True for :class:`DDPCheckpointIO`).
    """
    if "weights_only" in inspect.signature(method).parameters:
        return method(*args, weights_only=weights_only, **kwargs)
    return method(*args, **kwargs)


def load_checkpoint_with_weights_only(path: Any, map_location: Any, weights_only: bool) -> Any:
    """What Lightning 2.6's ``TorchCheckpointIO.load_checkpoint`` does, also for 2.4 and 2.5 (whose method does not
    take ``weights_only``): an existence check, then Fabric's ``cloud_io._load``, which takes ``weights_only``.

    Raises:
        FileNotFoundError: no file at ``path``.
    """
    if not _namespace.get_filesystem(path).exists(path):
        raise FileNotFoundError(f"Checkpoint file not found: {path}")
    return _namespace.get(PRIVATE_NAMES["cloud_load"])(path, map_location=map_location, weights_only=weights_only)


_USER_SAMPLER_FLAG = "_ddp_strategy_user_use_distributed_sampler"


def is_interactive() -> bool:
    """Whether Python runs interactively: a REPL, ``python -i``, or a running IPython shell or Jupyter kernel
    (``IPython.get_ipython()`` is not None; merely importing ``ipykernel`` does not count)."""
    ipython = sys.modules.get("IPython")
    return _namespace.get(PRIVATE_NAMES["is_interactive"]) or (
        ipython is not None and ipython.get_ipython() is not None
    )


def update_dataloader_batch_sampler(dataloader: DataLoader, batch_sampler: Any) -> DataLoader:
    """A new loader of ``dataloader``'s class (not modified) around ``batch_sampler``, the rest kept.

    Lightning's ``_get_dataloader_init_args_and_kwargs`` gives the other arguments (subclass ones included); the
    loader's own batch sampler is hidden from it (on a shallow copy) so it is used as given, not re-created.

    Raises:
        MisconfigurationException: Lightning cannot find the subclass's ``__init__`` arguments.
    """
    placeholder = SequentialSampler(range(0))
    proxy = copy.copy(dataloader)
    object.__setattr__(proxy, "batch_sampler", BatchSampler(placeholder, 1, False))
    args, kwargs = _namespace.get(PRIVATE_NAMES["get_dataloader_init_args_and_kwargs"])(proxy, placeholder)
    kwargs.update(batch_sampler=batch_sampler, sampler=None, shuffle=False, batch_size=1, drop_last=False)
    return _namespace.get(PRIVATE_NAMES["reinstantiate_wrapped_cls"])(dataloader, *args, **kwargs)


def allow_compiled_models(strategy_cls: type) -> None:
    """Let the Trainer accept a ``torch.compile``'d LightningModule for ``strategy_cls`` (and its subclasses).

    Lightning refuses one unless the strategy is in a fixed tuple (``_verify_strategy_supports_compile``);
    ``strategy_cls`` wraps in DDP as ``DDPStrategy`` does, so the trainer module's check is replaced, once per
    process, by one that accepts it and defers to the check it replaced otherwise.
    """
    module_path, _, check_name = PRIVATE_NAMES["verify_strategy_supports_compile"].partition(":")
    trainer_module = _namespace.get(module_path)
    lightning_check = getattr(trainer_module, check_name)

    def verify_strategy_supports_compile(model: Any, strategy: Any) -> None:
        if not isinstance(strategy, strategy_cls):
            lightning_check(model, strategy)

    setattr(trainer_module, check_name, verify_strategy_supports_compile)


def set_lightning_sampler_injection(trainer: pl.Trainer, enabled: bool) -> bool:
    """Restore (``enabled``) or turn off Lightning's own ``DistributedSampler`` injection for ``trainer``.

    Off where the strategy injects its own (fit, validate, test), so no loader is sharded twice. Returns the
    user's ``Trainer(use_distributed_sampler=...)``, remembered on the first call.
    """
    connector: Any = trainer._accelerator_connector
    user_value = bool(vars(connector).setdefault(_USER_SAMPLER_FLAG, connector.use_distributed_sampler))
    connector.use_distributed_sampler = user_value if enabled else False
    return user_value


def shift_epoch_batch_progress(trainer: pl.Trainer, delta: int) -> None:
    """Add ``delta`` (batches, may be negative) to every counter of the epoch loop's batch progress.

    Lightning resumes mid-epoch by counting the batches its loop believes done; after an elastic resume the
    strategy moves them to ``num_training_batches - left``. Shifting every field alike keeps Lightning's
    restart-stage checks unchanged. Call before the epoch loop's ``reset`` (``on_train_start``).
    """
    progress: Any = trainer.fit_loop.epoch_loop.batch_progress
    for tracker in (progress.current, progress.total):
        for field in ("ready", "started", "processed", "completed"):
            setattr(tracker, field, getattr(tracker, field) + delta)


def resumed_batch_count(trainer: pl.Trainer) -> int:
    """The batches of the current epoch Lightning's loop will count as done on restart (read at ``on_train_start``).

    Every version resumes at ``completed``; for a checkpoint saved in ``on_train_batch_end`` (``completed =
    processed - 1``) Lightning 2.5+ count that batch too (``update_restart_stage``'s test), 2.4 does not.
    """
    epoch_loop: Any = trainer.fit_loop.epoch_loop
    total = epoch_loop.batch_progress.total
    on_batch_end = total.started == total.ready == total.processed and total.completed == total.processed - 1
    counts_it = hasattr(epoch_loop, "restarted_on_train_batch_end") and on_batch_end
    return epoch_loop.batch_progress.current.completed + int(counts_it)


#: ``(tensor, group=None, sync_grads=False)``: ``(W, *shape)`` of equal shapes; what ``ParallelStrategy.all_gather``
#: calls.
all_gather_ddp_if_available = _namespace.get(PRIVATE_NAMES["all_gather_ddp_if_available"])
#: ``(tensor, group=None)``: every rank's tensor, shapes may differ in every dimension (padded, gathered, trimmed).
gather_all_tensors = _namespace.get(PRIVATE_NAMES["gather_all_tensors"])
#: ``(optimizers, device)``: every tensor in each optimizer's state moved to ``device``; what Lightning's
#: ``DDPStrategy.setup`` calls after setting the optimizers up.
optimizers_to_device = _namespace.get(PRIVATE_NAMES["optimizers_to_device"])

#: Lightning's ``Trainer.save_checkpoint`` calls ``strategy.save_checkpoint`` on every rank, then
#: ``strategy.barrier(SAVE_BARRIER)`` (Lightning 2.4-2.6): in a step some ranks only shadow, announced as a save.
SAVE_BARRIER = "Trainer.save_checkpoint"


def take_over_sigterm(trainer: pl.Trainer, note: Any) -> bool:
    """Put ``note(signum, frame)`` in place of Lightning's SIGTERM notifier (it stops the signalled rank alone and,
    2.5+, broadcasts) in this run's SIGTERM handler, the user's earlier handler kept; turn off 2.5+'s broadcast
    before every batch (``_broadcast_sigterm_tensor``, then ``.item()``: a host-device sync per step under NCCL).
    False, nothing changed, where the SIGTERM handler is not Lightning's ``_HandlersCompose``. Main thread."""
    handlers = getattr(signal.getsignal(signal.SIGTERM), "signal_handlers", None)
    notifier = trainer._signal_connector._sigterm_notifier_fn
    if not isinstance(handlers, list) or notifier not in handlers:
        return False
    handlers[handlers.index(notifier)] = note
    if hasattr(trainer.fit_loop.epoch_loop, "_broadcast_sigterm_tensor"):  # Lightning 2.5+
        cast(Any, trainer.fit_loop.epoch_loop)._broadcast_sigterm_tensor = lambda: None  # this loop only
    return True


def hook_of(frame: Any) -> str | None:
    """``<class>.<hook>`` of the hook (a ``Callback``, ``LightningModule`` or ``Strategy`` method, the class the
    object's own) that one of Lightning's ``trainer/call.py`` ``_call_*_hook`` functions calls in ``frame`` (a
    traceback's frame: its locals ``hook_name`` and ``fn``), e.g. ``"ModelCheckpoint.on_train_epoch_end"``; None for
    any other frame."""
    hook = frame.f_code.co_filename.endswith(os.path.join("trainer", "call.py")) and frame.f_locals.get("hook_name")
    owner = getattr(frame.f_locals.get("fn"), "__self__", None)  # the callback, module or strategy called
    return f"{type(owner).__name__}.{hook}" if isinstance(hook, str) and owner is not None else None


def set_received_sigterm(trainer: pl.Trainer, value: bool) -> None:
    """Set ``trainer.received_sigterm``: Lightning raises ``SIGTERMException`` at the step's (epoch's) end if set."""
    trainer._signal_connector.received_sigterm = value


def training_state(trainer: pl.Trainer) -> dict[str, Any]:
    """What a fit's ranks must hold alike besides the module (read on the rank that trained longest, after uneven
    inputs), from :func:`_state_holders`: ``"states"``, their state dicts, and ``"private"``, their private
    attributes' values."""
    stateful, private = _state_holders(trainer)
    return {
        "states": [holder.state_dict() for holder in stateful],
        "private": [getattr(holder, name) for holder, name in private],
    }


def load_training_state(trainer: pl.Trainer, state: dict[str, Any]) -> None:
    """Load what :func:`training_state` read on another rank."""
    stateful, private = _state_holders(trainer)
    for holder, holder_state in zip(stateful, state["states"], strict=True):
        holder.load_state_dict(holder_state)
    for (holder, name), value in zip(private, state["private"], strict=True):
        setattr(holder, name, value)


def _state_holders(trainer: pl.Trainer) -> tuple[list[Any], list[tuple[Any, str]]]:
    """The objects whose state dicts the ranks must hold alike, in load order (an optimizer before its scheduler):
    optimizers, LR schedulers, the precision plugin, the optimizer-step counters behind ``trainer.global_step``, each
    ``ModelCheckpoint``, each weight-averaging callback's averaged model (``EMAWeightAveraging``, Lightning >= 2.5);
    and the private ``(object, attribute)`` pairs besides: the logging step, each ``ModelCheckpoint``'s last saved
    step, which decides its next save (and so its ``barrier``), and each weight-averaging callback's last update step
    and epoch, which a rank out of data in a tail step did not update."""
    loop: Any = trainer.fit_loop.epoch_loop
    averaging = [  # the fit's WeightAveraging callbacks (by their private state, in either namespace)
        c
        for c in trainer.callbacks
        if getattr(c, "_average_model", None) is not None and hasattr(c, "_latest_update_step")
    ]
    stateful = [
        *trainer.optimizers,
        *(config.scheduler for config in trainer.lr_scheduler_configs),
        trainer.precision_plugin,
        loop.automatic_optimization.optim_progress,
        loop.manual_optimization.optim_step_progress,
        *trainer.checkpoint_callbacks,
        *(c._average_model for c in averaging),
    ]
    private = [
        (loop, "_batches_that_stepped"),
        *((c, "_last_global_step_saved") for c in trainer.checkpoint_callbacks),
        *((c, name) for c in averaging for name in ("_latest_update_step", "_latest_update_epoch")),
    ]
    return stateful, private


def cut_epoch(trainer: pl.Trainer, batches: int) -> None:
    """End the current training epoch after ``batches`` batches, as ``limit_train_batches=batches`` would: the
    loop's count (``fit_loop.max_batches``) and a fractional ``val_check_interval``'s validation batch, computed
    as ``_FitLoop.setup_data`` does. Call at the epoch's start."""
    trainer.fit_loop.max_batches = batches
    if isinstance(trainer.val_check_interval, float) and trainer.val_check_batch is not None:
        trainer.val_check_batch = max(1, int(batches * trainer.val_check_interval))


def out_of_batches(trainer: pl.Trainer) -> bool:
    """Whether the running loop's data fetcher (``Trainer._active_loop._data_fetcher``) has given its last batch:
    ``_DataFetcher.done``, set once its iterator stops, also where a loader's ``__len__`` is a wrong hint (there
    ``batch_progress.is_last_batch`` is never set). False without a running loop."""
    fetcher = getattr(trainer._active_loop, "_data_fetcher", None)
    return fetcher is not None and fetcher.done
