"""``MyDDPStrategy``: synchronous data parallelism for Lightning, one concern per module.

The strategy only orchestrates, in Lightning's hook order:

1. process group: :mod:`ddp_strategy.process.group` (``setup_environment``, ``teardown``);
2. sampler: :mod:`ddp_strategy.sampling.sampler` (``process_dataloader``);
3. DDP wrapping: :mod:`ddp_strategy.sync.wrapping` (``setup``, ``teardown``);
4. checkpoint keys: :mod:`ddp_strategy.checkpoint.files` (the default ``checkpoint_io``).

Launching is Lightning's: its launchers start one process per device, and its ``ClusterEnvironment``
classes say which rank each process is.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Generator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from ddp_strategy import options as argument_checks
from ddp_strategy._compat import lightning_private as _pl
from ddp_strategy._compat import namespace as _namespace
from ddp_strategy._compat.namespace import (
    RunningStage,
    SIGTERMException,
    TrainerFn,
    rank_zero_info,
    rank_zero_only,
    rank_zero_warn,
    reset_seed,
)
from ddp_strategy.checkpoint import files as checkpoint_io
from ddp_strategy.checkpoint.files import DDPCheckpointIO
from ddp_strategy.diagnostics import summary as diagnostics
from ddp_strategy.process import collectives as gather
from ddp_strategy.process import failures, launching
from ddp_strategy.process import group as process_group
from ddp_strategy.sampling import evaluation, injection, resume, sampler
from ddp_strategy.sampling import state as sampler_state
from ddp_strategy.sync import comm_hooks, rank_check, sync_batchnorm, wrapping

if TYPE_CHECKING:
    from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
    from lightning.pytorch import Trainer
    from lightning.pytorch.accelerators import Accelerator
    from lightning.pytorch.plugins.precision import Precision
    from lightning.pytorch.strategies import ParallelStrategy
else:  # the flavour for the user's Lightning namespace is built on construction (see ddp_strategy._compat.namespace)
    ParallelStrategy = _namespace.lightning_base("pytorch.strategies:ParallelStrategy")

log = logging.getLogger(__name__)

StartMethod = Literal["popen", "spawn", "fork", "forkserver"]
START_METHODS: tuple[str, ...] = ("popen", "spawn", "fork", "forkserver")


def default_start_method() -> StartMethod:
    """``"fork"`` in an interactive session (Jupyter, REPL), where a script cannot be re-run; else ``"popen"``.

    ``popen`` re-runs the user's script once per extra device (Lightning's default for ``"ddp"``): nothing
    has to be pickled and CUDA may be initialised in the parent.
    """
    return "fork" if _pl.is_interactive() else "popen"


def _no_op() -> None:
    pass


class MyDDPStrategy(ParallelStrategy):
    """Distributed data parallel training on one machine: one process per device, gradients all-reduced.

    ``Trainer(accelerator="cpu", devices=2, strategy=MyDDPStrategy())`` starts 2 processes, joins them in a
    gloo process group, shards every train/val/test loader with a ``DistributedSampler`` re-seeded each
    epoch (unless ``Trainer(use_distributed_sampler=False)``: then the user's loaders are kept, as in
    Lightning), wraps the LightningModule in ``DistributedDataParallel`` while fitting, and writes
    checkpoints whose model keys load into the plain module. The loader's ``batch_size`` is the per-device batch size
    B; one optimizer step sees the global batch ``B * world_size``.

    Registered with Lightning as ``strategy="my_ddp"`` (start method chosen automatically) and
    ``"my_ddp_spawn"``.

    Args:
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin: as for any
            Lightning ``ParallelStrategy``; the Trainer fills them in. ``checkpoint_io`` defaults to
            :class:`~ddp_strategy.checkpoint.files.DDPCheckpointIO`.
        process_group_backend: ``"gloo"``, ``"nccl"``, ...; default ``None`` picks ``"nccl"`` on CUDA and
            ``"gloo"`` on CPU.
        timeout: how long a collective may wait for the other ranks, in seconds or as a ``timedelta``;
            default 30 minutes, Lightning's (see :data:`ddp_strategy.process.group.DEFAULT_TIMEOUT`).
        start_method: ``"popen"`` (re-run the script), ``"spawn"``, ``"fork"`` or ``"forkserver"``; default
            ``None`` = :func:`default_start_method`.
        seed: shuffle seed of the injected samplers; default ``None`` = ``seed_everything``'s seed, else 0.
            Rank 0's value is broadcast so all ranks agree.
        init_method: rendezvous URL: ``None``/``"env://"`` (``MASTER_ADDR``/``MASTER_PORT``, a free port
            on one machine when unset), ``"tcp://host:port"`` or ``"file:///shared/file"``.
        store: a ready ``torch.distributed.Store`` (e.g. ``FileStore(path, world_size)``, which needs no
            port); takes precedence over ``init_method``. Works with ``fork`` and ``popen`` (a ``FileStore``
            path every process opens); ``spawn`` cannot pickle a store and is refused.
        allow_cpu_oversubscription: more CPU processes per node than cores run (slower, but correct) with a
            rank-0 warning; True silences it (default False).
        monitored_barrier_timeout: at the start of each training epoch every rank meets at a gloo
            ``monitored_barrier`` that names any rank that did not arrive within this time (seconds or
            ``timedelta``); default ``None`` = ``timeout``.
        checkpoint_on_sigterm: on SIGTERM (how clusters pre-empt jobs) all ranks stop at the same step and
            save a checkpoint before exiting: ``True`` writes ``<default_root_dir>/sigterm.ckpt``, a path writes
            there; resume with ``Trainer.fit(ckpt_path=...)``. Default False.
        ddp_comm_hook: a DDP communication hook ``hook(state, bucket) -> Future``, or one of ``"allreduce"``,
            ``"fp16"``, ``"bf16"``, ``"powersgd"``; registered on every backend, gloo included
            (:mod:`ddp_strategy.sync.comm_hooks`). Default ``None``: DDP's own float32 all-reduce.
        ddp_comm_state: the hook's state (a ``PowerSGDState`` for PowerSGD, a process group for the others).
        ddp_comm_wrapper: wraps the hook, e.g. ``default_hooks.fp16_compress_wrapper`` around PowerSGD.
        verify_sync_every_n_steps: compare parameter checksums across ranks after every N-th optimizer
            step and raise on every rank naming the parameters that differ
            (:mod:`ddp_strategy.sync.rank_check`); default ``None`` = off.
        exact_evaluation: shard validation and test loaders without padding, every sample evaluated once, with
            the same number of batches on every rank (:mod:`ddp_strategy.sampling.evaluation`); default True. False
            shards them exactly as Lightning's ddp does (padded by repeating the first samples, full batches
            but the last), for code that needs Lightning's batches.
        find_unused_parameters, static_graph, gradient_as_bucket_view, bucket_cap_mb, broadcast_buffers:
            the common :class:`torch.nn.parallel.DistributedDataParallel` options, named so that
            ``LightningCLI``/YAML can set them (``--trainer.strategy.find_unused_parameters=true``); defaults
            are DDP's (and Lightning's). ``bucket_cap_mb`` is in MiB (None = DDP's 25).
        **ddp_kwargs: options for :class:`torch.nn.parallel.DistributedDataParallel`
            (``find_unused_parameters``, ``bucket_cap_mb`` in MiB, ``static_graph``, ``broadcast_buffers``,
            ``process_group`` (a group, or a zero-argument callable that builds one after launch), ...).

    Raises:
        ValueError: unknown ``start_method``, ``process_group_backend`` or ``init_method``, a non-positive
            ``timeout`` or ``monitored_barrier_timeout``, ``verify_sync_every_n_steps < 1``; at Trainer
            construction: ``"nccl"`` on CPU, or a bad launch variable
            (``MASTER_PORT``, ``LOCAL_RANK``, ``NODE_RANK``, ``WORLD_SIZE``, ``RANK``; see
            :func:`ddp_strategy.process.launching.check_launch_env`).
        TypeError: an unknown DDP option, or an argument of the wrong type (a ``timeout`` that is not a number
            or ``timedelta``, ``seed="1"``, ``init_method=5``, ...; see
            :func:`ddp_strategy.options.check_strategy_arguments`). The named DDP flags
            (``find_unused_parameters``, ...) accept any value as Lightning does, with a warning if not a bool.
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
        init_method: str | None = None,
        store: dist.Store | None = None,
        allow_cpu_oversubscription: bool = False,
        monitored_barrier_timeout: float | timedelta | None = None,
        checkpoint_on_sigterm: bool | str | os.PathLike = False,
        ddp_comm_hook: comm_hooks.CommHook | str | None = None,
        ddp_comm_state: Any = None,
        ddp_comm_wrapper: Any = None,
        verify_sync_every_n_steps: int | None = None,
        exact_evaluation: bool = True,
        find_unused_parameters: bool = False,
        static_graph: bool = False,
        gradient_as_bucket_view: bool = False,
        bucket_cap_mb: float | None = None,
        broadcast_buffers: bool = True,
        **ddp_kwargs: Any,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        argument_checks.check_strategy_arguments(
            process_group_backend, start_method, seed, init_method, store, allow_cpu_oversubscription,
            checkpoint_on_sigterm, verify_sync_every_n_steps, bucket_cap_mb,
            {"find_unused_parameters": find_unused_parameters, "static_graph": static_graph,
             "gradient_as_bucket_view": gradient_as_bucket_view, "broadcast_buffers": broadcast_buffers})
        if start_method is not None and start_method not in START_METHODS:
            raise ValueError(f"Unknown start_method={start_method!r}; use one of {list(START_METHODS)} or None.")
        process_group.validate_backend_name(process_group_backend)
        self._process_group_backend = process_group_backend
        self._timeout = process_group.as_timedelta(timeout)
        self._start_method: StartMethod = start_method or default_start_method()
        self._seed = seed
        process_group.validate_init_method(init_method)
        if store is not None and self._start_method in ("spawn", "forkserver"):
            raise ValueError(
                f"store= cannot be used with start_method={self._start_method!r}: a Store cannot be pickled to the"
                " new processes. Use start_method='fork' or 'popen' (with a FileStore path every process opens),"
                " or init_method='file:///path' instead."
            )
        self._init_method = init_method
        self._store = store
        self._allow_cpu_oversubscription = allow_cpu_oversubscription
        self._barrier_timeout = (self._timeout if monitored_barrier_timeout is None
                                 else process_group.as_timedelta(monitored_barrier_timeout))
        self._checkpoint_on_sigterm = checkpoint_on_sigterm
        self._rendezvous_store: dist.Store | None = None
        self._undo_gloo_loopback: Callable[[], None] = _no_op
        self._barrier_group: Any = None
        self._node_group: Any = None
        self._node_ranks: list[int] = []
        named = {"find_unused_parameters": find_unused_parameters, "static_graph": static_graph,
                 "gradient_as_bucket_view": gradient_as_bucket_view, "bucket_cap_mb": bucket_cap_mb,
                 "broadcast_buffers": broadcast_buffers}
        self._ddp_kwargs = wrapping.validate_ddp_kwargs({**wrapping.non_default_options(named), **ddp_kwargs})
        self._num_nodes = 1
        self._sampler_seed = sampler.shared_seed(seed)
        self._trainer: Trainer | None = None
        self._use_distributed_sampler = True
        self._written_checkpoints: dict[str, tuple[int, int]] = {}
        self._forward_redirection = wrapping.DDPForwardRedirection()
        self._eval_guard = evaluation.EvaluationStepGuard()
        self._warned_padded_gather = False
        self._pending_positions: list[dict[str, Any]] = []
        self._run_failed = False
        self._own_failure = False
        self._comm_hook = comm_hooks.CommHookConfig(ddp_comm_hook, ddp_comm_state, ddp_comm_wrapper)
        self._verify_sync_every_n_steps = verify_sync_every_n_steps
        self._exact_evaluation = exact_evaluation
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
    def node_group(self) -> Any:
        """The intra-node process group of this rank (the world group on one node); None before setup."""
        return self._node_group

    @property
    def node_ranks(self) -> list[int]:
        """Global ranks on this rank's node, e.g. ``[2, 3]`` for node 1 of 2 with 2 devices each."""
        return list(self._node_ranks)

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
        """Tell the cluster environment and Lightning's rank-zero helpers this process's global rank.

        Lightning calls this in ``Trainer(...)``, before launching: the launch variables (``MASTER_PORT``,
        ``LOCAL_RANK``, ``NODE_RANK``, ``WORLD_SIZE``, ``RANK``) are checked here first, on every rank.

        Raises:
            ValueError: a launch variable is empty, not an integer or out of range (see
                :func:`ddp_strategy.process.launching.check_launch_env`).
        """
        if self.cluster_environment is not None:
            launching.check_launch_env(self.cluster_environment, self.num_nodes, self.num_processes)
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    # ------------------------------------------------------------------------- 1. launch + process group
    @override
    def _configure_launcher(self) -> None:
        # Runs in Trainer(...), before any process starts: refuse impossible set-ups here, not in a child.
        assert self.cluster_environment is not None and self.parallel_devices
        process_group.resolve_backend(self.parallel_devices[0], self._process_group_backend)
        if self.parallel_devices[0].type == "cpu" and not self.cluster_environment.creates_processes_externally:
            launching.check_cpu_processes(self.num_processes, self._allow_cpu_oversubscription)
        if self._start_method == "popen":
            self._launcher = _pl.SubprocessScriptLauncher(self.cluster_environment, self.num_processes,
                                                          self.num_nodes)
        else:
            self._launcher = launching.CheckedMultiProcessingLauncher(self, start_method=self._start_method)

    @override
    def setup_environment(self) -> None:
        """Set the device up, then join the process group (every rank, before any model code runs).

        Each call is a new rendezvous (a new stage, fit or torchrun attempt), kept apart from earlier ones; on
        one node gloo and the store listen on loopback only (see :func:`process_group.init_process_group`).
        """
        reset_seed()
        self.set_world_ranks()
        assert self.cluster_environment is not None
        launching.check_external_world(self.cluster_environment, self.num_nodes, self.num_processes)
        super().setup_environment()
        backend = process_group.resolve_backend(self.root_device, self._process_group_backend)
        process_group.release_kept_process_group()
        self._run_failed = self._own_failure = False
        self._undo_gloo_loopback = process_group.gloo_on_loopback(self.num_nodes)
        self._rendezvous_store = process_group.init_process_group(
            backend,
            rank=self.global_rank,
            world_size=self.world_size,
            main_address=self.cluster_environment.main_address,
            main_port=self.cluster_environment.main_port,
            timeout=self._timeout,
            device=self.root_device,
            init_method=self._init_method,
            store=self._store,
            num_nodes=self.num_nodes,
        )
        self._process_group_backend = backend
        self._node_group, self._node_ranks = process_group.build_node_groups(self.num_nodes, self.num_processes)
        if isinstance(self._launcher, _pl.SubprocessScriptLauncher):
            launching.wait_for_ranks_at_exit(self._launcher.procs)
        failures.register_rank(self._rendezvous_store, self.global_rank)
        # monitored_barrier is gloo-only: NCCL jobs get a small gloo side group for it.
        self._barrier_group = None if backend == "gloo" else dist.new_group(backend="gloo")
        rank_zero_info(f"MyDDPStrategy: {self.world_size} processes, backend={backend},"
                       f" start_method={self._start_method}")

    # --------------------------------------------------------------------------------- 3. DDP wrapping
    @override
    def setup(self, trainer: Trainer) -> None:
        """Move the module to the device and, when fitting, wrap it in DDP and create the optimizers."""
        self._trainer = trainer
        predicting = trainer.state.fn == TrainerFn.PREDICTING
        self._use_distributed_sampler = _pl.set_lightning_sampler_injection(trainer, enabled=predicting)
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
            if not any(isinstance(cb, failures.EpochBoundaryCheck) for cb in trainer.callbacks):
                trainer.callbacks.append(failures.EpochBoundaryCheck(
                    self._barrier_group, self._barrier_timeout, self.global_rank, self.world_size))
            if not any(isinstance(cb, failures.RequeueAtStepBoundary) for cb in trainer.callbacks):
                trainer.callbacks.append(failures.RequeueAtStepBoundary(self._barrier_group, self.world_size))
            wrapping.check_trainable(self.model)
            self._check_checkpoint_dirs(trainer)
            ddp_kwargs = wrapping.resolve_process_group(self._ddp_kwargs)
            self.model = wrapping.wrap_module(self.model, self.root_device, ddp_kwargs)
            comm_hooks.register_comm_hook(self.model, self._comm_hook, dist.get_backend())
            self._check_unused_after_backward = wrapping.needs_unused_parameter_check(self._ddp_kwargs)
            self._optimizer_steps = 0
            self.setup_optimizers(trainer)
        else:
            wrapping.broadcast_module_states(self.model, buffers=self._ddp_kwargs.get("broadcast_buffers", True))
        self.setup_precision_plugin()

    def _check_checkpoint_dirs(self, trainer: Trainer) -> None:
        """Before the first step: can rank 0 write to every ``ModelCheckpoint`` folder? Warn at once if not.

        Only rank 0 writes checkpoints, so it checks (leaving no trace). A warning, not an error: Lightning's
        ``ddp`` runs such a fit and fails only at the first save, and a fit that never saves there succeeds;
        the warning names the folder minutes or hours before that save would fail.
        """
        if self.is_global_zero:
            problem = checkpoint_io.unwritable_reason([cb.dirpath for cb in trainer.checkpoint_callbacks
                                                       if getattr(cb, "dirpath", None)])
            if problem:
                rank_zero_warn(f"{problem} The first checkpoint saved there will fail; fix the folder now.")

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
        if self._fit_record is not None:
            self._fit_record.tracker.prune()
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
        """Give ``dataloader`` a distributed sampler that keeps its order semantics and tracks the epoch.

        With ``Trainer(use_distributed_sampler=False)`` every loader is left as it is, in every stage, as
        Lightning does (the user shards the data); the ranks still agree on their evaluation batch counts,
        and training batch counts are compared at each epoch's start, so uneven shards fail clearly.
        Anything other than a ``DataLoader`` (a list of batches, a custom iterable) and a ``DataLoader`` over
        an ``IterableDataset`` cannot be sharded: every rank reads all of it, as under Lightning's ``ddp``,
        and rank 0 warns once.

        Training loaders are padded so every rank takes the same number of steps, and resume from the
        checkpoint's sampler position if there is one; validation and test loaders are not padded, so each
        sample is evaluated exactly once, yet hold the same number of batches on every rank
        (:func:`ddp_strategy.sampling.evaluation.shard_for_evaluation`; Lightning's padded shards with
        ``exact_evaluation=False``), and the ranks agree on their batch counts (a collective). Predict loaders
        are sharded by Lightning's ``UnrepeatedDistributedSamplerWrapper`` (each sample once, and Lightning's
        prediction batch indices keep working).
        """
        trainer = self._trainer
        if trainer is None:
            return dataloader
        training = trainer.state.stage == RunningStage.TRAINING
        if not self._use_distributed_sampler:
            # Trainer(use_distributed_sampler=False): the user shards the data; as Lightning does, leave it be.
            if not training:
                evaluation.agree_batch_counts(dataloader)
            return dataloader
        injection.warn_if_not_shardable(dataloader, self.world_size)
        if trainer.state.fn == TrainerFn.PREDICTING:
            evaluation.agree_batch_counts(dataloader)
            return dataloader

        def epoch_fn() -> int:
            return trainer.fit_loop.epoch_progress.current.processed

        if training:
            dataloader = injection.inject_distributed_sampler(dataloader, num_replicas=self.world_size,
                                                              rank=self.global_rank, seed=self._sampler_seed,
                                                              epoch_fn=epoch_fn, pad=True)
            resume.hand_over_position(dataloader, self._pending_positions)
        else:
            stage = "test" if trainer.state.stage == RunningStage.TESTING else "validation"
            if self._exact_evaluation:
                dataloader = evaluation.shard_for_evaluation(dataloader, self.world_size, self.global_rank,
                                                             self._sampler_seed, epoch_fn, stage)
            else:
                dataloader = injection.inject_distributed_sampler(dataloader, num_replicas=self.world_size,
                                                                  rank=self.global_rank, seed=self._sampler_seed,
                                                                  epoch_fn=epoch_fn, pad=True, training=False)
            evaluation.agree_batch_counts(dataloader)
        return dataloader

    @override
    def on_validation_start(self) -> None:
        """While fitting with ``broadcast_buffers=True``, give every rank rank 0's buffers before validating.

        DDP broadcasts buffers (BatchNorm running statistics) at the start of each *training* forward, so
        after the last training step each rank holds its own update; Lightning's ddp re-broadcasts them in
        every validation step, which it routes through DDP's forward. Validation steps here call the module
        directly, so the broadcast happens once, here: every rank then validates the model rank 0 saves. A
        collective, on every rank; nothing happens with ``broadcast_buffers=False`` (per-rank buffers stay).
        """
        super().on_validation_start()
        if isinstance(self.model, DistributedDataParallel) and self._ddp_kwargs.get("broadcast_buffers", True):
            wrapping.broadcast_buffers(self.model.module)

    @override
    def on_validation_end(self) -> None:
        """Forget the stage's uneven batch counts (kept until then for the error of a collective that fails)."""
        super().on_validation_end()
        self._eval_guard.last_uneven = None

    @override
    def on_test_end(self) -> None:
        """As :meth:`on_validation_end`."""
        super().on_test_end()
        self._eval_guard.last_uneven = None

    @override
    def on_predict_end(self) -> None:
        """As :meth:`on_validation_end`."""
        super().on_predict_end()
        self._eval_guard.last_uneven = None

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        """Call the LightningModule directly, not through DDP's forward (its buffer broadcast is done once per
        validation run by :meth:`on_validation_start`); a strategy collective is refused on uneven loaders."""
        assert self.lightning_module is not None
        guard = evaluation.step_guard(self._trainer, self._eval_guard, "validation_step", args, kwargs)
        with self.precision_plugin.val_step_context(), guard:
            return self.lightning_module.validation_step(*args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        """Call the LightningModule directly, as :meth:`validation_step` does."""
        assert self.lightning_module is not None
        guard = evaluation.step_guard(self._trainer, self._eval_guard, "test_step", args, kwargs)
        with self.precision_plugin.test_step_context(), guard:
            return self.lightning_module.test_step(*args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        """Call the LightningModule's ``predict_step``, refusing per-step collectives on uneven shards."""
        with evaluation.step_guard(self._trainer, self._eval_guard, "predict_step", args, kwargs):
            return super().predict_step(*args, **kwargs)

    # ------------------------------------------------------------------------------------- collectives
    @override
    def barrier(self, name: str | None = None) -> None:
        """Wait for every rank (a collective); a no-op without a process group."""
        self._eval_guard.check("barrier", self.global_rank)
        if not dist.is_initialized():
            return
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=wrapping.ddp_device_ids(self.root_device))
        else:
            dist.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Return rank ``src``'s ``obj`` on every rank (a collective; pickles ``obj``)."""
        self._eval_guard.check("broadcast", self.global_rank)
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
        self._eval_guard.check("reduce (e.g. self.log(..., on_step=True, sync_dist=True))", self.global_rank)
        if group is not None:
            raise ValueError("MyDDPStrategy.reduce only reduces over the world process group; pass group=None.")
        if not isinstance(tensor, Tensor):
            return tensor
        return process_group.all_reduce(tensor, op=reduce_op or "mean")

    # ------------------------------------------------------------------------------------ 4. checkpoints
    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The LightningModule's state dict without DDP ``module.`` or torch.compile ``_orig_mod.`` segments."""
        assert self.lightning_module is not None
        return checkpoint_io.unwrapped_state_dict(self.lightning_module)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Global rank 0 writes the file (atomically); every rank returns once it is complete.

        A collective (Lightning calls it on every rank): every rank's sampler position is gathered into the
        checkpoint first, and the ranks then agree on success, so a failed write raises on every rank
        instead of leaving the others waiting.
        """
        if self._trainer is not None:
            resume.add_sampler_positions(self._trainer, checkpoint)
        error = None
        if self.is_global_zero:
            try:
                self.checkpoint_io.save_checkpoint(checkpoint, filepath, storage_options=storage_options)
            except Exception as e:
                error = e
        self._raise_on_every_rank(error, f"saving checkpoint {filepath}")
        stamp = checkpoint_io.file_stamp(filepath)
        if stamp is not None:
            self._written_checkpoints[stamp[0]] = stamp[1]

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        """Global rank 0 removes the file; a collective, like :meth:`save_checkpoint`."""
        error = None
        stamp = checkpoint_io.file_stamp(filepath)
        if stamp is not None:
            self._written_checkpoints.pop(stamp[0], None)
        if self.is_global_zero:
            try:
                self.checkpoint_io.remove_checkpoint(filepath)
            except Exception as e:
                error = e
        self._raise_on_every_rank(error, f"removing checkpoint {filepath}")

    def _raise_on_every_rank(self, error: Exception | None, what: str) -> None:
        """Broadcast rank 0's outcome (a collective, so also a barrier); raise on every rank if it failed."""
        message = self.broadcast(None if error is None else f"{type(error).__name__}: {error}")
        if error is not None:
            raise error
        if message is not None:
            raise RuntimeError(f"[rank {self.global_rank}] global rank 0 failed {what}: {message}")

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Every rank reads the file and keeps its sampler positions for the training loaders built next.

        ``weights_only=None`` (what Lightning passes unless the user gave a value) means True (see
        :class:`DDPCheckpointIO`), except for a file this strategy itself saved in this process and that is
        unchanged since (same size and modification time): it is trusted and loaded with False, so Lightning's
        internal restores (``Tuner.lr_find``'s temporary checkpoint, ``ckpt_path="best"``), which the user
        cannot pass ``weights_only`` to, work whatever the checkpoint holds (an ``nn.Module`` among the
        hyper-parameters; Lightning's ddp fails there with a raw unpickling error).

        Raises:
            UnsafeCheckpointError: a file from elsewhere holds an object ``weights_only=True`` refuses; the
                message names it and the opt-outs that work here.
        """
        self._checkpoint_path = checkpoint_path
        stamp = checkpoint_io.file_stamp(checkpoint_path)
        if weights_only is None and stamp is not None and self._written_checkpoints.get(stamp[0]) == stamp[1]:
            # This strategy wrote the file (unchanged since): Lightning's internal restores (the LR finder's
            # temporary checkpoint, ckpt_path="best"/"last") load it whatever it holds.
            weights_only = False
        checkpoint = _pl.call_with_weights_only(super().load_checkpoint, checkpoint_path, weights_only=weights_only)
        entry = checkpoint.get(sampler_state.CHECKPOINT_KEY)
        try:
            self._pending_positions = list(sampler_state.loader_positions(entry)) if entry is not None else []
        except ValueError as e:  # Lightning's ddp loads a file with an entry it does not know: so do we
            rank_zero_warn(f"{e} It is ignored: the checkpoint loads, and a mid-epoch resume restarts the"
                           " epoch's data as under Lightning's ddp.")
            self._pending_positions = []
        return checkpoint

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Load weights with keys matched exactly to the LightningModule's, wrapper prefixes or not.

        Raises:
            StateDictMismatchError: ``strict`` (``LightningModule.strict_loading``, default True) and keys
                are missing or unexpected; raised on every rank, since every rank loads the same file. In a
                fit the message adds how to start from the matching weights (the optimizer state of the
                file cannot be resumed into another set of parameters).
        """
        assert self.lightning_module is not None
        try:
            state_dict = checkpoint_io.match_state_dict(checkpoint["state_dict"], self.lightning_module,
                                                        strict=strict, source=getattr(self, "_checkpoint_path", None))
        except checkpoint_io.StateDictMismatchError as e:
            if self._fitting_module():
                # strict_loading=False would pass here, but fit(ckpt_path=...) then restores the optimizer,
                # which needs exactly the checkpoint's parameters: say what works in a fit.
                failures.augment_message(e, checkpoint_io.FIT_MISMATCH_HINT)
            raise
        self.lightning_module.load_state_dict(state_dict, strict=strict)

    def _fitting_module(self) -> bool:
        """Whether the LightningModule's trainer is fitting (the strategy's own trainer is set only later, in
        :meth:`setup`, after Lightning restored a ``ckpt_path``)."""
        try:
            trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        except RuntimeError:  # not attached to a trainer
            return False
        return trainer is not None and trainer.state.fn == TrainerFn.FITTING

    # ------------------------------------------------------------------------------------- diagnostics
    #: Set by ``on_train_start``, consumed by ``on_train_end`` (see :mod:`ddp_strategy.diagnostics.summary`).
    _fit_record: diagnostics.FitRecord | None = None

    @override
    def on_train_start(self) -> None:
        """Every rank: restore a mid-epoch batch counter; rank 0: remove temporary files that killed checkpoint
        writers left, log the fit summary and batch-size warnings; every rank: start tracking which parameters
        get gradients. No collective."""
        super().on_train_start()
        if self._trainer is not None:
            resume.restore_batch_counter(self._trainer, self.world_size)
        if self.is_global_zero and self._trainer is not None:
            for callback in self._trainer.checkpoint_callbacks:
                if getattr(callback, "dirpath", None):
                    checkpoint_io.remove_stale_temp_files(callback.dirpath)
        if self._trainer is not None and isinstance(self.model, DistributedDataParallel):
            self._fit_record = diagnostics.on_fit_start(self._trainer, str(self._process_group_backend),
                                                        self._start_method, self._ddp_kwargs, self.model)

    @override
    def on_train_end(self) -> None:
        """Log the communication summary and never-updated parameters (rank 0). A collective, on every rank."""
        super().on_train_end()
        record, self._fit_record = self._fit_record, None
        if record is not None and isinstance(self.model, DistributedDataParallel):
            diagnostics.on_fit_end(record, self.model, self.root_device)

    # ---------------------------------------------------------------------------------------- failures
    @override
    def on_exception(self, exception: BaseException) -> None:
        """Say which rank failed and why; save a checkpoint on SIGTERM if asked; stop local ranks promptly.

        Runs on each rank that sees an exception. A rank whose own code raised publishes a summary and logs
        its traceback; a rank whose collective broke adds to its message which peer failed (or vanished) or,
        for a timeout, the likely causes. Then the launching process stops the ranks it started, so none is
        left waiting in a collective. The diagnostics' gradient hooks are removed first (no collective:
        other ranks may be gone).
        """
        super().on_exception(exception)
        self._run_failed = True  # teardown then destroys the group: a failed run's group is of no use
        record, self._fit_record = self._fit_record, None
        if record is not None:
            record.tracker.close()
        grace_s = 5.0
        if isinstance(exception, SIGTERMException) and self._checkpoint_on_sigterm and self._trainer is not None:
            path = self._sigterm_checkpoint_path()
            rank_zero_info(f"SIGTERM: saving a checkpoint to {path} before exiting; resume with fit(ckpt_path=...)")
            self._trainer.save_checkpoint(path)
            grace_s = 30.0  # the other ranks are exiting by themselves after the same save
        elif isinstance(exception, (KeyboardInterrupt, SIGTERMException)) or self._rendezvous_store is None:
            pass  # an interruption, or not a rank (the parent of spawned ranks) or one that never joined
        elif isinstance(exception, failures.StalledRankError):
            pass  # already names the missing ranks
        elif failures.is_collective_error(exception):
            peers = failures.describe_peers(self._rendezvous_store, self.global_rank, self.world_size)
            failures.augment_message(exception, failures.explain(exception, self.global_rank, peers, self._timeout,
                                                                 self._eval_guard.describe_uneven()))
            log.error("[rank %d] %s", self.global_rank, exception)  # now: a launcher may stop this rank soon
            failures.acknowledge(self._rendezvous_store, self.global_rank)
        else:
            failures.report_failure(self._rendezvous_store, self.global_rank, exception)
            self._own_failure = True
        launched = self._ranks_launched_here()
        if launched:
            failures.stop_processes(launched, grace_s=grace_s)

    def _ranks_launched_here(self) -> list[Any]:
        """The rank processes this process started (popen's rank 0: the script re-run per rank); else empty."""
        launcher = self._launcher
        return launcher.procs if isinstance(launcher, _pl.SubprocessScriptLauncher) and launcher.procs else []

    def _sigterm_checkpoint_path(self) -> str:
        if isinstance(self._checkpoint_on_sigterm, (str, os.PathLike)):
            return os.fspath(self._checkpoint_on_sigterm)
        assert self._trainer is not None
        return os.path.join(self._trainer.default_root_dir, "sigterm.ckpt")

    @override
    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        """Gather ``tensor`` from every rank: shape ``(W, *shape)``; the first dimension may differ between ranks.

        A collective: every rank calls it (``LightningModule.all_gather`` calls it once per tensor of a
        collection). Equal shapes give exactly Lightning's result (its ``_all_gather_ddp_if_available``:
        ``torch.stack`` of every rank's tensor; the tensor itself without a process group). When only the
        first dimension differs (``n_r`` rows on rank r) the result is ``(W, max n_r, *rest)``, its missing
        rows filled as ``DistributedSampler`` pads a data set (:func:`ddp_strategy.process.collectives.all_gather_padded`):
        for per-sample evaluation outputs that is Lightning's padded result, and rank 0 warns once that
        ``flatten(0, 1)`` then counts some rows twice; :func:`ddp_strategy.process.collectives.all_gather_rows` gives each
        row once. One small extra all-gather (the shapes) per call.

        Raises:
            ValueError: the tensors differ in another dimension (on every rank).
            RuntimeError: inside an evaluation step whose ranks hold different numbers of batches.
        """
        self._eval_guard.check("all_gather", self.global_rank)
        if not dist.is_initialized():
            return super().all_gather(tensor, group=group, sync_grads=sync_grads)
        shapes = gather.gather_shapes(tensor, group)
        if shapes is None or len(set(shapes)) == 1:
            return super().all_gather(tensor, group=group, sync_grads=sync_grads)
        gather.check_gatherable(shapes, self.global_rank)
        sizes = [shape[0] for shape in shapes]
        if not self._warned_padded_gather:
            self._warned_padded_gather = True
            repeats = len(sizes) * max(sizes) - sum(sizes)
            rank_zero_warn(
                f"all_gather got first dimensions {sizes} on ranks 0..{len(sizes) - 1}: the result has"
                f" {max(sizes)} rows per rank, and the {repeats} missing row(s) repeat the first rows, as"
                " DistributedSampler pads a data set. For per-sample evaluation outputs this is what Lightning's"
                " ddp gives (its sampler evaluates those samples twice), so .flatten(0, 1) counts them twice. For"
                " every row exactly once use ddp_strategy.all_gather_rows(tensor), or a torchmetrics metric."
            )
        return gather.all_gather_padded(tensor, sizes, group, sync_grads)

    # --------------------------------------------------------------------------------------- teardown
    @override
    def teardown(self) -> None:
        """Release the DDP wrapper and revert layer syncing; keep the process group for the user's code.

        As under Lightning's ``ddp``, code after ``trainer.fit`` may still call ``torch.distributed``: the group
        of a run that finished stays until the next run's rendezvous, the end of a spawned/forked rank, or
        interpreter exit (:func:`process_group.keep_process_group`); a failed run's group is destroyed here.
        Either way every backend's group is destroyed before its process exits.
        """
        pl_module = self.lightning_module
        if isinstance(self.model, DistributedDataParallel):
            self.model = pl_module
        trainer = self._trainer
        if trainer is not None and trainer.state.fn == TrainerFn.FITTING and self._layer_sync:
            assert self.model is not None
            self.model = self._layer_sync.revert(self.model)
        if self._trainer is not None:
            _pl.set_lightning_sampler_injection(self._trainer, enabled=True)
            for cb in self._trainer.callbacks:
                if isinstance(cb, failures.RequeueAtStepBoundary):
                    cb.restore()
            self._trainer.callbacks[:] = [cb for cb in self._trainer.callbacks if not isinstance(
                cb, (failures.EpochBoundaryCheck, failures.RequeueAtStepBoundary))]
        self._pending_positions = []
        super().teardown()
        self._node_group, self._node_ranks = None, []
        store, self._barrier_group, self._rendezvous_store = self._rendezvous_store, None, None
        if self._run_failed:
            process_group.destroy_process_group()  # the others' collectives break now, and they explain
            if self._own_failure and not self._ranks_launched_here():
                failures.wait_for_peers(store, self.global_rank, self.world_size)
        else:
            process_group.keep_process_group()
        self._undo_gloo_loopback()
        self._undo_gloo_loopback = _no_op

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

__all__ = ["MyDDPStrategy", "default_start_method", "START_METHODS"]
