"""Process groups: backend choice, initialisation, collectives the strategy needs, and teardown.

Everything here follows ``torch.distributed``'s own documentation
(https://pytorch.org/docs/stable/distributed.html): one default (world) process group per process,
created with :func:`torch.distributed.init_process_group` over the rendezvous of
:mod:`ddp_strategy.process.rendezvous` and destroyed with :func:`torch.distributed.destroy_process_group`.
"""

from __future__ import annotations

import atexit
import gc
import logging
import os
import sys
import weakref
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ddp_strategy.process.rendezvous import generation_store, rendezvous_error, rendezvous_store, uses_agent_store

log = logging.getLogger(__name__)


#: Backends this package knows how to pick for a device type.
DEVICE_BACKENDS: dict[str, str] = {"cuda": "nccl", "cpu": "gloo"}
#: Backends ``torch.distributed`` may provide; which ones are compiled in is asked at run time.
KNOWN_BACKENDS: tuple[str, ...] = ("gloo", "nccl", "mpi", "ucc", "xccl")
#: Default process-group timeout: 30 minutes, Lightning's ``default_pg_timeout``, so that code in which one
#: rank works alone for a long time while the others wait (rank 0 writing a checkpoint of many GiB) runs as
#: under Lightning's ``ddp``. A failed or killed rank does not wait for it: :mod:`ddp_strategy.process.failures` names
#: it and stops the job within seconds. Lower it (``MyDDPStrategy(timeout=...)``) to bound a true stall.
DEFAULT_TIMEOUT = timedelta(minutes=30)


def default_backend(device: torch.device) -> str:
    """Return the process-group backend for ``device``: ``"nccl"`` for CUDA, ``"gloo"`` otherwise.

    This is the choice PyTorch's DDP tutorial recommends (NCCL for GPUs, gloo for CPUs).

    Args:
        device: the device this rank computes on.

    Returns:
        The backend name.
    """
    return DEVICE_BACKENDS.get(device.type, "gloo")


def validate_backend_name(backend: str | None) -> None:
    """Check a user-given backend name before any process starts.

    Args:
        backend: a backend name such as ``"gloo"`` or ``"nccl"``, or ``None`` to choose from the device.

    Raises:
        ValueError: the name is not a backend ``torch.distributed`` knows, or it is not compiled into this
            PyTorch build.
    """
    if backend is None:
        return
    if backend not in KNOWN_BACKENDS:
        raise ValueError(
            f"Unknown process_group_backend={backend!r}. Use one of {list(KNOWN_BACKENDS)}, or leave it as None"
            " to get 'nccl' on CUDA devices and 'gloo' on CPU."
        )
    if not dist.is_backend_available(backend):
        raise ValueError(
            f"process_group_backend={backend!r} is not available in this PyTorch build"
            f" (torch {torch.__version__}). Use 'gloo', or install a PyTorch build with {backend} support."
        )


def resolve_backend(device: torch.device, backend: str | None) -> str:
    """Choose the backend for ``device``, honouring an explicit ``backend`` and refusing impossible pairs.

    Args:
        device: the device this rank computes on.
        backend: the user's choice, or ``None`` for :func:`default_backend`.

    Returns:
        The backend name to pass to :func:`torch.distributed.init_process_group`.

    Raises:
        ValueError: the name is unknown or unavailable (see :func:`validate_backend_name`), or ``"nccl"``
            was asked for on a non-CUDA device (NCCL only moves CUDA tensors).
    """
    if backend == "nccl" and device.type != "cuda":
        raise ValueError(
            f"process_group_backend='nccl' needs CUDA devices, but this rank runs on {device}."
            " Use process_group_backend='gloo' (or None) for CPU training, or Trainer(accelerator='cuda')."
        )
    validate_backend_name(backend)
    return backend or default_backend(device)


def as_timedelta(timeout: float | timedelta) -> timedelta:
    """Convert a timeout given in seconds, or as a ``timedelta``, to a positive ``timedelta``.

    Args:
        timeout: seconds (int or float), or a ``timedelta``.

    Returns:
        The timeout as a ``timedelta``.

    Raises:
        TypeError: ``timeout`` is neither a number nor a ``timedelta``.
        ValueError: ``timeout`` is not positive.
    """
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float, timedelta)):
        raise TypeError(f"timeout must be seconds (a number) or a datetime.timedelta, got {timeout!r}.")
    try:
        delta = timeout if isinstance(timeout, timedelta) else timedelta(seconds=timeout)
    except (ValueError, OverflowError) as e:  # NaN, inf, more than 999999999 days
        raise ValueError(f"timeout must be a finite number of seconds, got {timeout!r}.") from e
    if delta.total_seconds() <= 0:
        raise ValueError(f"timeout must be positive, got {delta.total_seconds()} s.")
    return delta


INIT_METHOD_SCHEMES: tuple[str, ...] = ("env://", "tcp://", "file://")


def validate_init_method(init_method: str | None) -> None:
    """Check an ``init_method`` URL before any process starts.

    Args:
        init_method: ``None`` or ``"env://"`` (rendezvous at ``MASTER_ADDR:MASTER_PORT``, the default),
            ``"tcp://host:port"`` (as in hand-written DDP scripts) or ``"file:///shared/path"``.

    Raises:
        ValueError: any other scheme, or a ``tcp://`` URL without a port.
    """
    if init_method is None:
        return
    if not init_method.startswith(INIT_METHOD_SCHEMES):
        raise ValueError(
            f"init_method={init_method!r} is not supported; use 'env://' (default), 'tcp://host:port' or"
            " 'file:///path/to/shared/file', or pass a torch.distributed Store as store=..."
        )
    if init_method.startswith("tcp://") and not init_method.rsplit(":", 1)[-1].isdigit():
        raise ValueError(f"init_method={init_method!r} has no port; write it as 'tcp://host:port'.")


def init_process_group(
    backend: str,
    rank: int,
    world_size: int,
    main_address: str,
    main_port: int,
    timeout: timedelta,
    device: torch.device | None = None,
    init_method: str | None = None,
    store: dist.Store | None = None,
    num_nodes: int = 1,
) -> dist.Store | None:
    """Join the default (world) process group; return its key-value store.

    The rendezvous is, in order of precedence: a ready ``store`` (a ``FileStore`` needs no port); an
    ``init_method`` URL (``tcp://`` or ``file://``); under torchrun (``TORCHELASTIC_USE_AGENT_STORE=True``)
    the elastic agent's own store at ``MASTER_ADDR:MASTER_PORT``; else ``env://`` with ``MASTER_ADDR`` and
    ``MASTER_PORT`` set from ``main_address`` and ``main_port`` (Lightning's cluster environment provides
    them: 127.0.0.1 and a free port on one machine, or what SLURM set). See
    https://pytorch.org/docs/stable/distributed.html#initialization. Must be called on every rank; it
    returns once all ``world_size`` ranks have joined, or raises after ``timeout``.

    Each call is a new rendezvous that cannot be confused with an earlier one (a previous stage, fit or
    torchrun attempt), whatever the timing:

    * a store rank 0 serves itself (``env://``, ``tcp://``) is new for each call; it listens on 127.0.0.1
      when ``num_nodes == 1``, else only on the address ``main_address`` resolves to (see
      :func:`listen_address`), and a rank that reaches an earlier call's store (rank 0 still tearing it
      down) recognises it by its id and waits for the new one;
    * a store that outlives the call (the torchrun agent's, a given ``store``, a ``file://`` store) is used
      through a key prefix per torchrun attempt (``TORCHELASTIC_RESTART_COUNT``) and per rendezvous in it
      (see :func:`generation_store`).

    Args:
        backend: ``"gloo"`` or ``"nccl"`` (see :func:`resolve_backend`).
        rank: this process's global rank, ``0 <= rank < world_size``.
        world_size: number of processes in the job.
        main_address: host name or IP of rank 0's rendezvous store (``env://`` only).
        main_port: TCP port of rank 0's rendezvous store (``env://`` only).
        timeout: how long the rendezvous and each collective may wait before failing.
        device: for CUDA, this rank's device; passed as ``device_id`` so NCCL initialises eagerly.
        init_method: see :func:`validate_init_method`.
        store: a ready ``torch.distributed.Store`` shared by all ranks.
        num_nodes: number of machines; with 1, the store listens on loopback only. Default 1.

    Returns:
        The rendezvous store (this rendezvous's view of it), or ``None`` when a process group already
        existed and was reused.

    Raises:
        RuntimeError: a process group already exists with a different rank or world size; the rendezvous
            failed (the other ranks did not arrive within ``timeout``, the address is unreachable, or
            rank 0's port is already in use): the message names the address and what to do.
        ValueError: a bad ``init_method`` (see :func:`validate_init_method`).
    """
    if dist.is_initialized():
        if dist.get_rank() != rank or dist.get_world_size() != world_size:
            raise RuntimeError(
                f"A process group already exists with rank {dist.get_rank()} of {dist.get_world_size()},"
                f" but this run needs rank {rank} of {world_size}. Call"
                " torch.distributed.destroy_process_group() before starting another run."
            )
        log.debug("process group already initialised; reusing it")
        return None
    validate_init_method(init_method)
    kwargs: dict = {"rank": rank, "world_size": world_size, "timeout": timeout}
    if device is not None and device.type == "cuda":
        kwargs["device_id"] = device
    agent = store is None and (init_method is None or init_method.startswith("env://")) and uses_agent_store()
    if store is not None:
        where = f"the given {type(store).__name__}"
    elif init_method is not None and init_method.startswith("file://"):
        where = init_method
    elif init_method is not None and init_method.startswith("tcp://"):
        where = init_method
        main_address, port = init_method[len("tcp://"):].rsplit(":", 1)
        main_port = int(port)
    else:
        os.environ["MASTER_ADDR"] = main_address
        os.environ["MASTER_PORT"] = str(main_port)
        where = f"{main_address}:{main_port}" + (" (the torchrun agent's store)" if agent else "")
    log.info("[rank %d] joining process group: backend=%s world_size=%d rendezvous=%s timeout=%.0fs",
             rank, backend, world_size, where, timeout.total_seconds())
    try:
        # The store is made here, as torch's env://, tcp:// and file:// handlers would make it, so that the
        # strategy keeps a handle on it to report failures between ranks (see ddp_strategy.process.failures).
        if store is None and init_method is not None and init_method.startswith("file://"):
            store = generation_store(dist.FileStore(init_method[len("file://"):], world_size), world_size)
        elif store is not None:
            store = generation_store(store, world_size)
        elif agent:
            client = dist.TCPStore(main_address, main_port, None, is_master=False, timeout=timeout)
            store = generation_store(client, world_size, attempt=os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        else:
            store = rendezvous_store(main_address, main_port, rank, timeout, num_nodes)
        _unwrap_torch_excepthook()
        dist.init_process_group(backend, store=store, **kwargs)
        _torch_excepthooks[1:] = [sys.excepthook]
    except (RuntimeError, OSError, ValueError) as e:
        raise RuntimeError(rendezvous_error(rank, world_size, where, timeout, e)) from e
    return store


#: ``sys.excepthook`` as it was before our first process group, then the hook torch installed last.
_torch_excepthooks: list[Any] = []


def _unwrap_torch_excepthook() -> None:
    """Undo the ``[rankN]:`` traceback prefix hook of the previous run's ``init_process_group``.

    ``torch.distributed.init_process_group`` wraps ``sys.excepthook`` on every call; a process that runs several
    stages (each a new rendezvous here) would print ``[rank0]: [rank0]: ...``. The hook torch installed last is
    replaced by the one from before our first group, which the next ``init_process_group`` wraps once.
    """
    if not _torch_excepthooks:
        _torch_excepthooks.append(sys.excepthook)
    elif sys.excepthook is _torch_excepthooks[-1]:
        sys.excepthook = _torch_excepthooks[0]


def node_rank_lists(num_nodes: int, procs_per_node: int) -> list[list[int]]:
    """Global ranks of each node, node-major: node ``n`` holds ``n * P .. n * P + P - 1``.

    This is the layout Lightning's cluster environments and torchrun use
    (``global_rank = node_rank * procs_per_node + local_rank``).

    Example:
        >>> node_rank_lists(2, 3)
        [[0, 1, 2], [3, 4, 5]]
    """
    return [list(range(n * procs_per_node, (n + 1) * procs_per_node)) for n in range(num_nodes)]


def build_node_groups(num_nodes: int, procs_per_node: int) -> tuple[Any, list[int]]:
    """Create the intra-node process groups; return this rank's group and the ranks in it.

    A collective: every rank must call it, right after :func:`init_process_group`. With one node the world
    group is returned (no new group is created).

    Args:
        num_nodes: number of nodes N.
        procs_per_node: processes per node P; ``N * P`` must equal the world size.

    Returns:
        ``(group, ranks)``: the ``ProcessGroup`` of this rank's node and its global ranks.

    Raises:
        ValueError: ``N * P`` differs from the world size of the initialised group.
    """
    world_size = dist.get_world_size()
    if num_nodes * procs_per_node != world_size:
        raise ValueError(f"{num_nodes} nodes x {procs_per_node} processes != world size {world_size}.")
    lists = node_rank_lists(num_nodes, procs_per_node)
    if num_nodes == 1:
        return dist.group.WORLD, lists[0]
    group, _ = dist.new_subgroups_by_enumeration(lists)
    rank = dist.get_rank()
    return group, next(ranks for ranks in lists if rank in ranks)


def destroy_process_group() -> bool:
    """Destroy the default process group if one exists; a no-op otherwise.

    Returns whether the group is gone (``True`` also without one); ``False`` when something still holds it, so
    that, with gloo, its connections stay open until this process exits.

    Called at teardown for every backend: with gloo, a process that exits with its group alive has been
    seen to abort (SIGABRT) now and then. A garbage collection comes first: objects kept alive only by a
    reference cycle (after a ``torch.compile``'d fit, the DDP wrapper, which holds the group, which holds
    rank 0's ``TCPStore``) would otherwise keep ``MASTER_PORT`` listening after this returns, and the next
    fit in the same process could not bind it. Collected first, the group and its store go here.
    """
    global _kept_for_user_code
    _kept_for_user_code = False
    if not (dist.is_available() and dist.is_initialized()):
        return True
    gc.collect()
    world = weakref.ref(dist.group.WORLD)
    dist.destroy_process_group()
    gc.collect()
    return world() is None


#: Whether the default process group is one that a finished run left for the user's code.
_kept_for_user_code = False
_exit_hook_registered = False


def keep_process_group() -> None:
    """After a run that finished: leave the default process group for the user's code, as Lightning's ddp does.

    Code after ``trainer.fit(...)`` may call ``torch.distributed`` (``dist.get_rank()``, an ``all_reduce`` of
    results, a ``barrier`` before rank 0 writes a file): under Lightning's ``DDPStrategy`` the group outlives
    the run, so it does here. It is destroyed, for every backend, by the next run's
    :func:`release_kept_process_group` (each run has its own rendezvous), at interpreter exit (an ``atexit``
    hook), or when a spawned or forked rank's work ends
    (:mod:`ddp_strategy.process.launching`). A no-op without a group.
    """
    global _kept_for_user_code, _exit_hook_registered
    if not (dist.is_available() and dist.is_initialized()):
        return
    _kept_for_user_code = True
    if not _exit_hook_registered:
        atexit.register(destroy_process_group)
        _exit_hook_registered = True


def release_kept_process_group() -> None:
    """Destroy the group a finished run kept (:func:`keep_process_group`); leave any other group alone.

    Called before each rendezvous, so a new run never reuses the previous run's group (its store, ranks and
    timeout), while a group the user made (or Lightning's own ``ddp`` left) is still reused as before.
    """
    if _kept_for_user_code:
        destroy_process_group()


def device_ids(device: torch.device) -> list[int] | None:
    """``device_ids`` for DDP and NCCL's barrier: ``[index]`` for a CUDA device, ``None`` for CPU."""
    return [device.index if device.index is not None else 0] if device.type == "cuda" else None


def all_reduce(tensor: torch.Tensor, op: str = "mean") -> torch.Tensor:
    """Return ``tensor`` reduced over all ranks; the input is left unchanged.

    A collective: every rank must call it, with tensors of the same shape and dtype. Every rank gets the
    same result. Without a process group (world size 1) the result is a copy of ``tensor``.

    Args:
        tensor: any shape; on the device the backend supports (CPU for gloo, CUDA for NCCL).
        op: ``"mean"`` (``"avg"``), ``"sum"``, ``"max"`` or ``"min"``, or the matching
            ``torch.distributed.ReduceOp``. A mean of an integer tensor is returned as float32.

    Returns:
        A new tensor of the same shape.

    Raises:
        ValueError: ``op`` is not one of the names above.
    """
    ops = {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM,
           "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
    name = (op.name if hasattr(op, "name") else str(op)).lower()
    if name not in ops:
        raise ValueError(f"Unsupported reduce op {op!r}; use one of {sorted(ops)}.")
    result = tensor.clone()
    if name in ("mean", "avg") and not result.is_floating_point():
        result = result.float()
    if not (dist.is_available() and dist.is_initialized()):
        return result
    dist.all_reduce(result, op=ops[name])
    if name in ("mean", "avg"):
        result /= dist.get_world_size()
    return result
