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

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

#: Backends this package knows how to pick for a device type.
DEVICE_BACKENDS: dict[str, str] = {"cuda": "nccl", "cpu": "gloo"}
#: Backends ``torch.distributed`` may provide; which ones are compiled in is asked at run time.
KNOWN_BACKENDS: tuple[str, ...] = ("gloo", "nccl", "mpi", "ucc", "xccl")
#: Default process-group timeout (30 minutes, PyTorch's own default for gloo).
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
    delta = timeout if isinstance(timeout, timedelta) else timedelta(seconds=timeout)
    if delta.total_seconds() <= 0:
        raise ValueError(f"timeout must be positive, got {delta.total_seconds()} s.")
    return delta


def init_process_group(
    backend: str,
    rank: int,
    world_size: int,
    main_address: str,
    main_port: int,
    timeout: timedelta,
    device: torch.device | None = None,
) -> None:
    """Join the default (world) process group through the ``env://`` rendezvous.

    Sets ``MASTER_ADDR`` and ``MASTER_PORT`` from the arguments (Lightning's cluster environment provides
    them: 127.0.0.1 and a free port on one machine), then calls
    :func:`torch.distributed.init_process_group`. Must be called on every rank; it returns once all
    ``world_size`` ranks have joined, or raises after ``timeout``.

    Args:
        backend: ``"gloo"`` or ``"nccl"`` (see :func:`resolve_backend`).
        rank: this process's global rank, ``0 <= rank < world_size``.
        world_size: number of processes in the job.
        main_address: host name or IP of rank 0's rendezvous store.
        main_port: TCP port of rank 0's rendezvous store.
        timeout: how long collectives (and the rendezvous) may wait before failing.
        device: for CUDA, this rank's device; it is passed as ``device_id`` so NCCL initialises eagerly.

    Raises:
        RuntimeError: a process group already exists with a different rank or world size.
    """
    if dist.is_initialized():
        if dist.get_rank() != rank or dist.get_world_size() != world_size:
            raise RuntimeError(
                f"A process group already exists with rank {dist.get_rank()} of {dist.get_world_size()},"
                f" but this run needs rank {rank} of {world_size}. Call"
                " torch.distributed.destroy_process_group() before starting another run."
            )
        log.debug("process group already initialised; reusing it")
        return
    os.environ["MASTER_ADDR"] = main_address
    os.environ["MASTER_PORT"] = str(main_port)
    kwargs = {}
    if device is not None and device.type == "cuda":
        kwargs["device_id"] = device
    log.info(
        "[rank %d] joining process group: backend=%s world_size=%d address=%s:%d timeout=%.0fs",
        rank, backend, world_size, main_address, main_port, timeout.total_seconds(),
    )
    dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world_size, timeout=timeout, **kwargs)


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
