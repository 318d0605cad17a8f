"""``MyDDPStrategy``: synchronous data parallelism for Lightning, in Lightning's hook order.

The strategy only orchestrates: each step has one entry point in its sub-package, 1. process group
(:mod:`ddp_strategy.process`), 2. sampler (:mod:`ddp_strategy.sampling`), 3. DDP wrapping (:mod:`ddp_strategy.sync`),
4. checkpoints (:mod:`ddp_strategy.checkpoint`). Launching is Lightning's (its launchers and cluster environments).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Generator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor
from typing_extensions import override

from ddp_strategy import checkpoint, diagnostics, options, process, sampling, sync
from ddp_strategy._compat import lightning_private as _pl
from ddp_strategy._compat import namespace as _namespace
from ddp_strategy._compat.namespace import SIGTERMException, TrainerFn, rank_zero_info, reset_seed
from ddp_strategy.process import START_METHODS, StartMethod, default_start_method  # noqa: F401 (0.1 had them here)

if TYPE_CHECKING:
    from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
    from lightning.pytorch import Trainer
    from lightning.pytorch.accelerators import Accelerator
    from lightning.pytorch.plugins.precision import Precision
    from lightning.pytorch.strategies import ParallelStrategy
else:  # the flavour for the user's Lightning namespace is built on construction (see ddp_strategy._compat.namespace)
    ParallelStrategy = _namespace.lightning_base("pytorch.strategies:ParallelStrategy")


class MyDDPStrategy(process.RankTopology, checkpoint.DefaultCheckpointIO, ParallelStrategy):
    """Distributed data parallel training: one process per device, gradients all-reduced during backward.

    ``Trainer(accelerator="cpu", devices=2, strategy=MyDDPStrategy())`` starts 2 processes in a gloo process
    group (NCCL on CUDA), shards every loader with a ``DistributedSampler`` re-seeded each epoch (unless
    ``Trainer(use_distributed_sampler=False)``), wraps the LightningModule in ``DistributedDataParallel`` while
    fitting, and writes checkpoints whose keys load into the plain module. The loader's ``batch_size`` is the
    per-device batch size B; a step sees ``B * world_size``. Registered as ``"my_ddp"`` and ``"my_ddp_spawn"``.

    Args:
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin: as for any
            Lightning ``ParallelStrategy``; ``checkpoint_io`` defaults to :class:`~ddp_strategy.DDPCheckpointIO`.
        process_group_backend: ``"gloo"``, ``"nccl"``, ...; default ``None``: ``"nccl"`` on CUDA, else ``"gloo"``.
        timeout: how long a collective waits for the other ranks (seconds or ``timedelta``); default 30 min.
        start_method: ``"popen"`` (re-run the script), ``"spawn"``, ``"fork"`` or ``"forkserver"``; default
            ``None``: ``"fork"`` in Jupyter/REPL, else ``"popen"`` (Lightning's default for ``"ddp"``).
        seed: shuffle seed of the injected samplers; default ``None``: ``seed_everything``'s seed, else 0.
        init_method: ``None``/``"env://"`` (``MASTER_ADDR``/``MASTER_PORT``; a free port on one machine),
            ``"tcp://host:port"`` or ``"file:///shared/file"``.
        store: a ready ``torch.distributed.Store`` (e.g. ``FileStore``); ``fork`` and ``popen`` only.
        allow_cpu_oversubscription: silence the warning for more CPU processes per node than cores.
        monitored_barrier_timeout: each training epoch starts at a ``monitored_barrier`` naming any rank not
            there within this time (seconds or ``timedelta``); default ``None`` = ``timeout``.
        checkpoint_on_sigterm: on SIGTERM all ranks stop at the same step and save a checkpoint: ``True`` to
            ``<default_root_dir>/sigterm.ckpt``, or to a given path; resume with ``fit(ckpt_path=...)``.
        ddp_comm_hook, ddp_comm_state, ddp_comm_wrapper: a DDP communication hook ``hook(state, bucket) ->
            Future`` or ``"allreduce"``, ``"fp16"``, ``"bf16"``, ``"powersgd"`` (every backend, gloo included),
            its state (a ``PowerSGDState``, a process group) and a wrapper (``fp16_compress_wrapper``).
        verify_sync_every_n_steps: every N optimizer steps compare parameter checksums across ranks and raise
            on every rank naming those that differ; default ``None`` = off.
        exact_evaluation: validation/test shards without padding, each sample once, equal batch counts on
            every rank (default True); False shards them as Lightning's ddp does (padded).
        find_unused_parameters, static_graph, gradient_as_bucket_view, bucket_cap_mb, broadcast_buffers: DDP's
            options, named so ``LightningCLI``/YAML can set them; DDP's defaults; ``bucket_cap_mb`` in MiB.
        **ddp_kwargs: any other ``DistributedDataParallel`` option (``process_group``: also a zero-argument
            callable that builds the group after launch).

    Raises:
        ValueError, TypeError: a bad argument, named (:func:`ddp_strategy.options.strategy_options`); at
            ``Trainer(...)``: ``"nccl"`` on CPU or a bad launch variable (``MASTER_PORT``, ``RANK``, ...).
    """

    strategy_name = "my_ddp"

    def __init__(
        self,
        accelerator: Accelerator | None = None, parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None, checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: float | timedelta = process.DEFAULT_TIMEOUT,
        start_method: process.StartMethod | None = None,
        seed: int | None = None,
        init_method: str | None = None,
        store: dist.Store | None = None,
        allow_cpu_oversubscription: bool = False,
        monitored_barrier_timeout: float | timedelta | None = None,
        checkpoint_on_sigterm: bool | str | os.PathLike = False,
        ddp_comm_hook: sync.CommHook | str | None = None, ddp_comm_state: Any = None, ddp_comm_wrapper: Any = None,
        verify_sync_every_n_steps: int | None = None,
        exact_evaluation: bool = True,
        find_unused_parameters: bool = False, static_graph: bool = False, gradient_as_bucket_view: bool = False,
        bucket_cap_mb: float | None = None, broadcast_buffers: bool = True,
        **ddp_kwargs: Any,
    ) -> None:
        super().__init__(accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin)
        named = {k: v for k, v in locals().items() if k in options.STRATEGY_ARGUMENTS}
        self._options = options.strategy_options(**named, ddp_kwargs=ddp_kwargs)
        self._process_group_backend = process_group_backend
        self._trainer: Trainer | None = None
        self._forward_redirection = sync.DDPForwardRedirection()
        self._run = process.ProcessGroupRun(self._options.timeout, self._options.barrier_timeout, init_method, store)
        self._sharding = sampling.LoaderSharding(exact_evaluation)
        self._collectives = process.Collectives(check=self._sharding.guard.check)
        self._sampler_seed = sampling.shared_seed(seed)
        self._gradients = sync.GradientSync(self._options.ddp_kwargs, self._options.comm_hook,
                                            verify_sync_every_n_steps)
        self._checkpoints = checkpoint.CheckpointTracker()
        self._diagnostics = diagnostics.FitDiagnostics()

    # ------------------------------------------------------------------------- 1. launch + process group
    @override
    def _configure_launcher(self) -> None:
        # Runs in Trainer(...), before any process starts: refuse impossible set-ups here, not in a child.
        self._launcher = process.launching.make_launcher(self, self.start_method, self._process_group_backend,
                                                         self._options.allow_cpu_oversubscription)

    @override
    def setup_environment(self) -> None:
        """Set the device up, then join (or reuse) the world process group (every rank, before model code)."""
        reset_seed()
        self.set_world_ranks()
        process.launching.check_external_world(self.cluster_environment, self.num_nodes, self.num_processes)
        super().setup_environment()
        self._process_group_backend = self._run.join(self.cluster_environment, self.root_device,
                                                     self._process_group_backend, self.num_nodes, self.num_processes)

    # --------------------------------------------------------------------------------- 3. DDP wrapping
    @override
    def setup(self, trainer: Trainer) -> None:
        """Move the module to the device; when fitting, wrap it in DDP and create the optimizers."""
        self._trainer = trainer
        self._sharding.take_over(trainer)
        self._sampler_seed = self.broadcast(sampling.shared_seed(self._options.seed))
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if trainer.state.fn == TrainerFn.FITTING:
            self._layer_sync, self.model = self._gradients.sync_layers(self._layer_sync, self.model)
            process.boundaries.add_fit_callbacks(trainer, self._run, self.global_rank, self.world_size)
            if self.is_global_zero:
                self._checkpoints.warn_if_unwritable(trainer)
            self.model = self._gradients.wrap(self.model, self.root_device)
            self.setup_optimizers(trainer)
        else:
            self._gradients.broadcast_states(self.model)
        self.setup_precision_plugin()

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    @override
    def pre_backward(self, closure_loss: Tensor) -> None:
        """Under manual optimization, prepare DDP's reducer before ``manual_backward``."""
        self._gradients.before_backward(self.model, closure_loss, self.lightning_module)

    @override
    def post_backward(self, closure_loss: Tensor) -> None:
        """After the first backward (find_unused_parameters off), name parameters that got no gradient."""
        self._gradients.after_backward(self.model, self.root_device)

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        """Step the optimizer; every ``verify_sync_every_n_steps`` steps, check the ranks agree."""
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        self._diagnostics.after_optimizer_step()
        self._gradients.after_optimizer_step(self.model, self.root_device)
        return output

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Skip the gradient all-reduce (DDP's ``no_sync``), e.g. for non-final accumulation micro-batches."""
        with self._gradients.no_sync(self.model):
            yield

    # ---------------------------------------------------------------------------------------- 2. sampler
    @override
    def process_dataloader(self, dataloader: object) -> object:
        """Shard ``dataloader`` for this rank (:meth:`ddp_strategy.sampling.LoaderSharding.prepare`)."""
        if self._trainer is None:
            return dataloader
        return self._sharding.prepare(dataloader, self._trainer, self.world_size, self.global_rank,
                                      self._sampler_seed)

    @override
    def on_validation_start(self) -> None:
        """Give every rank rank 0's buffers once per validation run (Lightning's ddp does it in every step)."""
        super().on_validation_start()
        self._gradients.before_validation(self.model)

    @override
    def on_validation_end(self) -> None:
        super().on_validation_end()
        self._sharding.end_stage()

    @override
    def on_test_end(self) -> None:
        super().on_test_end()
        self._sharding.end_stage()

    @override
    def on_predict_end(self) -> None:
        super().on_predict_end()
        self._sharding.end_stage()

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        """Call the LightningModule directly (not DDP's forward); collectives are refused on uneven loaders."""
        assert self.lightning_module is not None
        with self.precision_plugin.val_step_context(), self._sharding.step(self._trainer, "validation_step",
                                                                           args, kwargs):
            return self.lightning_module.validation_step(*args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        """As :meth:`validation_step`."""
        assert self.lightning_module is not None
        with self.precision_plugin.test_step_context(), self._sharding.step(self._trainer, "test_step", args, kwargs):
            return self.lightning_module.test_step(*args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        """Lightning's ``predict_step``, refusing per-step collectives on uneven shards."""
        with self._sharding.step(self._trainer, "predict_step", args, kwargs):
            return super().predict_step(*args, **kwargs)

    # ------------------------------------------------------------------------------------- collectives
    @override
    def barrier(self, name: str | None = None) -> None:
        """Wait for every rank (:meth:`ddp_strategy.process.Collectives.barrier`)."""
        self._collectives.barrier(self.root_device, self.global_rank)

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Rank ``src``'s ``obj`` on every rank (:meth:`ddp_strategy.process.Collectives.broadcast`)."""
        return self._collectives.broadcast(obj, src, self.global_rank)

    @override
    def reduce(self, tensor: Tensor | Any, group: Any | None = None, reduce_op: Any | None = "mean") -> Tensor | Any:
        """All-reduce over the world, ``"mean"`` by default (:meth:`ddp_strategy.process.Collectives.reduce`)."""
        return self._collectives.reduce(tensor, group, reduce_op, self.global_rank)

    @override
    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        """``(W, *shape)``; uneven first dimensions too (:meth:`ddp_strategy.process.Collectives.all_gather`)."""
        equal = functools.partial(super().all_gather, tensor, group=group, sync_grads=sync_grads)
        return self._collectives.all_gather(tensor, group, sync_grads, self.global_rank, equal)

    # ------------------------------------------------------------------------------------ 4. checkpoints
    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The LightningModule's state dict without DDP ``module.`` or torch.compile ``_orig_mod.`` segments."""
        assert self.lightning_module is not None
        return checkpoint.unwrapped_state_dict(self.lightning_module)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """With every rank's sampler position, global rank 0 writes; a failure raises on every rank. Collective."""
        self._sharding.add_positions(self._trainer, checkpoint)
        save = functools.partial(self.checkpoint_io.save_checkpoint, checkpoint, filepath, storage_options)
        self._collectives.on_rank_zero(save, f"saving checkpoint {filepath}", self.global_rank)
        self._checkpoints.record(filepath)

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        """Global rank 0 removes the file; a collective, like :meth:`save_checkpoint`."""
        self._checkpoints.forget(filepath)
        remove = functools.partial(self.checkpoint_io.remove_checkpoint, filepath)
        self._collectives.on_rank_zero(remove, f"removing checkpoint {filepath}", self.global_rank)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Every rank reads the file and keeps its sampler positions for the training loaders built next."""
        self._checkpoint_path = checkpoint_path
        weights_only = self._checkpoints.weights_only_for(checkpoint_path, weights_only)
        loaded = _pl.call_with_weights_only(super().load_checkpoint, checkpoint_path, weights_only=weights_only)
        self._sharding.take_positions(loaded)
        return loaded

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Load weights with keys matched exactly to the module's (:class:`~ddp_strategy.StateDictMismatchError`)."""
        assert self.lightning_module is not None
        self._checkpoints.load_into(self.lightning_module, checkpoint, strict, getattr(self, "_checkpoint_path", None))

    # ------------------------------------------------------------------------------------- diagnostics
    @override
    def on_train_start(self) -> None:
        """Restore a mid-epoch batch counter; rank 0: clean checkpoint folders, log the fit summary. No collective."""
        super().on_train_start()
        self._sharding.on_train_start(self._trainer, self.world_size)
        if self.is_global_zero and self._trainer is not None:
            self._checkpoints.remove_stale_temp_files(self._trainer)
        if self._trainer is not None:
            self._diagnostics.start(self._trainer, str(self._process_group_backend), self.start_method,
                                    self._options.ddp_kwargs, self.model)

    @override
    def on_train_end(self) -> None:
        """Log the communication summary and never-updated parameters (rank 0). A collective, on every rank."""
        super().on_train_end()
        self._diagnostics.end(self.model, self.root_device)

    # ---------------------------------------------------------------------------------------- failures
    @override
    def on_exception(self, exception: BaseException) -> None:
        """Name the failed rank and why; save on SIGTERM if asked; stop local ranks (no collective)."""
        super().on_exception(exception)
        self._diagnostics.abort()
        save = None
        path = self._options.sigterm_checkpoint_path(self._trainer)
        if isinstance(exception, SIGTERMException) and path is not None and self._trainer is not None:
            rank_zero_info(f"SIGTERM: saving a checkpoint to {path} before exiting; resume with fit(ckpt_path=...)")
            save = functools.partial(self._trainer.save_checkpoint, path)
        process.failures.on_exception(self._run, exception, self.global_rank, self.world_size,
                              self._sharding.guard.describe_uneven(), save, self._launcher)

    # --------------------------------------------------------------------------------------- teardown
    @override
    def teardown(self) -> None:
        """Unwrap, revert layer syncing, give Lightning its sampler back; after a failure, leave the process group."""
        trainer = self._trainer
        fitting = trainer is not None and trainer.state.fn == TrainerFn.FITTING
        self.model = self._gradients.unwrap(self.model, self.lightning_module, self._layer_sync, fitting,
                                            failed=self._run.failed)
        self._sharding.hand_back(trainer)
        if trainer is not None:
            process.boundaries.remove_fit_callbacks(trainer)
        super().teardown()
        process.failures.teardown(self._run, self.global_rank, self.world_size)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register ``"my_ddp"`` (automatic start method) and ``"my_ddp_spawn"`` with Lightning."""
        for name, start_method in (("my_ddp", None), ("my_ddp_spawn", "spawn")):
            if name not in strategy_registry:
                strategy_registry.register(name, cls, description=f"MyDDPStrategy, start_method={start_method}",
                                           start_method=start_method)


# In each namespace's registry, the flavour for that namespace; and its Trainer accepts compiled models for it.
_namespace.on_load(lambda namespace: MyDDPStrategy.for_namespace(namespace.name).register_strategies(
    namespace.get("pytorch.strategies:StrategyRegistry")))
_namespace.on_load(lambda namespace: _pl.allow_compiled_models(namespace, MyDDPStrategy))

__all__ = ["MyDDPStrategy"]
