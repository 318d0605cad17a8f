"""Process groups: backend choice, initialisation, collectives the strategy needs, and teardown.

Everything here follows ``torch.distributed``'s own documentation
(https://pytorch.org/docs/stable/distributed.html): one default (world) process group per process,
created with :func:`torch.distributed.init_process_group` over the ``env://`` rendezvous and destroyed
with :func:`torch.distributed.destroy_process_group`. The rendezvous store is made here rather than by
torch's handlers, so that every rendezvous (stage, fit, torchrun attempt) is kept apart from the earlier
ones, and so that on one node nothing listens beyond loopback.
"""

from __future__ import annotations

import atexit
import errno
import gc
import ipaddress
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

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
        dist.init_process_group(backend, store=store, **kwargs)
    except (RuntimeError, OSError, ValueError) as e:
        raise RuntimeError(_rendezvous_error(rank, world_size, where, timeout, e)) from e
    return store


def uses_agent_store() -> bool:
    """Whether torchrun's elastic agent serves the rendezvous store (``TORCHELASTIC_USE_AGENT_STORE=True``).

    torchrun then sets ``MASTER_ADDR``/``MASTER_PORT`` to the agent's store, which lives across worker
    restarts; a worker must connect to it as a client and keep each attempt's keys apart, as torch's
    ``env://`` handler does (``torch/distributed/rendezvous.py``).
    """
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)


_SERVER_ID_KEY = "ddp_strategy/server_id"
#: Per (host, port): the id of the store server this process last joined there. A server with that id is an
#: earlier rendezvous's, still alive because rank 0 has not finished tearing it down.
_joined_servers: dict[tuple[str, int], str] = {}
#: Ports this process has served a store on: a bind that fails there may be our own previous server closing.
_served_ports: set[int] = set()
#: Pause between two tries to reach a new store (seconds).
_RETRY_S = 0.05


def generation_store(store: dist.Store, world_size: int, attempt: str | None = None) -> dist.PrefixStore:
    """This rendezvous's view of a store that outlives it: a key prefix per attempt and per rendezvous.

    A store shared by several rendezvous (the torchrun agent's across restarts and stages, a ``FileStore``
    across ``fit`` and ``test``) still holds the earlier ones' keys, among them the ranks' old gloo
    addresses. Every rank adds 1 to a counter in the store; rendezvous number ``g = (n - 1) // world_size``
    (``n``: the value it got) is the same on every rank without any race, because no rank can start
    rendezvous ``g + 1`` before all ranks have joined rendezvous ``g``.

    Args:
        store: the shared store.
        world_size: number of ranks joining each rendezvous.
        attempt: torchrun's ``TORCHELASTIC_RESTART_COUNT``, or ``None`` outside torchrun.

    Returns:
        A ``PrefixStore`` over ``store``: keys go under ``ddp_strategy/attempt_<a>/world_<W>/rendezvous_<g>/``
        (under torchrun: an elastic membership change re-forms the group with a new size ``W`` without counting
        an attempt) or ``ddp_strategy/rendezvous_<g>/``.
    """
    base = "ddp_strategy" if attempt is None else f"ddp_strategy/attempt_{attempt}"
    if attempt is not None:  # torchrun may re-form the group with another size without counting an attempt
        base = f"{base}/world_{world_size}"
    generation = (store.add(f"{base}/joins", 1) - 1) // world_size
    log.debug("rendezvous %d (attempt %s) in a shared store", generation, attempt)
    return dist.PrefixStore(f"{base}/rendezvous_{generation}", store)


def listen_address(main_address: str, num_nodes: int) -> str:
    """Where rank 0's store listens: loopback on one node, else the interface of ``main_address``.

    Args:
        main_address: ``MASTER_ADDR`` (a host name or IP).
        num_nodes: number of machines.

    Returns:
        ``"127.0.0.1"`` when ``num_nodes == 1``; else the IP ``main_address`` resolves to here; ``""`` (every
        interface, with a warning) when that is a loopback address (a host name that ``/etc/hosts`` maps to
        127.0.1.1 on rank 0's own machine: other nodes could not connect) or cannot be resolved.
    """
    if num_nodes == 1:
        return "127.0.0.1"
    try:
        ip = socket.getaddrinfo(main_address, None, type=socket.SOCK_STREAM)[0][4][0]
    except OSError as e:
        log.warning("MASTER_ADDR=%s cannot be resolved here (%s): the rendezvous store listens on every"
                    " interface", main_address, e)
        return ""
    if ipaddress.ip_address(ip).is_loopback:
        log.warning("MASTER_ADDR=%s resolves to the loopback address %s on rank 0's machine, but the job has %d"
                    " nodes: the rendezvous store listens on every interface. Set MASTER_ADDR to the address"
                    " other nodes reach this one by.", main_address, ip, num_nodes)
        return ""
    return ip


def _listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` and listening (``""``: every interface, IPv4 and IPv6)."""
    if host:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    else:
        family = socket.AF_INET6 if socket.has_ipv6 else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6 and not host:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind((host, port))
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return sock


def rendezvous_store(main_address: str, main_port: int, rank: int, timeout: timedelta,
                     num_nodes: int = 1) -> dist.TCPStore:
    """A new ``TCPStore`` for one rendezvous: rank 0 serves it, the other ranks connect to it.

    Rank 0 binds the listening socket itself (``TCPStore(master_listen_fd=...)``) on
    :func:`listen_address`, and writes a fresh id into the store. Another rank connects to
    ``main_address:main_port`` (127.0.0.1 on one node) and reads that id: if it is the id of the server it
    joined last time on that port, it reached rank 0's previous store, which rank 0 has not yet closed, and
    it tries again until the new one answers. The store is closed when the last reference to it goes (the
    process group's, at :func:`destroy_process_group`).

    Args:
        main_address, main_port: ``MASTER_ADDR`` and ``MASTER_PORT``.
        rank: this rank; 0 serves the store.
        timeout: how long to keep trying, and the store's timeout.
        num_nodes: number of machines (see :func:`listen_address`).

    Returns:
        The store.

    Raises:
        OSError: rank 0 cannot listen on the port (``EADDRINUSE``: another process holds it).
        RuntimeError: the store did not answer within ``timeout``.
    """
    deadline = time.monotonic() + timeout.total_seconds()
    host = "127.0.0.1" if num_nodes == 1 else main_address
    if rank == 0:
        bind_host = listen_address(main_address, num_nodes)
        while True:
            try:
                sock = _listening_socket(bind_host, main_port)
                break
            except OSError as e:
                if e.errno == errno.EADDRNOTAVAIL and bind_host:  # MASTER_ADDR is not an address of this host
                    log.warning("MASTER_ADDR=%s (%s) is not an address of rank 0's machine: the rendezvous store"
                                " listens on every interface.", main_address, bind_host)
                    bind_host = ""
                    continue
                # Our own previous store on this port may still be closing; anyone else's is an error.
                if e.errno != errno.EADDRINUSE or main_port not in _served_ports or time.monotonic() > deadline:
                    raise
                time.sleep(_RETRY_S)
        _served_ports.add(main_port)
        store = dist.TCPStore(host, main_port, None, is_master=True, timeout=timeout, wait_for_workers=False,
                              master_listen_fd=sock.detach())  # the store owns (and closes) the socket now
        store.set(_SERVER_ID_KEY, uuid.uuid4().hex)
        return store
    while True:
        left = timedelta(seconds=max(deadline - time.monotonic(), 1.0))
        try:
            store = dist.TCPStore(host, main_port, None, is_master=False, timeout=left)
            server_id = store.get(_SERVER_ID_KEY).decode()
        except RuntimeError:  # nothing listens yet, or rank 0 closed its previous store while we asked it
            if time.monotonic() > deadline:
                raise
            time.sleep(_RETRY_S)
            continue
        if server_id != _joined_servers.get((host, main_port)):
            _joined_servers[(host, main_port)] = server_id
            store.set_timeout(timeout)
            return store
        del store  # rank 0's previous store: disconnect and wait for the new one
        log.debug("[rank %d] reached the previous rendezvous's store at %s:%d; trying again", rank, host, main_port)
        if time.monotonic() > deadline:
            raise RuntimeError(f"only an earlier rendezvous's store answered at {host}:{main_port}: rank 0 did"
                               " not start a new one")
        time.sleep(_RETRY_S)


def gloo_on_loopback(num_nodes: int) -> Callable[[], None]:
    """On one node, make gloo's connections between ranks listen on loopback only; return an undo.

    gloo listens on the address this machine's host name resolves to (any interface) unless
    ``GLOO_SOCKET_IFNAME`` names one; it is read each time a gloo group is created. With ``num_nodes == 1``
    and the variable unset, this sets it to the loopback interface (``lo``) until the returned function is
    called (at teardown). A user's own ``GLOO_SOCKET_IFNAME``, and jobs on several nodes, are left alone.

    Args:
        num_nodes: number of machines.

    Returns:
        A function that restores the variable.
    """
    name = _loopback_interface() if num_nodes == 1 and "GLOO_SOCKET_IFNAME" not in os.environ else None
    if name is None:
        return lambda: None
    os.environ["GLOO_SOCKET_IFNAME"] = name

    def undo() -> None:
        if os.environ.get("GLOO_SOCKET_IFNAME") == name:
            del os.environ["GLOO_SOCKET_IFNAME"]

    return undo


def _loopback_interface() -> str | None:
    """The loopback interface's name (``lo`` on Linux, ``lo0`` on macOS), or None if none is found."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    return next((n for n in names if n in ("lo", "lo0")), None)


def _rendezvous_error(rank: int, world_size: int, where: str, timeout: timedelta, error: BaseException) -> str:
    text = str(error)
    if isinstance(error, OSError) and error.errno == errno.EADDRINUSE or "address already in use" in text.lower():
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
    seen to abort (SIGABRT) now and then. A garbage collection comes first: objects kept alive only by a
    reference cycle (after a ``torch.compile``'d fit, the DDP wrapper, which holds the group, which holds
    rank 0's ``TCPStore``) would otherwise keep ``MASTER_PORT`` listening after this returns, and the next
    fit in the same process could not bind it. Collected first, the group and its store go here.
    """
    global _kept_for_user_code
    _kept_for_user_code = False
    if dist.is_available() and dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()


#: Whether the default process group is one that a finished run left for the user's code.
_kept_for_user_code = False
_exit_hook_registered = False


def keep_process_group() -> None:
    """After a run that finished: leave the default process group for the user's code, as Lightning's ddp does.

    Code after ``trainer.fit(...)`` may call ``torch.distributed`` (``dist.get_rank()``, an ``all_reduce`` of
    results, a ``barrier`` before rank 0 writes a file): under Lightning's ``DDPStrategy`` the group outlives
    the run, so it does here. It is destroyed, for every backend, by the next run's
    :func:`release_kept_process_group` (each run has its own rendezvous), at interpreter exit (an ``atexit``
    hook), or when a spawned or forked rank's work ends (:mod:`ddp_strategy.process.launching`). A no-op without a group.
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
