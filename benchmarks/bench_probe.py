"""What a rank holds and asks of the rendezvous store, for ``bench_scale.py`` (issue 49): TCP connections, process
groups, and the store operations every process group makes (set, get, add, check, wait, ...).

Installed by ``bench_recorder.StepRecorder`` when ``BENCH_SCALE=1`` (``bench_scale.py`` sets it), in every rank
before it joins a group, for every implementation alike:

* :func:`install` replaces ``torch.distributed.init_process_group`` (which the hand-written loop, Lightning's
  ``_init_dist_connection`` and ``MyDDPStrategy`` all call through that attribute) by one that hands torch a
  :class:`CountingStore` around the store the group would have used: the ``env://`` rendezvous's ``TCPStore``
  (made here, as torch's ``env://`` handler makes it), or the ``store=`` given (``MyDDPStrategy`` passes its own).
  Every later operation on the group's store, from C++ (gloo's address exchange when a group connects, a
  ``new_group``'s) or from Python (torch's, Lightning's, the strategy's failure reports), goes through it and is
  counted. Not counted: what a ``TCPStore`` does inside its constructor (its workers' handshake, the same for all),
  and operations on the raw store before the group exists (``MyDDPStrategy``: one ``add``, the run generation).
* :func:`tcp_connections`: the established TCP connections of this process (its socket inodes in
  ``/proc/self/fd`` matched against ``/proc/self/net/tcp`` and ``tcp6``), loopback ones included (one machine).
* :func:`process_groups`: the process groups this process has made, the world group included.

Imports only PyTorch. Linux only (``/proc``).
"""

from __future__ import annotations

import collections
import os
from datetime import timedelta
from typing import Any

import torch.distributed as dist

#: Store operations by name, this process, cumulative (every CountingStore adds here).
STORE_OPS: collections.Counter[str] = collections.Counter()
#: CountingStores alive: torch holds them from C++ only, which does not keep the Python object (and its methods)
#: alive.
_KEEP: list[Any] = []


class CountingStore(dist.Store):
    """A ``torch.distributed.Store`` that forwards every operation to ``inner`` and counts it in :data:`STORE_OPS`."""

    def __init__(self, inner: Any) -> None:
        super().__init__()
        self.inner = inner
        _KEEP.append(self)

    def set(self, key: str, value: Any) -> None:
        STORE_OPS["set"] += 1
        self.inner.set(key, value)

    def get(self, key: str) -> bytes:
        STORE_OPS["get"] += 1
        return self.inner.get(key)

    def add(self, key: str, value: int) -> int:
        STORE_OPS["add"] += 1
        return self.inner.add(key, value)

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        STORE_OPS["compare_set"] += 1
        return self.inner.compare_set(key, expected, desired)

    def check(self, keys: list[str]) -> bool:
        STORE_OPS["check"] += 1
        return self.inner.check(keys)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        STORE_OPS["wait"] += 1
        self.inner.wait(keys) if timeout is None else self.inner.wait(keys, timeout)

    def delete_key(self, key: str) -> bool:
        STORE_OPS["delete_key"] += 1
        return self.inner.delete_key(key)

    def num_keys(self) -> int:
        STORE_OPS["num_keys"] += 1
        return self.inner.num_keys()

    def multi_get(self, keys: list[str]) -> list[bytes]:
        STORE_OPS["multi_get"] += 1
        return self.inner.multi_get(keys)

    def multi_set(self, keys: list[str], values: list[Any]) -> None:
        STORE_OPS["multi_set"] += 1
        self.inner.multi_set(keys, values)

    def append(self, key: str, value: Any) -> None:
        STORE_OPS["append"] += 1
        self.inner.append(key, value)

    def set_timeout(self, timeout: timedelta) -> None:
        self.inner.set_timeout(timeout)

    def has_extended_api(self) -> bool:
        return self.inner.has_extended_api()

    def clone(self) -> CountingStore:
        return CountingStore(self.inner.clone())

    @property
    def timeout(self) -> timedelta:
        return self.inner.timeout


def install() -> None:
    """Count the store operations of every process group this process joins (module docstring). Idempotent."""
    original = dist.init_process_group
    if getattr(original, "_bench_counted", False):
        return

    def init_process_group(backend: Any = None, init_method: Any = None, timeout: Any = None, world_size: int = -1,
                           rank: int = -1, store: Any = None, **kwargs: Any) -> Any:  # fmt: skip
        if store is None:  # as torch's env:// (or tcp://, file://) handler makes it
            store, rank, world_size = next(
                dist.rendezvous(init_method or "env://", rank, world_size, timeout=timeout or timedelta(minutes=30))
            )
            if timeout is not None:
                store.set_timeout(timeout)
        return original(
            backend, timeout=timeout, world_size=world_size, rank=rank, store=CountingStore(store), **kwargs
        )

    init_process_group._bench_counted = True  # type: ignore[attr-defined]
    dist.init_process_group = init_process_group  # type: ignore[assignment]


def tcp_connections() -> int:
    """Established TCP connections (IPv4 and IPv6) whose socket this process holds."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if link.startswith("socket:["):
            inodes.add(link[len("socket:[") : -1])
    count = 0
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        if not os.path.exists(table):
            continue
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                count += fields[3] == "01" and fields[9] in inodes  # 01: ESTABLISHED
    return count


def process_groups() -> int:
    """Process groups this process has made and not destroyed, the world group included (torch's registry)."""
    return len(dist.distributed_c10d._world.pg_map) if dist.is_initialized() else 0
