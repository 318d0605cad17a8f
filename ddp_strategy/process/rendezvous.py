"""Rendezvous: the store every rank meets at, one per stage, fit or torchrun attempt.

The rendezvous store is made here rather than by torch's handlers, so that every rendezvous (stage, fit,
torchrun attempt) is kept apart from the earlier ones, and so that on one node nothing listens beyond
loopback (the store's socket and gloo's interface).
"""

from __future__ import annotations

import errno
import ipaddress
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

log = logging.getLogger(__name__)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that was free a moment ago (the OS picks it), for a rendezvous on one machine.

    Another process may take it before it is bound again; callers on a shared machine retry or use a store.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


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


def rendezvous_error(rank: int, world_size: int, where: str, timeout: timedelta, error: BaseException) -> str:
    text = str(error)
    if isinstance(error, OSError) and error.errno == errno.EADDRINUSE or "address already in use" in text.lower():
        return (f"[rank {rank}] cannot start the rendezvous at {where}: the port is already in use by another"
                " process. Choose another MASTER_PORT, or unset it so a free port is picked.")
    return (f"[rank {rank}] could not join the process group at {where} (world size {world_size}) within"
            f" {timeout.total_seconds():.0f} s: {text.splitlines()[0] if text else type(error).__name__}. Check"
            " that MASTER_ADDR is reachable from every node, that rank 0 started, and that all ranks use the"
            " same address and port.")
