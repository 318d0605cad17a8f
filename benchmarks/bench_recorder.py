"""What one rank measures: step times, start-up milestones, memory, and the bytes and calls over the process group.

Both workers feed a :class:`StepRecorder` (the hand-written loop around its own
steps, the Lightning worker from a callback) and register
:func:`counting_allreduce_hook` through :func:`register_counting_hook`; each rank
then writes ``rank<N>.json`` (see :meth:`StepRecorder.finish`), which
``bench_runs.py`` reads back. Imports only PyTorch, never a worker or Lightning.

Environment read here (set by ``bench_ddp.py``):
    BENCH_LAUNCH_TIME: ``time.time()`` of the launch, in seconds since the epoch.
    BENCH_SCALE: ``1`` (set by ``bench_scale.py``): also count the store operations (``bench_probe.py``), the calls
        and bytes on every process group, and snapshot them at each step's start, with the TCP connections and
        process groups at the first (``scale`` in ``rank<N>.json``).
"""

import functools
import inspect
import json
import os
import resource
import sys
import threading
import time
from pathlib import Path
from typing import Any

import bench_probe
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

_tls = threading.local()

_COLLECTIVES = (
    "all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor", "gather", "scatter",
    "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "barrier",
    "monitored_barrier", "broadcast_object_list", "all_gather_object", "gather_object", "scatter_object_list",
)  # fmt: skip


def _tensor_bytes(obj: Any) -> int:
    """Bytes held by a tensor or a (nested) list of tensors; 0 for anything else."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(o) for o in obj)
    return 0


@functools.cache
def _site(path: str, line: int, name: str) -> str:
    """``file:line function``, the path's last 3 parts; cached: a per-step call site costs a lookup, not a Path."""
    return f"{'/'.join(Path(path).parts[-3:])}:{line} {name}"


def _caller_outside_torch(max_depth: int = 40) -> str:
    """``file:line function`` of the nearest caller outside ``torch/`` (a few microseconds)."""
    frame = sys._getframe(2)
    for _ in range(max_depth):
        if frame is None:
            break
        path = frame.f_code.co_filename
        if f"{os.sep}torch{os.sep}" not in path:
            return _site(path, frame.f_lineno, frame.f_code.co_name)
        frame = frame.f_back
    return "?"


class CommCounter:
    """Counts what goes over the process group.

    Two sources:
      * gradient buckets, via :func:`counting_allreduce_hook` registered as the DDP
        comm hook (wraps PyTorch's default ``allreduce_hook``, so results are unchanged);
      * every other collective on the world group called through ``torch.distributed.<name>``
        (Lightning's ``reduce_boolean_decision``, barriers, ...), via :meth:`install` which wraps
        those functions. Calls made from inside the comm hook are not counted twice; calls on
        another group (MyDDPStrategy's gloo side group: its epoch-start barrier and its
        asynchronous per-step signal flags) are listed in ``call_sites`` only, marked
        ``[side group]``: they do not wait on or delay the world group's gradient buckets.

    Counts are cumulative; :class:`StepRecorder` snapshots them at the first step's
    start and the last step's end so set-up and teardown collectives are excluded.
    """

    def __init__(self) -> None:
        self.process_group: dist.ProcessGroup | None = None
        self.grad_bytes = 0
        self.grad_buckets = 0
        self.hook_registered = False
        self.other_bytes: dict[str, int] = {}
        self.other_calls: dict[str, int] = {}
        self.call_sites: dict[str, int] = {}  # "name <- file:line function" -> calls
        #: "world" or "other" (any other group) -> "name" -> [calls, tensor bytes]; every call, not the comm hook's
        self.by_group: dict[str, dict[str, list[int]]] = {"world": {}, "other": {}}

    def install(self) -> None:
        """Wrap the ``torch.distributed`` collectives to count calls and tensor bytes."""
        for name in _COLLECTIVES:
            fn = getattr(dist, name, None)
            if fn is None or getattr(fn, "_bench_wrapped", False):
                continue
            setattr(dist, name, self._wrap(name, fn))
        # a group's own barrier and all-reduce (ProcessGroup.barrier(options), ProcessGroup.allreduce(tensors, op,
        # timeout): MyDDPStrategy's epoch barrier and its rounds, with a timeout), counted where they are not called
        # by torch.distributed.barrier / all_reduce (counted above)
        for name, method in (("barrier", "barrier"), ("all_reduce", "allreduce")):
            if not getattr(getattr(dist.ProcessGroup, method), "_bench_wrapped", False):
                setattr(dist.ProcessGroup, method, self._wrap(name, getattr(dist.ProcessGroup, method), method=True))

    def _wrap(self, name: str, fn: Any, method: bool = False) -> Any:
        params = [] if method else list(inspect.signature(fn).parameters)
        group_at = 0 if method else params.index("group") if "group" in params else None

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if method and getattr(_tls, "in_dist", False):
                return fn(*args, **kwargs)
            if not getattr(_tls, "in_hook", False):
                group = kwargs.get("group", args[group_at] if group_at is not None and group_at < len(args) else None)
                world = group is None or group is dist.group.WORLD  # only the world group's count as "other"
                site = f"{name}{'' if world else ' [side group]'} <- {_caller_outside_torch()}"
                self.call_sites[site] = self.call_sites.get(site, 0) + 1
                tensor = args[1 if method else 0] if len(args) > method else kwargs.get("tensor")  # (method: the group)
                nbytes = _tensor_bytes(tensor)
                counts = self.by_group["world" if world else "other"].setdefault(name, [0, 0])
                counts[0], counts[1] = counts[0] + 1, counts[1] + nbytes
                if world:
                    self.other_calls[name] = self.other_calls.get(name, 0) + 1
                    self.other_bytes[name] = self.other_bytes.get(name, 0) + nbytes
            outer, _tls.in_dist = getattr(_tls, "in_dist", False), True
            try:
                return fn(*args, **kwargs)
            finally:
                _tls.in_dist = outer

        wrapper._bench_wrapped = True  # type: ignore[attr-defined]
        return wrapper

    def snapshot(self) -> dict[str, Any]:
        """Current cumulative counts (bytes and calls)."""
        return {
            "grad_bytes": self.grad_bytes,
            "grad_buckets": self.grad_buckets,
            "other_bytes": dict(self.other_bytes),
            "other_calls": dict(self.other_calls),
            "call_sites": dict(self.call_sites),
        }


def counting_allreduce_hook(state: CommCounter, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: add the bucket's size (bytes) to ``state``, then PyTorch's ``allreduce_hook``."""
    buf = bucket.buffer()
    state.grad_bytes += buf.numel() * buf.element_size()
    state.grad_buckets += 1
    _tls.in_hook = True
    try:
        return default_hooks.allreduce_hook(state.process_group, bucket)
    finally:
        _tls.in_hook = False


def register_counting_hook(ddp_model: nn.Module, counter: CommCounter) -> None:
    """Register :func:`counting_allreduce_hook` on a DDP module; must precede the first backward.

    Leaves ``counter.hook_registered`` False (bytes then show as unknown) if the model is
    not DDP-wrapped or already has a comm hook (DDP accepts only one).
    """
    if not isinstance(ddp_model, DistributedDataParallel):
        return
    try:
        ddp_model.register_comm_hook(counter, counting_allreduce_hook)
    except RuntimeError:  # "register_comm_hook ... can only be called once"
        return
    counter.hook_registered = True


class StepRecorder:
    """Per-rank timings of every optimizer step, plus memory and communication.

    Call :meth:`step_start` when a step begins (batch in hand) and :meth:`step_end`
    after ``optimizer.step()``. Step durations are end-to-end: step i (i >= 1)
    lasts from the end of step i-1 to the end of step i, so data loading and
    framework bookkeeping between steps are included.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.launch_time = float(os.environ.get("BENCH_LAUNCH_TIME", time.time()))
        self.starts: list[float] = []  # time.perf_counter(), seconds
        self.ends: list[float] = []
        self.first_start_wall: float | None = None  # time.time(), seconds since the epoch
        self.first_end_wall: float | None = None
        self.comm = CommCounter()
        self.comm_at_start: dict[str, Any] | None = None
        self.comm_at_end: dict[str, Any] | None = None
        self.final_loss: float | None = None
        self.marks: dict[str, float] = {"imports": time.time() - self.launch_time}
        self.scale: dict[str, Any] | None = None  # BENCH_SCALE=1: see _scale_snapshot
        if os.environ.get("BENCH_SCALE") == "1":
            bench_probe.install()
            self.scale = {"snapshots": []}

    def _scale_snapshot(self) -> None:
        """Cumulative counts at a step's start (``BENCH_SCALE=1``): calls and bytes per group, the gradient buckets
        (world group), store operations; at the first, also the TCP connections and process groups held."""
        assert self.scale is not None
        if not self.scale["snapshots"]:
            self.scale["tcp_connections"] = bench_probe.tcp_connections()
            self.scale["process_groups"] = bench_probe.process_groups()
        self.scale["snapshots"].append(
            {
                "groups": {g: {k: list(v) for k, v in calls.items()} for g, calls in self.comm.by_group.items()},
                "grad": [self.comm.grad_buckets, self.comm.grad_bytes],
                "store": dict(bench_probe.STORE_OPS),
            }
        )

    def mark(self, name: str) -> None:
        """Record a start-up milestone, in seconds since launch (``imports`` is set on creation)."""
        self.marks.setdefault(name, time.time() - self.launch_time)

    def step_start(self) -> None:
        """Record the start of a step."""
        if not self.starts:
            self.mark("train_start")  # no-op if the caller marked it earlier
            self.first_start_wall = time.time()
            self.comm_at_start = self.comm.snapshot()
        if self.scale is not None:
            self._scale_snapshot()
        self.starts.append(time.perf_counter())

    def step_end(self, loss: torch.Tensor | None = None, last: bool = False) -> None:
        """Record the end of a step; on CUDA waits for the device first.

        Pass ``last=True`` for the final step: communication counting stops there and ``loss``
        (read only then) becomes ``final_loss``.
        """
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.ends.append(time.perf_counter())
        if self.first_end_wall is None:
            self.first_end_wall = time.time()
        if last:
            self.comm_at_end = self.comm.snapshot()
            if self.scale is not None:  # pairs a group connects on first use are held by now
                self.scale["tcp_connections_end"] = bench_probe.tcp_connections()
            if loss is not None:
                self.final_loss = float(loss.detach())

    def finish(self, rank: int, world_size: int, out_dir: str | Path, extra: dict[str, Any]) -> None:
        """Write ``rank<rank>.json`` to ``out_dir``.

        Fields: ``step_s`` (seconds per step, end-to-end, all steps), ``startup_s``
        (launch to the end of the first step, seconds), ``launch_to_first_start_s``,
        ``peak_rss_mib`` (ru_maxrss of this process, MiB), ``peak_cuda_mib``,
        ``comm`` (counts over the training steps only), ``threads``, ``final_loss``.
        """
        assert self.first_end_wall is not None and self.first_start_wall is not None, "no step was recorded"
        step_s = [self.ends[0] - self.starts[0]] + [b - a for a, b in zip(self.ends, self.ends[1:], strict=False)]
        end = self.comm_at_end or self.comm.snapshot()
        start = self.comm_at_start or {}
        steps = len(step_s)
        other_calls = {k: v - start.get("other_calls", {}).get(k, 0) for k, v in end["other_calls"].items()}
        other_bytes = {k: v - start.get("other_bytes", {}).get(k, 0) for k, v in end["other_bytes"].items()}
        other_calls = {k: v for k, v in other_calls.items() if v}
        sites = {k: v - start.get("call_sites", {}).get(k, 0) for k, v in end["call_sites"].items()}
        sites = {k: v for k, v in sorted(sites.items(), key=lambda kv: -kv[1]) if v}
        record = {
            "rank": rank,
            "world_size": world_size,
            "steps": steps,
            "step_s": step_s,
            "startup_s": self.first_end_wall - self.launch_time,
            "launch_to_first_start_s": self.first_start_wall - self.launch_time,
            "marks_s": self.marks,  # start-up milestones, seconds since launch
            "modules_loaded": len(sys.modules),
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,  # KiB on Linux
            "peak_cuda_mib": (torch.cuda.max_memory_allocated(self.device) / 2**20)
            if self.device.type == "cuda"
            else None,
            "threads": torch.get_num_threads(),
            "final_loss": self.final_loss,
            "comm": {
                "hook_registered": self.comm.hook_registered,
                "grad_bytes_per_step": (end["grad_bytes"] - start.get("grad_bytes", 0)) / steps,
                "grad_buckets_per_step": (end["grad_buckets"] - start.get("grad_buckets", 0)) / steps,
                "other_all_reduce_bytes_per_step": other_bytes.get("all_reduce", 0) / steps,
                "other_calls_per_step": sum(other_calls.values()) / steps,
                "other_calls": other_calls,
                "other_call_sites": sites,
            },
            "scale": self.scale,
            **extra,
        }
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        tmp = Path(out_dir) / f".rank{rank}.json.tmp"
        tmp.write_text(json.dumps(record))
        tmp.replace(Path(out_dir) / f"rank{rank}.json")
