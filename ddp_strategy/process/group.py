"""The world process group: backend, rendezvous and one run's membership.

One default (world) group per process, as under Lightning's ``DDPStrategy``: every stage and ``Trainer`` in the
process reuses it, and it outlives a successful run. It is destroyed after a failed run
(:mod:`ddp_strategy.process.failures`), when a spawned or forked rank's work ends, and, where the strategy made it,
at the process's exit (``atexit``, as Lightning does for NCCL only; under gloo, Lightning's ``ddp`` leaves it to the
interpreter's finalisation, where gloo's worker thread may end the process with ``std::terminate``).
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
from datetime import timedelta
from typing import Any, cast
from unittest import mock

import torch
import torch.distributed as dist

from ddp_strategy._compat.namespace import rank_zero_info
from ddp_strategy.process import failures

log = logging.getLogger(__name__)

#: Default process-group timeout: 30 minutes, Lightning's ``default_pg_timeout``, so that one rank may work alone
#: for long (rank 0 writing a checkpoint of many GiB). A failed or killed rank does not wait for it: it is named
#: within seconds (:mod:`ddp_strategy.process.failures`). Lower it (``MyDDPStrategy(timeout=...)``) to bound a stall.
DEFAULT_TIMEOUT = timedelta(minutes=30)


def resolve_backend(device: torch.device, backend: str | None) -> str:
    """``backend``, else ``torch.distributed.Backend.default_device_backend_map``'s for ``device``. Checked at the
    join, as Lightning's ``ddp`` checks it (so a backend registered with ``Backend.register_backend`` after the
    strategy or Trainer is built works); ``"nccl"`` on a CPU device is refused earlier, at ``Trainer(...)``
    (:func:`~ddp_strategy.process.launching.make_launcher`).

    Raises:
        ValueError: a name not in ``torch.distributed.Backend.backend_list``, or one this build lacks
            (``torch.distributed.is_backend_available``); the message lists those it has.
    """
    usable = [b for b in dist.Backend.backend_list if b not in ("undefined", "fake") and dist.is_backend_available(b)]
    if backend is not None and backend.lower() not in usable:
        raise ValueError(
            f"Unknown process_group_backend={backend!r}, or not built into this PyTorch (torch {torch.__version__})."
            f" Use one of {usable}, or leave it as None to get 'nccl' on CUDA devices and 'gloo' on CPU."
        )
    return backend or dist.Backend.default_device_backend_map.get(device.type, "gloo")


def as_timedelta(timeout: float | timedelta) -> timedelta:
    """``timeout`` (seconds, or a ``timedelta``) as a positive ``timedelta``; else ``TypeError`` (neither) or
    ``ValueError`` (not positive, not finite)."""
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float, timedelta)):
        raise TypeError(f"timeout must be seconds (a number) or a datetime.timedelta, got {timeout!r}.")
    try:
        delta = timeout if isinstance(timeout, timedelta) else timedelta(seconds=timeout)
    except (ValueError, OverflowError) as e:  # NaN, inf, more than 999999999 days
        raise ValueError(f"timeout must be a finite number of seconds, got {timeout!r}.") from e
    if delta.total_seconds() <= 0:
        raise ValueError(f"timeout must be positive, got {delta.total_seconds()} s.")
    return delta


def validate_init_method(init_method: str | None) -> None:
    """Refuse (``ValueError``) an ``init_method`` other than ``None``/``"env://"``, ``"tcp://host:port"`` or
    ``"file:///path"``, or a ``tcp://`` URL without a port."""
    if init_method is not None and not init_method.startswith(("env://", "tcp://", "file://")):
        raise ValueError(
            f"init_method={init_method!r} is not supported; use 'env://' (default), 'tcp://host:port' or"
            " 'file:///path/to/shared/file', or pass a torch.distributed Store as store=..."
        )
    if init_method is not None and init_method.startswith("tcp://") and not init_method.rsplit(":", 1)[-1].isdigit():
        raise ValueError(f"init_method={init_method!r} has no port; write it as 'tcp://host:port'.")


def _tcp_store(host: str, port: int, rank: int, timeout: timedelta, num_nodes: int) -> dist.TCPStore:
    """A ``TCPStore`` at ``host:port`` (``127.0.0.1:port`` on one node). Rank 0 serves it from a socket it binds
    itself (torch's own server listens on every interface): on one node on 127.0.0.1; on several on the address
    ``host`` resolves to, else on every interface, with a warning naming why (a loopback address, which no other
    node reaches; an address of another machine, e.g. a Kubernetes service's; a name that does not resolve)."""
    host = "127.0.0.1" if num_nodes == 1 else host
    if rank != 0:
        return dist.TCPStore(host, port, None, is_master=False, timeout=timeout)
    try:
        ip = cast(str, socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][4][0])  # an IPv4 or IPv6 address
        if num_nodes > 1 and ipaddress.ip_address(ip).is_loopback:
            raise OSError(errno.EADDRNOTAVAIL, f"it resolves to the loopback address {ip} here")
        sock = socket.create_server((ip, port), family=socket.AF_INET6 if ":" in ip else socket.AF_INET)
    except OSError as e:  # (a failed run's store, still serving this port, is reused: failures.KEPT_STORES)
        if num_nodes == 1 or e.errno == errno.EADDRINUSE:
            raise
        log.warning(
            f"MASTER_ADDR={host} is no address of rank 0's machine that other nodes reach ({e}), but the job has"
            f" {num_nodes} nodes: the rendezvous store listens on every interface. Set MASTER_ADDR to the address"
            " the other nodes reach this one by."
        )
        sock = socket.create_server(("", port), family=socket.AF_INET6, dualstack_ipv6=True)
    return dist.TCPStore(  # the store owns (and closes) the socket now
        host, port, None, is_master=True, timeout=timeout, wait_for_workers=False, master_listen_fd=sock.detach()
    )


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
) -> None:
    """Join the default (world) process group, or reuse this process's (as Lightning does). Every rank; returns
    once all ``world_size`` ranks joined.

    The rendezvous, first that applies: ``store``; ``init_method`` (``file://`` by torch, ``tcp://host:port`` as
    ``env://``); torchrun's agent store (``TORCHELASTIC_USE_AGENT_STORE=True``); ``env://`` at
    ``main_address:main_port``, served by rank 0 (on loopback when ``num_nodes == 1``). A CUDA ``device`` is passed
    as ``device_id`` (eager NCCL initialisation). ``MASTER_ADDR``/``MASTER_PORT`` are set for ``env://``, and left
    set, as Lightning's ``_init_dist_connection`` does. ``init_method`` is one :func:`validate_init_method` accepted
    (``MyDDPStrategy(...)`` checked it).

    Raises:
        RuntimeError: a group exists with another rank or world size; or the rendezvous failed (unreachable
            address, the port in use, ranks missing after ``timeout``): the message names the address.
    """
    if dist.is_initialized():
        if (dist.get_rank(), dist.get_world_size()) != (rank, world_size):
            raise RuntimeError(
                f"A process group already exists with rank {dist.get_rank()} of"
                f" {dist.get_world_size()}, but this run needs rank {rank} of {world_size}. Call"
                " torch.distributed.destroy_process_group() before starting another run."
            )
        return
    env = store is None and init_method in (None, "env://")
    if init_method is not None and init_method.startswith("tcp://"):  # served as env:// is
        main_address, port = init_method[len("tcp://") :].rsplit(":", 1)
        main_port = int(port)
    init_method = None if init_method is None or init_method.startswith(("tcp://", "env://")) else init_method
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    where = (
        f"the given {type(store).__name__}"
        if store is not None
        else init_method
        if init_method is not None
        else f"{main_address}:{main_port}" + (" (the torchrun agent's store)" if agent and env else "")
    )
    if env:  # as Lightning's _init_dist_connection does; torch's env:// handler reads them under torchrun
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = main_address, str(main_port)
    log.info(
        f"[rank {rank}] joining the process group: backend={backend} world_size={world_size} rendezvous={where}"
        f" timeout={timeout.total_seconds():.0f}s"
    )

    def attempt(rendezvous: dist.Store | None) -> None:
        if rendezvous is None and init_method is None:  # env://: a failed run's store, kept for this run, else
            # rank 0's own new store or torchrun's agent's
            if (rendezvous := failures.KEPT_STORES.pop((os.getpid(), main_port), None)) is not None:
                rendezvous.set_timeout(timeout)  # a failing rank shortened it (failures._best_effort)
            else:
                gc.collect()  # a user-destroyed group's store, held only by reference cycles (a traceback), closes
                rendezvous = (
                    dist.TCPStore(main_address, main_port, None, is_master=False, timeout=timeout)
                    if agent
                    else _tcp_store(main_address, main_port, rank, timeout, num_nodes)
                )
        if rendezvous is not None:  # a store may outlive this group (torchrun's: per attempt too)
            rendezvous = failures.generation(rendezvous, world_size, "group")
        dist.init_process_group(
            backend,
            init_method=init_method if rendezvous is None else None,
            store=rendezvous,
            rank=rank,
            world_size=world_size,
            timeout=timeout,
            device_id=device if device is not None and device.type == "cuda" else None,
        )
        # destroyed at this process's exit, as Lightning does for NCCL, on every backend: else gloo's worker thread may
        # free a finished work's Python objects during interpreter finalisation (std::terminate, "terminate called
        # without an active exception"; NCCL warns the group was not destroyed)
        atexit.register(failures.destroy_process_group)

    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        try:
            return attempt(store)
        except (RuntimeError, OSError, ValueError) as e:
            error = e  # retried: a DistNetworkError on rank 1+ (rank 0's previous store accepted us, then closed:
            # rank 0 is between two runs; its next store comes up there)
            if not (isinstance(e, dist.DistNetworkError) and env and rank != 0) or time.monotonic() > deadline:
                break
            log.info("[rank %d] the rendezvous store at %s closed the connection (%s); retrying", rank, where, e)
            time.sleep(0.2)
    text = str(error)
    if "address already in use" in text.lower() or getattr(error, "errno", None) == errno.EADDRINUSE:
        raise RuntimeError(
            f"[rank {rank}] cannot start the rendezvous at {where}: the port is already in use by"
            " another process. Choose another MASTER_PORT, or unset it so a free port is"
            " picked."
        ) from error
    raise RuntimeError(
        f"[rank {rank}] could not join the process group at {where} (world size {world_size}) within"
        f" {timeout.total_seconds():.0f} s: {text.splitlines()[0] if text else type(error).__name__}. Check that"
        " MASTER_ADDR is reachable from every node, that rank 0 started, and that all ranks use the same address"
        " and port."
    ) from error


class ProcessGroupRun:
    """One rank's part in the runs (stages, fits) of one strategy: the rendezvous (:func:`init_process_group`),
    side groups, failure state; ``barrier_timeout`` is the epoch barrier's (:mod:`~ddp_strategy.process.boundaries`)."""

    def __init__(
        self,
        timeout: timedelta,
        barrier_timeout: timedelta,
        init_method: str | None = None,
        store: dist.Store | None = None,
    ) -> None:
        self.timeout, self.barrier_timeout, self.init_method, self.store = timeout, barrier_timeout, init_method, store
        # This run's failure reports (failures.run_reports); this rank's intra-node group (the world on one node); the
        # gloo side group (process.boundaries). Set by join, dropped at teardown.
        # The value this run gave GLOO_SOCKET_IFNAME (None: it left it alone), removed at teardown (failures.teardown).
        self.reports, self.node_group, self.barrier_group, self.ifname = cast(
            "tuple[dist.Store | None, dist.ProcessGroup | None, Any, str | None]", (None, None, None, None)
        )
        self.failed = self.own_failure = False  # set by failures.on_exception, cleared when the next run joins

    def join(self, env: Any, device: torch.device, backend: str | None, num_nodes: int, num_processes: int) -> str:
        """Join (or reuse) the world group, make the side groups and this run's failure reports; return the backend
        in use. Every rank. On one node, ``GLOO_SOCKET_IFNAME=lo`` until the run's teardown, unless already set.

        Raises:
            ValueError: an unknown or unavailable backend (:func:`resolve_backend`); RuntimeError: as
                :func:`init_process_group`.
        """
        rank, world_size = env.global_rank(), env.world_size()
        # A world of num_nodes x num_processes ranks (launching.check_external_world) is laid out by node. One an
        # environment owns (Ray's, a user's) is not (Ray's workers have devices="auto" and may span machines with
        # num_nodes == 1): it gets no node group, and no loopback unless it is this node's processes.
        # On one node gloo's connections stay on loopback (the groups made now, and the user's during the run),
        # unless the user chose an interface; failures.teardown removes the variable again, on every path.
        if (
            num_nodes == 1
            and world_size == num_processes
            and "GLOO_SOCKET_IFNAME" not in os.environ
            and "lo" in dict(socket.if_nameindex()).values()
        ):
            os.environ["GLOO_SOCKET_IFNAME"] = self.ifname = "lo"
        init_process_group(
            resolve_backend(device, backend),
            rank,
            world_size,
            env.main_address,
            env.main_port,
            self.timeout,
            device,
            self.init_method,
            self.store,
            num_nodes,
        )
        # Made for each run and dropped at its teardown: a group kept here would keep the world group's store (and
        # MASTER_PORT) alive after the user destroys the group.
        if world_size == num_nodes * num_processes:  # else torch's default where one is needed (PostLocalSGDState's)
            lists = [list(range(n * num_processes, (n + 1) * num_processes)) for n in range(num_nodes)]
            self.node_group = dist.group.WORLD if num_nodes == 1 else dist.new_subgroups_by_enumeration(lists)[0]
        # The run's gloo side group (process.boundaries), destroyed at its teardown: made with its pairs connected on
        # first use (TORCH_GLOO_LAZY_INIT, unless the user set it), so making it connects nothing and costs no store
        # operation, and it connects only what it uses (the epoch barrier's 2 log2 W - 1 peers, a round's ring)
        with mock.patch.dict(os.environ, {"TORCH_GLOO_LAZY_INIT": os.environ.get("TORCH_GLOO_LAZY_INIT", "1")}):
            self.barrier_group = dist.new_group(backend="gloo")
        # the pairs it will use connected now, while every rank is alive: a first use after a peer failed would retry
        # the connect to its closed listener until the group's timeout instead of failing (under gloo the rounds'
        # ring, else the epoch barrier's peers; the barrier's peers include the ring's)
        if dist.get_backend() == "gloo":
            dist.all_reduce(torch.zeros(1), group=self.barrier_group)
        else:
            dist.barrier(group=self.barrier_group)
        self.failed = self.own_failure = False
        self.reports = failures.run_reports(rank, world_size)
        rank_zero_info(f"MyDDPStrategy: world size {world_size}, backend={dist.get_backend()}")
        return dist.get_backend()  # the group's (reused: the first run's)


def device_ids(device: torch.device) -> list[int] | None:
    """``device_ids`` for DDP and NCCL's barrier: ``[index]`` for a CUDA device, ``None`` for CPU."""
    return [device.index if device.index is not None else 0] if device.type == "cuda" else None
