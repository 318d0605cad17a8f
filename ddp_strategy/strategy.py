"""``MyDDPStrategy``: Lightning's hooks in order, each calling one step (process, sampling, sync, checkpoint)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal, cast

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from ddp_strategy import checkpoint, diagnostics, options, process, sampling, sync
from ddp_strategy._compat import lightning_private as _pl
from ddp_strategy._compat import namespace as _namespace
from ddp_strategy.checkpoint import FIT_MISMATCH_HINT, StateDictMismatchError, match_state_dict

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment


class MyDDPStrategy(sync.wrapping.LightningDDPAttributes, _namespace.ParallelStrategy):
    """Distributed data parallel training: one process per device, gradients all-reduced during backward.

    ``Trainer(devices=2, strategy=MyDDPStrategy())``: 2 processes (gloo; NCCL on CUDA), a per-epoch sampler for every
    loader, DDP while fitting, plain module keys in checkpoints. B = per-device ``batch_size``; a step sees ``B * W``.

    Args:
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin: as for any strategy.
        process_group_backend: ``"gloo"``, ``"nccl"``, ...; default ``None``: ``"nccl"`` on CUDA, else ``"gloo"``.
        timeout: how long a collective waits for the other ranks (seconds or ``timedelta``); default 30 min.
        start_method: ``"popen"``, ``"spawn"``, ``"fork"``, ``"forkserver"``; default ``"fork"`` in a REPL, else popen.
        seed: shuffle seed of the injected samplers; default ``None``: ``seed_everything``'s seed, else 0.
        init_method: ``None``/``"env://"`` (``MASTER_ADDR``/``MASTER_PORT``), ``"tcp://host:port"``, ``"file:///path"``.
        store: a ready ``torch.distributed.Store`` (e.g. ``FileStore``); ``fork`` and ``popen`` only.
        allow_cpu_oversubscription: silence the warning for more CPU processes per node than cores.
        monitored_barrier_timeout: the epoch barrier (``process.boundaries``) names ranks this late; default timeout.
        checkpoint_on_sigterm: on SIGTERM all ranks stop at one step and save to a path (``True``: ``sigterm.ckpt``).
        ddp_comm_hook, ddp_comm_state, ddp_comm_wrapper: a DDP comm hook (or ``"powersgd"``...), its state, a wrapper.
        model_averaging_period: with a ``PostLocalSGDState``, average the parameters every N optimizer steps after
            its ``start_localSGD_iter`` (torch's ``PeriodicModelAverager``, as Lightning's); default None.
        verify_sync_every_n_steps: every N optimizer steps compare parameters across ranks, naming any that differ.
        exact_evaluation: unpadded validation/test shards, equal batch counts (default); False: padded, as Lightning's.
        uneven_inputs: ranks with different numbers of training batches: ``"join"`` (default: every rank trains all
            its batches, the others' collectives shadowed), ``"stop"`` (all stop at the fewest) or ``"error"``.
        divide_by_initial_world_size: under ``"join"``, divide a step's gradient sum by W (default) or by its ranks.
        find_unused_parameters, static_graph, gradient_as_bucket_view, bucket_cap_mb (MiB), broadcast_buffers: DDP's.
        **ddp_kwargs: any other DDP option (``process_group``: also a zero-argument callable run after launch).

    Raises:
        ValueError, TypeError: a bad argument, named; at ``Trainer(...)``: ``"nccl"`` on CPU, a bad launch variable;
            at setup, as Lightning's: an unknown ``process_group_backend`` (one registered after ``__init__`` works).
    """

    strategy_name = "my_ddp"
    num_nodes: int = 1  #: machines, from ``Trainer(num_nodes=...)``
    is_distributed = True  #: tells Lightning to synchronise ``self.log(..., sync_dist=True)`` values

    def __init__(
        self,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: pl.plugins.precision.Precision | None = None,
        process_group_backend: str | None = None,
        timeout: float | timedelta = process.DEFAULT_TIMEOUT,
        start_method: process.StartMethod | None = None,
        seed: int | None = None,
        init_method: str | None = None,
        store: dist.Store | None = None,
        allow_cpu_oversubscription: bool = False,
        monitored_barrier_timeout: float | timedelta | None = None,
        checkpoint_on_sigterm: bool | str | os.PathLike = False,
        ddp_comm_hook: sync.CommHook | str | None = None,
        ddp_comm_state: Any = None,
        ddp_comm_wrapper: Any = None,
        model_averaging_period: int | None = None,
        verify_sync_every_n_steps: int | None = None,
        exact_evaluation: bool = True,
        uneven_inputs: Literal["join", "stop", "error"] = "join",
        divide_by_initial_world_size: bool = True,
        find_unused_parameters: bool = False,
        static_graph: bool = False,
        gradient_as_bucket_view: bool = False,
        bucket_cap_mb: float | None = None,
        broadcast_buffers: bool = True,
        **ddp_kwargs: Any,
    ) -> None:
        super().__init__(accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin)
        named = {k: v for k, v in locals().items() if k in options.STRATEGY_ARGUMENTS}
        self._options = options.strategy_options(**named, ddp_kwargs=ddp_kwargs)
        self._process_group_backend = process_group_backend
        self._trainer: pl.Trainer | None = None
        self._forward_redirection = sync.DDPForwardRedirection()
        self._run = process.ProcessGroupRun(self._options.timeout, self._options.barrier_timeout, init_method, store)
        self._sharding = sampling.LoaderSharding(exact_evaluation)
        self._round = process.boundaries.StepRound()  # the per-step flags the signals and the uneven inputs share
        self._uneven = sampling.UnevenInputs(
            uneven_inputs, divide_by_initial_world_size, self._round, self._sharding.until_teardown
        )
        self._warned_padded_gather = self._buffers_due = False  # rank 0's buffers: due at a validation step
        self._gradients_steps = 0  # optimizer steps (for the unused-parameter check and verify_sync_every_n_steps)
        self._written = checkpoint.WrittenFiles()  # checkpoints saved by this run, trusted when loaded back unchanged
        self._saved: Any = None  # the path of the last save_checkpoint, for the other ranks' _written at its barrier

    def __repr__(self) -> str:
        """``<MyDDPStrategy for lightning (DDP_STRATEGY_LIGHTNING=<lightning|pytorch_lightning> before importing
        ddp_strategy chooses)>``: the namespace it derives from, one per process (``ddp_strategy._compat.namespace``);
        the other namespace's Trainer refuses it, showing this."""
        return (
            f"<{type(self).__name__} for {_namespace.NAME} ({_namespace.ENV_VAR}=lightning|pytorch_lightning before"
            " importing ddp_strategy chooses)>"
        )

    @property
    @override
    def root_device(self) -> torch.device:
        """This rank's device: ``parallel_devices[local_rank]``; the one device a rank sees, whatever its local rank,
        where the environment owns the world (Ray's workers: ``devices="auto"``, as ``RayDDPStrategy``'s)."""
        return cast("list[torch.device]", self.parallel_devices)[self.local_rank if self.num_processes > 1 else 0]

    @property
    def num_processes(self) -> int:
        """Processes (devices) per node."""
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """``num_replicas`` (world size: the environment's, as ``RayDDPStrategy``'s) and ``rank`` (global rank) for a
        ``DistributedSampler``."""
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    @property
    def node_group(self) -> Any:
        """The intra-node process group of this rank (the world group on one node); None before setup."""
        return self._run.node_group

    @property
    def node_ranks(self) -> list[int]:
        """Global ranks on this rank's node, e.g. ``[2, 3]`` for node 1 of 2 with 2 devices each."""
        return dist.get_process_group_ranks(self.node_group) if self.node_group is not None else []

    @property
    def start_method(self) -> process.StartMethod:
        """How processes are started: ``"popen"``, ``"spawn"``, ``"fork"`` or ``"forkserver"``."""
        return self._options.start_method

    @property
    @override
    def checkpoint_io(self) -> CheckpointIO:
        """The checkpoint plugin: ``DDPCheckpointIO`` unless the user's; ``AsyncCheckpointIO()`` alone wraps it."""
        io = self._checkpoint_io = self._checkpoint_io or checkpoint.DDPCheckpointIO()
        if getattr(io, "checkpoint_io", io) is None:
            io.checkpoint_io = checkpoint.DDPCheckpointIO()
        return io

    @checkpoint_io.setter
    def checkpoint_io(self, io: CheckpointIO | None) -> None:
        self._checkpoint_io = io

    @override
    def _configure_launcher(self) -> None:
        self._launcher = process.launching.make_launcher(
            self, self.start_method, self._process_group_backend, self._options.allow_cpu_oversubscription
        )

    def set_world_ranks(self) -> None:
        """Check the launch variables (:func:`ddp_strategy.process.check_launch_env`); set rank and world size."""
        if self.cluster_environment is not None:
            process.check_launch_env(self.cluster_environment, self.num_nodes, self.num_processes)
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        _namespace.rank_zero_only.rank = self.global_rank  # lightning_utilities' (Lightning's rank_zero_* read it)

    @override
    def setup_environment(self) -> None:
        """Check an external launcher's ranks (its local rank picks the device), set the device up, then
        :meth:`setup_distributed`, as Lightning's (every rank, before model code)."""
        process.launching.check_external_world(
            cast("ClusterEnvironment", self.cluster_environment), self.num_nodes, self.num_processes
        )
        super().setup_environment()
        self.setup_distributed()

    def setup_distributed(self) -> None:
        """Set the ranks, then join (or reuse) the world process group (Lightning's hook, for subclasses)."""
        _namespace.reset_seed()
        self.set_world_ranks()
        self._process_group_backend = self._run.join(
            self.cluster_environment, self.root_device, self._process_group_backend, self.num_nodes, self.num_processes
        )

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        """Move the module to the device; when fitting, wrap it in DDP (:meth:`configure_ddp`), create the optimizers
        and move their state to the device, and build post-localSGD's averager, in Lightning's order."""
        self._trainer = trainer
        self._sharding.take_over(trainer)
        self._sampler_seed = self.broadcast(sampling.shared_seed(self._options.seed))
        cast("pl.accelerators.Accelerator", self.accelerator).setup(trainer)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        trainer.callbacks.insert(0, self._uneven.callback)  # first: it ends an uneven epoch or evaluation run
        if trainer.state.fn == _namespace.TrainerFn.FITTING:
            if self._layer_sync:  # Trainer(sync_batchnorm=True): Lightning's plugin, made CPU-capable
                self._layer_sync = sync.cpu_capable(self._layer_sync)
                self.model = cast("pl.plugins.LayerSync", self._layer_sync).apply(self.model)
            process.boundaries.add_fit_callbacks(  # at an epoch's start, after the barrier: the batch counts
                trainer, self._run, self.global_rank, self.world_size, self._round, self._uneven.begin_epoch, first=1
            )
            trainer.callbacks.append(diagnostics.FitDiagnostics(self._options.ddp_kwargs, self.start_method))
            if self.is_global_zero:
                checkpoint.prepare_folders(trainer.checkpoint_callbacks)
            self.configure_ddp()  # Lightning's overridable hooks: _setup_model, then _register_ddp_hooks
            self._gradients_steps = 0
            self.setup_optimizers(trainer)
            _pl.optimizers_to_device(self.optimizers, self.root_device)  # e.g. state loaded in configure_optimizers
            self._model_averager = sync.model_averager(
                self._options.comm_hook, self._options.model_averaging_period, self.optimizers
            )
        else:
            sync.broadcast_states(self.model, buffers=self._options.ddp_kwargs.get("broadcast_buffers", True))
        self.setup_precision_plugin()

    @override
    def model_to_device(self) -> None:
        """Move the module to :attr:`root_device`."""
        self.model.to(self.root_device)

    @override
    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        """Lightning's; at a step's start on uneven inputs, the policy's and the join's part first (``sampling``)."""
        self._uneven.step_start()
        return super().batch_to_device(batch, device, dataloader_idx)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """Lightning's, through DDP's forward, wrapped anew where the trainable parameters changed (``sync.wrap``); on
        uneven inputs, announced to the ranks that only shadow it."""
        self.model = sync.wrap(
            self.model, self.root_device, self._options.ddp_kwargs, self._options.comm_hook, self._uneven.tail
        )
        self._round.start()  # this step's SIGTERM, requeue and next-batch flags (process.boundaries.StepRound)
        self._uneven.before_forward()
        return super().training_step(*args, **kwargs)

    @override
    def pre_backward(self, closure_loss: Tensor) -> None:
        """Under manual optimization, prepare DDP's reducer before ``manual_backward`` (as Lightning's DDP does). In a
        backward that syncs gradients, the step's round again (``process.boundaries.StepRound.start``), by a hook on
        ``closure_loss`` (so after the ``on_before_backward`` hooks, before the first gradient bucket), which a
        collective the others skipped in the step (``self.log(..., sync_dist=True)`` on one rank) meets at once."""
        self._uneven.before_backward()  # in a step some ranks only shadow: announce the all-reduce
        if getattr(self.model, "require_backward_grad_sync", False) and closure_loss.requires_grad:
            closure_loss.register_hook(self._round.start)
        if isinstance(self.model, DistributedDataParallel) and not self.model.module.automatic_optimization:
            _pl.prepare_for_backward(self.model, closure_loss)

    @override
    def post_backward(self, closure_loss: Tensor) -> None:
        """Manual optimization under ``static_graph``: all-reduce the first step's gradients (as Lightning's DDP,
        Lightning-AI/pytorch-lightning#18086); until the first step (``find_unused_parameters`` off), name this
        rank's parameters without gradient (:func:`ddp_strategy.sync.after_backward`; no collective)."""
        sync.after_backward(self.model, first_step=self._gradients_steps == 0)

    @override  # ignore below: Lightning hints the _GeneratorContextManager of its @contextmanager; any serves
    def block_backward_sync(self) -> contextlib.AbstractContextManager:  # type: ignore[override]
        """DDP's ``no_sync`` for accumulation's non-final micro-batches (Lightning's), but not under ``static_graph``,
        where torch fails (pytorch/pytorch#143580): there each micro-batch all-reduces, which gives the same
        accumulated mean over ranks (one all-reduce per micro-batch instead of per step)."""
        return contextlib.nullcontext() if getattr(self.model, "static_graph", False) else super().block_backward_sync()

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        """Step the optimizer; post-localSGD: average the parameters (Lightning's); every ``verify_sync_every_n_steps``
        steps, check the ranks agree."""
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self._model_averager is not None:  # it averages every model_averaging_period steps after the warm-up
            self._model_averager.average_parameters(
                p for g in optimizer.param_groups for p in g["params"] if p.grad is not None
            )
        self._gradients_steps += not self._uneven.tail  # steps some ranks only shadow are not checked
        if (n := self._options.verify_sync_every_n_steps) and not self._uneven.tail and self._gradients_steps % n == 0:
            sync.verify_parameters_in_sync(
                cast("pl.LightningModule", self.lightning_module), self._gradients_steps, self.root_device
            )
        return output

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """Shard ``dataloader`` for this rank (:meth:`ddp_strategy.sampling.LoaderSharding.prepare`); no collective."""
        return (
            dataloader
            if self._trainer is None
            else self._sharding.prepare(  # as is before setup
                dataloader, self._trainer, self.world_size, self.global_rank, self._sampler_seed
            )
        )

    @override
    def on_validation_start(self) -> None:
        """Agree the counts needing the peers: where they differ or are unknown, the stage runs under the uneven-inputs
        join (also ``on_test_start``, ``on_predict_start``); fitting, rank 0's buffers are due at the first step (after
        EMA swaps)."""
        if self._sharding.agree_counts():
            self._uneven.begin_evaluation(self._trainer)
        self._buffers_due = isinstance(self.model, DistributedDataParallel) and self.model.will_sync_module_buffers()

    on_test_start = on_predict_start = on_validation_start

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        """Call the LightningModule directly (not DDP's forward); uneven loaders run under the join (``uneven``).
        (``test_step`` and ``predict_step`` are Lightning's: the module is wrapped only while fitting.)"""
        if self._buffers_due:  # once per run; Lightning's ddp copies rank 0's buffers in every step's DDP forward
            self._buffers_due = False
            sync.broadcast_states(self.model.module, parameters=False)
        with self.precision_plugin.val_step_context():
            return cast("pl.LightningModule", self.lightning_module).validation_step(*args, **kwargs)

    @override
    def barrier(self, name: str | None = None) -> None:
        """Wait for every rank (NCCL: on this rank's device); a no-op without a process group or on a rank's own
        exception path (``process.failures.collectives_allowed``). While fitting, a round of the step agreement
        (``process.boundaries.StepRound.barrier``): one that some ranks skip (``trainer.save_checkpoint`` under ``if
        trainer.is_global_zero``) fails at once, named, not at the collective timeout."""
        if process.failures.collectives_allowed(self._trainer):  # none on an exception path: peers may be mid-step
            self._uneven.announce("save" if name == _pl.SAVE_BARRIER else "barrier")
            self._round.barrier(  # while fitting, named at once where another rank went on to a step instead
                self.global_rank,
                f"waited in a barrier ({name or 'strategy.barrier()'})",
                device_ids=process.device_ids(self.root_device) if dist.get_backend() == "nccl" else None,
            )
        if name == _pl.SAVE_BARRIER and self._saved is not None:  # rank 0 wrote it: the file as it is now
            self._written.add(self._saved)

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Rank ``src``'s ``obj`` on every rank (pickled); ``obj`` itself without a process group or on a rank's own
        exception path."""
        box = [obj]
        if process.failures.collectives_allowed(self._trainer):
            if not self._uneven.announce("broadcast", src):
                self._round.barrier(self.global_rank, f"made a broadcast from rank {src}", "broadcast")
            dist.broadcast_object_list(box, src)
        return box[0]

    @override
    def reduce(self, tensor: Tensor | Any, group: Any | None = None, reduce_op: Any | None = "mean") -> Tensor | Any:
        """Lightning's ``DDPStrategy.reduce`` over ``group`` (a collective, in place: ``process.all_reduce``), but an
        integer mean is exact float32, and Lightning's barrier before the all-reduce is, while fitting, the strategy's
        round (``process.boundaries.StepRound.barrier``): a reduce on some ranks only is named at once."""
        tail = self._uneven.announce("reduce (e.g. self.log(..., on_step=True, sync_dist=True))")
        if isinstance(tensor, Tensor) and str(reduce_op).lower() in ("mean", "avg") and not tensor.is_floating_point():
            tensor = tensor.float()  # exact: epoch values over uneven shards divide by their mean batch size
        if isinstance(tensor, Tensor) and tail:
            return self._uneven.reduce(tensor, group, reduce_op)
        if isinstance(tensor, Tensor) and group in (None, dist.group.WORLD):  # some ranks only: named at once
            self._round.barrier(
                self.global_rank, "made a reduce (self.log(..., sync_dist=True) or strategy.reduce)", "reduce"
            )
        return process.all_reduce(tensor, group, reduce_op) if isinstance(tensor, Tensor) else tensor

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """All ranks' decisions (``all``), or any, as Lightning's: the minimum or maximum by :meth:`reduce` (in a step
        some ranks only shadow, over the ranks taking it)."""
        return bool(
            self.reduce(torch.tensor([int(decision)], device=self.root_device), reduce_op="min" if all else "max")
        )

    @override
    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        """``(W, *shape)``; uneven first dims: ``(W, max n_r, *rest)`` padded, warned once; else ``ValueError``."""
        if not self._uneven.announce("all_gather") and group in (None, dist.group.WORLD):
            self._round.barrier(self.global_rank, "made an all_gather", "all_gather")
        if len(set(shapes := process.gather_shapes(tensor, group))) == 1:
            return super().all_gather(tensor, group=group, sync_grads=sync_grads)
        warn, self._warned_padded_gather = not self._warned_padded_gather, True
        return process.all_gather_padded(tensor, shapes, group, sync_grads, warn=warn)

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The LightningModule's state dict without DDP ``module.`` or torch.compile ``_orig_mod.`` segments."""
        return checkpoint.unwrapped_state_dict(cast("pl.LightningModule", self.lightning_module))

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Global rank 0 writes (no collective, as Lightning's); a failure raises there, and the other ranks, waiting
        in ``Trainer.save_checkpoint``'s barrier, name it within seconds (:mod:`ddp_strategy.process.failures`)."""
        sampling.save_positions(self._trainer, checkpoint)
        if self.is_global_zero:
            self.checkpoint_io.save_checkpoint(checkpoint, filepath, storage_options=storage_options)
            self._written.add(filepath)
        self._saved = filepath

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        """Global rank 0 removes the file (no collective, as Lightning's)."""
        self._written.discard(filepath)
        super().remove_checkpoint(filepath)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Every rank reads the file and keeps its sampler positions; a file saved here, unchanged, is trusted."""
        self._checkpoint_path = checkpoint_path
        if weights_only is None and checkpoint_path in self._written:
            weights_only = False  # unless the caller chose (lr_find, ckpt_path="best" cannot)
        loaded = _pl.call_with_weights_only(super().load_checkpoint, checkpoint_path, weights_only=weights_only)
        self._sharding.positions = sampling.read_positions(loaded)
        return loaded

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Load weights by exact key (:func:`~ddp_strategy.match_state_dict`); strict: ``StateDictMismatchError``;
        either way a tensor of another shape raises (``size mismatch for <key>``), as under Lightning's ``ddp``."""
        module = cast("pl.LightningModule", self.lightning_module)
        try:
            state_dict = match_state_dict(
                checkpoint["state_dict"], module, strict=strict, source=getattr(self, "_checkpoint_path", None)
            )
        except StateDictMismatchError as e:
            with contextlib.suppress(RuntimeError):  # not attached to a trainer (self._trainer is set later)
                if module.trainer is not None and module.trainer.state.fn == _namespace.TrainerFn.FITTING:
                    e.args = (f"{e}\n{FIT_MISMATCH_HINT}",)  # fit(ckpt_path=...) restores the optimizer too
            raise
        module.load_state_dict(state_dict, strict=strict)

    @override
    def on_train_start(self) -> None:
        """Restore a mid-epoch batch counter. No collective."""
        sampling.restore_batch_counter(cast("pl.Trainer", self._trainer), self._sharding.until_teardown)

    @override
    def on_exception(self, exception: BaseException) -> None:
        """Name the failed rank and why; save on SIGTERM if asked (no collective)."""
        cause = self._uneven.failure_cause  # read before the run is forgotten
        self._uneven.abandon()
        process.failures.on_exception(
            self._run, exception, self.global_rank, self.world_size, self._options.sigterm_save(self._trainer), cause
        )

    @override
    def teardown(self) -> None:
        """Unwrap, revert layer syncing, give Lightning its sampler back; after a failure, leave the process group."""
        trainer = self._trainer
        self.model = sync.unwrap(self.model, failed=self._run.failed)
        if self._layer_sync and trainer is not None and trainer.state.fn == _namespace.TrainerFn.FITTING:
            self.model = self._layer_sync.revert(self.model)
        self._sharding.hand_back(trainer)
        self._uneven.abandon()
        if trainer is not None:  # the loops' data fetchers read the loaders' lengths (user code) while the group lives
            process.boundaries.remove_fit_callbacks(trainer, type(self._uneven.callback), diagnostics.FitDiagnostics)
            for loop in (trainer.fit_loop, trainer.validate_loop, trainer.test_loop, trainer.predict_loop):
                loop.teardown()
        super().teardown()
        process.failures.teardown(self._run, self.global_rank, self.world_size)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register ``"my_ddp"`` (automatic start method) and ``"my_ddp_spawn"`` with Lightning."""
        for name, start_method in (("my_ddp", None), ("my_ddp_spawn", "spawn")):
            strategy_registry.register(
                name,
                cls,
                description=f"MyDDPStrategy, start_method={start_method}",
                override=True,
                start_method=start_method,
            )


# "my_ddp" in this namespace's registry; its Trainer accepts compiled models for the strategy.
MyDDPStrategy.register_strategies(_namespace.get("pytorch.strategies:StrategyRegistry"))
_pl.allow_compiled_models(MyDDPStrategy)
