"""``MyDDPStrategy``: synchronous data parallelism for Lightning, one concern per module.

The strategy only orchestrates, in Lightning's hook order:

1. process group: :mod:`ddp_strategy.process_group` (``setup_environment``, ``teardown``);
2. sampler: :mod:`ddp_strategy.sampler` (``process_dataloader``);
3. DDP wrapping: :mod:`ddp_strategy.wrapping` (``setup``, ``teardown``);
4. checkpoint keys: :mod:`ddp_strategy.checkpoint_io` (the default ``checkpoint_io``).

Launching is Lightning's: its launchers start one process per device, and its ``ClusterEnvironment``
classes say which rank each process is.
"""

from __future__ import annotations

import logging
from collections.abc import Generator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch import Trainer
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from ddp_strategy import _lightning_private as _pl
from ddp_strategy import comm_hooks, process_group, rank_check, sampler, sync_batchnorm, wrapping
from ddp_strategy.checkpoint_io import DDPCheckpointIO

log = logging.getLogger(__name__)

StartMethod = Literal["popen", "spawn", "fork", "forkserver"]
START_METHODS: tuple[str, ...] = ("popen", "spawn", "fork", "forkserver")


def default_start_method() -> StartMethod:
    """``"fork"`` in an interactive session (Jupyter, REPL), where a script cannot be re-run; else ``"popen"``.

    ``popen`` re-runs the user's script once per extra device (Lightning's default for ``"ddp"``): nothing
    has to be pickled and CUDA may be initialised in the parent.
    """
    return "fork" if _pl.is_interactive() else "popen"


class MyDDPStrategy(ParallelStrategy):
    """Distributed data parallel training on one machine: one process per device, gradients all-reduced.

    ``Trainer(accelerator="cpu", devices=2, strategy=MyDDPStrategy())`` starts 2 processes, joins them in a
    gloo process group, shards every train/val/test loader with a ``DistributedSampler`` re-seeded each
    epoch, wraps the LightningModule in ``DistributedDataParallel`` while fitting, and writes checkpoints
    whose model keys load into the plain module. The loader's ``batch_size`` is the per-device batch size
    B; one optimizer step sees the global batch ``B * world_size``.

    Registered with Lightning as ``strategy="my_ddp"`` (start method chosen automatically) and
    ``"my_ddp_spawn"``.

    Args:
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin: as for any
            Lightning ``ParallelStrategy``; the Trainer fills them in. ``checkpoint_io`` defaults to
            :class:`~ddp_strategy.checkpoint_io.DDPCheckpointIO`.
        process_group_backend: ``"gloo"``, ``"nccl"``, ...; default ``None`` picks ``"nccl"`` on CUDA and
            ``"gloo"`` on CPU.
        timeout: how long a collective may wait for the other ranks, in seconds or as a ``timedelta``;
            default 30 minutes (PyTorch's).
        start_method: ``"popen"`` (re-run the script), ``"spawn"``, ``"fork"`` or ``"forkserver"``; default
            ``None`` = :func:`default_start_method`.
        seed: shuffle seed of the injected samplers; default ``None`` = ``seed_everything``'s seed, else 0.
            Rank 0's value is broadcast so all ranks agree.
        ddp_comm_hook: a DDP communication hook ``hook(state, bucket) -> Future``, or one of ``"allreduce"``,
            ``"fp16"``, ``"bf16"``, ``"powersgd"``; registered on every backend, gloo included
            (:mod:`ddp_strategy.comm_hooks`). Default ``None``: DDP's own float32 all-reduce.
        ddp_comm_state: the hook's state (a ``PowerSGDState`` for PowerSGD, a process group for the others).
        ddp_comm_wrapper: wraps the hook, e.g. ``default_hooks.fp16_compress_wrapper`` around PowerSGD.
        verify_sync_every_n_steps: compare parameter checksums across ranks after every N-th optimizer
            step and raise on every rank naming the parameters that differ
            (:mod:`ddp_strategy.rank_check`); default ``None`` = off.
        **ddp_kwargs: options for :class:`torch.nn.parallel.DistributedDataParallel`
            (``find_unused_parameters``, ``bucket_cap_mb`` in MiB, ``static_graph``, ``broadcast_buffers``,
            ``process_group`` (a group, or a zero-argument callable that builds one after launch), ...);
            ``gradient_as_bucket_view`` defaults to True here.

    Raises:
        ValueError: unknown ``start_method`` or ``process_group_backend``, or a non-positive ``timeout``.
        TypeError: an unknown DDP option, or a ``timeout`` that is not a number or ``timedelta``.
    """

    strategy_name = "my_ddp"

    def __init__(
        self,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: float | timedelta = process_group.DEFAULT_TIMEOUT,
        start_method: StartMethod | None = None,
        seed: int | None = None,
        ddp_comm_hook: comm_hooks.CommHook | str | None = None,
        ddp_comm_state: Any = None,
        ddp_comm_wrapper: Any = None,
        verify_sync_every_n_steps: int | None = None,
        **ddp_kwargs: Any,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        if start_method is not None and start_method not in START_METHODS:
            raise ValueError(f"Unknown start_method={start_method!r}; use one of {list(START_METHODS)} or None.")
        process_group.validate_backend_name(process_group_backend)
        self._process_group_backend = process_group_backend
        self._timeout = process_group.as_timedelta(timeout)
        self._start_method: StartMethod = start_method or default_start_method()
        self._seed = seed
        self._ddp_kwargs = wrapping.validate_ddp_kwargs(ddp_kwargs)
        self._num_nodes = 1
        self._sampler_seed = sampler.shared_seed(seed)
        self._trainer: Trainer | None = None
        self._forward_redirection = wrapping.DDPForwardRedirection()
        self._comm_hook = comm_hooks.CommHookConfig(ddp_comm_hook, ddp_comm_state, ddp_comm_wrapper)
        if verify_sync_every_n_steps is not None and verify_sync_every_n_steps < 1:
            raise ValueError(f"verify_sync_every_n_steps must be a positive number of optimizer steps or None,"
                             f" got {verify_sync_every_n_steps}.")
        self._verify_sync_every_n_steps = verify_sync_every_n_steps
        self._optimizer_steps = 0
        self._check_unused_after_backward = False

    # ----------------------------------------------------------------------------------------- topology
    @property
    @override
    def root_device(self) -> torch.device:
        """This rank's device: ``parallel_devices[local_rank]``."""
        assert self.parallel_devices is not None, "the Trainer sets parallel_devices before use"
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        """Number of machines (Lightning's ``Trainer(num_nodes=...)``)."""
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        """Processes (devices) per node."""
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def is_distributed(self) -> bool:
        """Always True: tells Lightning to synchronise ``self.log(..., sync_dist=True)`` values."""
        return True

    @property
    def process_group_backend(self) -> str | None:
        """The backend in use once the process group exists, else the user's choice (or None)."""
        return self._process_group_backend

    @property
    def start_method(self) -> StartMethod:
        """How processes are started: ``"popen"``, ``"spawn"``, ``"fork"`` or ``"forkserver"``."""
        return self._start_method

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """``num_replicas`` (world size) and ``rank`` (global rank) for a ``DistributedSampler``."""
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    @property
    @override
    def checkpoint_io(self) -> CheckpointIO:
        """The checkpoint plugin; :class:`DDPCheckpointIO` unless the user passed another."""
        if self._checkpoint_io is None:
            self._checkpoint_io = DDPCheckpointIO()
        return self._checkpoint_io

    @checkpoint_io.setter
    def checkpoint_io(self, io: CheckpointIO | None) -> None:
        self._checkpoint_io = io

    def set_world_ranks(self) -> None:
        """Tell the cluster environment and Lightning's rank-zero helpers this process's global rank."""
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    # ------------------------------------------------------------------------- 1. launch + process group
    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if self._start_method == "popen":
            self._launcher = _pl.SubprocessScriptLauncher(self.cluster_environment, self.num_processes,
                                                          self.num_nodes)
        else:
            self._launcher = _pl.MultiProcessingLauncher(self, start_method=self._start_method)

    @override
    def setup_environment(self) -> None:
        """Set the device up, then join the process group (every rank, before any model code runs)."""
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        assert self.cluster_environment is not None
        backend = process_group.resolve_backend(self.root_device, self._process_group_backend)
        process_group.init_process_group(
            backend,
            rank=self.global_rank,
            world_size=self.world_size,
            main_address=self.cluster_environment.main_address,
            main_port=self.cluster_environment.main_port,
            timeout=self._timeout,
            device=self.root_device,
        )
        self._process_group_backend = backend
        rank_zero_info(f"MyDDPStrategy: {self.world_size} processes, backend={backend},"
                       f" start_method={self._start_method}")

    # --------------------------------------------------------------------------------- 3. DDP wrapping
    @override
    def setup(self, trainer: Trainer) -> None:
        """Move the module to the device and, when fitting, wrap it in DDP and create the optimizers."""
        self._trainer = trainer
        _pl.set_lightning_sampler_injection(trainer, enabled=trainer.state.fn == TrainerFn.PREDICTING)
        self._sampler_seed = self.broadcast(sampler.shared_seed(self._seed))
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        assert self.model is not None
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if fitting and self._layer_sync:
            self._layer_sync = sync_batchnorm.cpu_capable(self._layer_sync)
            self.model = self._layer_sync.apply(self.model)
        if fitting:
            ddp_kwargs = wrapping.resolve_process_group(self._ddp_kwargs)
            self.model = wrapping.wrap_module(self.model, self.root_device, ddp_kwargs)
            comm_hooks.register_comm_hook(self.model, self._comm_hook, dist.get_backend())
            self._check_unused_after_backward = wrapping.needs_unused_parameter_check(self._ddp_kwargs)
            self._optimizer_steps = 0
            self.setup_optimizers(trainer)
        else:
            wrapping.broadcast_module_states(self.model)
        self.setup_precision_plugin()

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    @override
    def pre_backward(self, closure_loss: Tensor) -> None:
        """Under manual optimization, prepare DDP's reducer before ``manual_backward``."""
        assert self.lightning_module is not None
        if not self.lightning_module.automatic_optimization:
            wrapping.prepare_manual_backward(self.model, closure_loss)

    @override
    def post_backward(self, closure_loss: Tensor) -> None:
        """After the first backward (find_unused_parameters off), name parameters that got no gradient."""
        if self._check_unused_after_backward:
            self._check_unused_after_backward = False
            wrapping.check_unused_parameters(self.model, self.root_device)

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        """Step the optimizer; every ``verify_sync_every_n_steps`` steps, check the ranks agree."""
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        self._optimizer_steps += 1
        n = self._verify_sync_every_n_steps
        if n is not None and self._optimizer_steps % n == 0 and self.model is not None:
            rank_check.verify_parameters_in_sync(wrapping.unwrap_module(self.model), self._optimizer_steps,
                                                 self.root_device)
        return output

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Skip the gradient all-reduce (DDP's ``no_sync``), e.g. for non-final accumulation micro-batches."""
        if isinstance(self.model, DistributedDataParallel):
            with self.model.no_sync():
                yield
        else:
            yield

    # ---------------------------------------------------------------------------------------- 2. sampler
    @override
    def process_dataloader(self, dataloader: object) -> object:
        """Give ``dataloader`` a distributed sampler that keeps its shuffle setting and tracks the epoch.

        Training loaders are padded so every rank takes the same number of steps; validation and test
        loaders are not, so each sample is evaluated exactly once (evaluation runs without the DDP
        wrapper, see :meth:`validation_step`). Predict loaders are left to Lightning, whose sampler also
        evaluates each sample exactly once.
        """
        trainer = self._trainer
        if trainer is None or trainer.state.fn == TrainerFn.PREDICTING:
            return dataloader
        return sampler.inject_distributed_sampler(
            dataloader,
            num_replicas=self.world_size,
            rank=self.global_rank,
            seed=self._sampler_seed,
            epoch_fn=lambda: trainer.fit_loop.epoch_progress.current.processed,
            pad=trainer.state.stage == RunningStage.TRAINING,
        )

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        """Call the LightningModule directly, not through DDP: evaluation needs no per-step collective."""
        assert self.lightning_module is not None
        with self.precision_plugin.val_step_context():
            return self.lightning_module.validation_step(*args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        """Call the LightningModule directly, as :meth:`validation_step` does."""
        assert self.lightning_module is not None
        with self.precision_plugin.test_step_context():
            return self.lightning_module.test_step(*args, **kwargs)

    # ------------------------------------------------------------------------------------- collectives
    @override
    def barrier(self, name: str | None = None) -> None:
        """Wait for every rank (a collective); a no-op without a process group."""
        if not dist.is_initialized():
            return
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=wrapping.ddp_device_ids(self.root_device))
        else:
            dist.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Return rank ``src``'s ``obj`` on every rank (a collective; pickles ``obj``)."""
        if not dist.is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

    @override
    def reduce(self, tensor: Tensor | Any, group: Any | None = None, reduce_op: Any | None = "mean") -> Tensor | Any:
        """All-reduce ``tensor`` over the world (``"mean"`` by default); non-tensors pass through.

        A collective: every rank must call it. ``group`` other than the world is not supported.

        Raises:
            ValueError: ``group`` is given, or ``reduce_op`` is unknown.
        """
        if group is not None:
            raise ValueError("MyDDPStrategy.reduce only reduces over the world process group; pass group=None.")
        if not isinstance(tensor, Tensor):
            return tensor
        return process_group.all_reduce(tensor, op=reduce_op or "mean")

    # --------------------------------------------------------------------------------------- teardown
    @override
    def teardown(self) -> None:
        """Release the DDP wrapper, revert layer syncing, then destroy the process group (every backend)."""
        pl_module = self.lightning_module
        if isinstance(self.model, DistributedDataParallel):
            self.model = pl_module
        trainer = self._trainer
        if trainer is not None and trainer.state.fn == TrainerFn.FITTING and self._layer_sync:
            assert self.model is not None
            self.model = self._layer_sync.revert(self.model)
        if self._trainer is not None:
            _pl.set_lightning_sampler_injection(self._trainer, enabled=True)
        super().teardown()
        process_group.destroy_process_group()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register ``"my_ddp"`` (automatic start method) and ``"my_ddp_spawn"`` with Lightning."""
        for name, start_method in (("my_ddp", None), ("my_ddp_spawn", "spawn")):
            if name not in strategy_registry:
                strategy_registry.register(name, cls, description=f"MyDDPStrategy, start_method={start_method}",
                                           start_method=start_method)


MyDDPStrategy.register_strategies(StrategyRegistry)

__all__ = ["MyDDPStrategy", "default_start_method", "START_METHODS"]
