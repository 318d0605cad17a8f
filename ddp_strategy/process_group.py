"""Process groups: backend choice, initialisation, collectives the strategy needs, and teardown.

Everything here follows ``torch.distributed``'s own documentation
(https://pytorch.org/docs/stable/distributed.html): one default (world) process group per process,
created with :func:`torch.distributed.init_process_group` over the ``env://`` rendezvous and destroyed
with :func:`torch.distributed.destroy_process_group`.
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

#: Backends this package knows how to pick for a device type.
DEVICE_BACKENDS: dict[str, str] = {"cuda": "nccl", "cpu": "gloo"}
#: Backends ``torch.distributed`` may provide; which ones are compiled in is asked at run time.
KNOWN_BACKENDS: tuple[str, ...] = ("gloo", "nccl", "mpi", "ucc", "xccl")
#: Default process-group timeout: 5 minutes, far shorter than PyTorch's 30 (gloo) or 10 (NCCL), so a stalled
#: rank costs minutes, not half an hour. Raise it (``MyDDPStrategy(timeout=...)``) when rank 0 alone does
#: long work while the others wait, e.g. writing a checkpoint of many GiB.
DEFAULT_TIMEOUT = timedelta(minutes=5)


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
) -> dist.Store | None:
    """Join the default (world) process group; return its key-value store.

    The rendezvous is, in order of precedence: a ready ``store`` (a ``FileStore`` needs no port); an
    ``init_method`` URL (``tcp://`` or ``file://``); else ``env://`` with ``MASTER_ADDR`` and
    ``MASTER_PORT`` set from ``main_address`` and ``main_port`` (Lightning's cluster environment provides
    them: 127.0.0.1 and a free port on one machine, or what torchrun/SLURM set). See
    https://pytorch.org/docs/stable/distributed.html#initialization. Must be called on every rank; it
    returns once all ``world_size`` ranks have joined, or raises after ``timeout``.

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

    Returns:
        The rendezvous store (a ``TCPStore``, ``FileStore`` or the given one), or ``None`` when a process
        group already existed and was reused.

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
        where = f"{main_address}:{main_port}"
    log.info("[rank %d] joining process group: backend=%s world_size=%d rendezvous=%s timeout=%.0fs",
             rank, backend, world_size, where, timeout.total_seconds())
    try:
        # The store is made here, as torch's env://, tcp:// and file:// handlers would make it, so that the
        # strategy keeps a handle on it to report failures between ranks (see ddp_strategy.failures).
        if store is None and init_method is not None and init_method.startswith("file://"):
            store = dist.FileStore(init_method[len("file://"):], world_size)
        elif store is None:
            store = dist.TCPStore(main_address, main_port, world_size, is_master=rank == 0, timeout=timeout)
        dist.init_process_group(backend, store=store, **kwargs)
    except (RuntimeError, OSError, ValueError) as e:
        raise RuntimeError(_rendezvous_error(rank, world_size, where, timeout, e)) from e
    return store


def _rendezvous_error(rank: int, world_size: int, where: str, timeout: timedelta, error: BaseException) -> str:
    text = str(error)
    if "address already in use" in text.lower() or "EADDRINUSE" in text:
        return (f"[rank {rank}] cannot start the rendezvous at {where}: the port is already in use by another"
                " process. Choose another MASTER_PORT, or unset it so a free port is picked.")
    return (f"[rank {rank}] could not join the process group at {where} (world size {world_size}) within"
            f" {timeout.total_seconds():.0f} s: {text.splitlines()[0] if text else type(error).__name__}. Check"
            " that MASTER_ADDR is reachable from every node, that rank 0 started, and that all ranks use the"
            " same address and port.")


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


def destroy_process_group() -> None:
    """Destroy the default process group if one exists; a no-op otherwise.

    Called at teardown for every backend: with gloo, a process that exits with its group alive has been
    seen to abort (SIGABRT) now and then.
    """
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


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
