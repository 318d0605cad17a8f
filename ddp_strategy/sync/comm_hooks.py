"""DDP communication hooks: choose, adapt to the backend, register, and count what goes over the wire.

A communication hook replaces DDP's gradient all-reduce for each bucket
(https://pytorch.org/docs/stable/ddp_comm_hooks.html). ``MyDDPStrategy(ddp_comm_hook=...)`` registers one on every
backend, CPU/gloo included (Lightning's own DDP strategy registers hooks on CUDA only): a name in
:data:`HOOKS_BY_NAME` (bytes sent per element per rank: ``"allreduce"``, DDP's own algorithm, 4; ``"fp16"`` and
``"bf16"`` 2; ``"powersgd"`` (rows + cols) * rank per matrix) or any hook.

PyTorch refuses its ``bf16_compress_hook`` and ``bf16_compress_wrapper`` unless CUDA+NCCL>=2.10 is present, by
the hook's ``__name__`` (``DistributedDataParallel._check_comm_hook``). Gloo in torch 2.13 all-reduces
``torch.bfloat16``, so off NCCL the hook becomes :func:`bf16_all_reduce_hook` and the wrapper's hook is renamed
``bf16_wrapped_hook``: the same code under names DDP accepts.
"""

import threading
from collections.abc import Callable, Generator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as post_localsgd
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
from torch.distributed.optim import PostLocalSGDOptimizer, ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

from ddp_strategy._compat import torch_private as _torch_private

CommHook = Callable[[Any, dist.GradBucket], torch.futures.Future]

# No ``from __future__ import annotations`` here: DDP checks a hook's annotations at registration and
# rejects string annotations ("bucket annotation should be dist.GradBucket").


def bf16_all_reduce_hook(
    process_group: dist.ProcessGroup | None, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """All-reduce a gradient bucket in bfloat16 on any backend that sums bfloat16 (gloo, NCCL): PyTorch's
    ``default_hooks.bf16_compress_hook`` itself, under a name DDP does not refuse off CUDA+NCCL.

    Args:
        process_group: the group to reduce over; ``None`` = the world (the hook's ``state``).
        bucket: DDP's gradient bucket; its flat float32 buffer has shape (N,).

    Returns:
        A future of the bucket buffer (N,), float32, holding the average over ranks of the gradients,
        rounded to bfloat16 (8 mantissa bits) on the way. 2 bytes per element go over the wire.
    """
    # ignored: torch hints ProcessGroup, but the hook takes None as the world (its _compress_hook checks)
    return default_hooks.bf16_compress_hook(process_group, bucket)  # type: ignore[arg-type]


#: Hook names accepted by ``MyDDPStrategy(ddp_comm_hook=...)``.
HOOKS_BY_NAME: dict[str, CommHook] = {
    "allreduce": default_hooks.allreduce_hook,
    "fp16": default_hooks.fp16_compress_hook,
    "bf16": bf16_all_reduce_hook,
    "powersgd": powersgd.powerSGD_hook,
}


@dataclass
class CommHookConfig:
    """What ``MyDDPStrategy`` registers: a hook, its state and an optional wrapper (e.g. fp16 around PowerSGD).

    Args:
        hook: a callable ``hook(state, bucket) -> Future[Tensor]`` or a name in :data:`HOOKS_BY_NAME`.
        state: the hook's state (a process group for the default hooks, a ``PowerSGDState`` for PowerSGD);
            ``None`` = DDP's group for the default hooks; for PowerSGD a rank-1 approximation after 10 iterations
            of plain all-reduce, with error feedback and warm start (Vogels et al., 2019,
            https://arxiv.org/abs/1905.13727; PyTorch's recommended starting point).
        wrapper: a function ``wrapper(hook) -> hook`` such as ``default_hooks.fp16_compress_wrapper``.

    Raises:
        ValueError: an unknown hook name.
        TypeError: ``hook`` or ``wrapper`` is not callable, or a state or wrapper is given without a hook.
    """

    hook: CommHook | str | None = None
    state: Any = None
    wrapper: Callable[[CommHook], CommHook] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.hook, str) and self.hook not in HOOKS_BY_NAME:
            raise ValueError(
                f"Unknown ddp_comm_hook={self.hook!r}; use one of {sorted(HOOKS_BY_NAME)} or a"
                " callable hook(state, bucket) -> torch.futures.Future."
            )
        if not isinstance(self.hook, str | None) and not callable(self.hook):
            raise TypeError(f"ddp_comm_hook must be a callable or a name, got {type(self.hook).__name__}.")
        if self.wrapper is not None and not callable(self.wrapper):
            raise TypeError(f"ddp_comm_wrapper must be callable, got {type(self.wrapper).__name__}.")
        if self.hook is None and (self.state is not None or self.wrapper is not None):
            raise TypeError("ddp_comm_state / ddp_comm_wrapper were given without ddp_comm_hook; pass the hook too.")


def register_comm_hook(
    model: DistributedDataParallel, config: CommHookConfig, node_group: dist.ProcessGroup | None = None
) -> None:
    """Register ``config``'s hook on a new DDP wrapper (every backend), before training and where the strategy wraps
    anew (``wrapping.wrap``). Errors are DDP's (a wrong signature, a second hook).

    Off NCCL (the backend of the wrapper's group), PyTorch's bf16 hook, which DDP refuses there, becomes
    :func:`bf16_all_reduce_hook`, and a hook made by PyTorch's bf16 wrapper (``ddp_comm_wrapper`` or the user's own
    call) is renamed ``bf16_wrapped_hook``. Without a state the hook gets the wrapper's process group (PowerSGD: a
    ``PowerSGDState`` of it, as :class:`CommHookConfig` says); that group, or a ``PowerSGDState``'s, counts for
    :func:`count_collective_bytes`. A ``PostLocalSGDState`` without ``subgroup`` gets ``node_group``, the intra-node
    group torch's default means (torch builds it from the CUDA device count, which fails on CPU).
    """
    if config.hook is None:
        return
    hook = HOOKS_BY_NAME[config.hook] if isinstance(config.hook, str) else config.hook
    off_nccl = dist.get_backend(model.process_group) != "nccl"
    if off_nccl and hook is default_hooks.bf16_compress_hook:
        hook = bf16_all_reduce_hook
    state = (
        config.state
        if config.state is not None
        else powersgd.PowerSGDState(model.process_group, matrix_approximation_rank=1, start_powerSGD_iter=10)
        if hook is powersgd.powerSGD_hook
        else model.process_group
    )
    if isinstance(state, post_localsgd.PostLocalSGDState) and state.subgroup is None:
        state.subgroup = node_group
    if isinstance(state, dist.ProcessGroup):
        state = _torch_private.CountingProcessGroup(state, _count)
    elif isinstance(state, powersgd.PowerSGDState):  # per-bucket memories: of an earlier wrapper's buckets, if any
        state.error_dict, state.p_memory_dict, state.q_memory_dict = {}, {}, {}
        if not isinstance(state.process_group, _torch_private.CountingProcessGroup):  # e.g. a state registered before
            state.process_group = _torch_private.CountingProcessGroup(state.process_group, _count)
    if config.wrapper is not None:
        hook = config.wrapper(hook)
    if off_nccl and getattr(hook, "__name__", None) == "bf16_compress_wrapper_hook":  # made by PyTorch's wrapper
        hook.__name__ = hook.__qualname__ = "bf16_wrapped_hook"
    model.register_comm_hook(state, hook)


def model_averager(config: CommHookConfig, period: int | None, optimizers: list[Any]) -> PeriodicModelAverager | None:
    """Post-localSGD's averager, as Lightning's ``DDPStrategy._enable_model_averaging``: with a ``PostLocalSGDState``
    (``ddp_comm_hook=post_localSGD_hook``), torch's ``PeriodicModelAverager`` averaging the parameters over the world
    every ``period`` optimizer steps after ``start_localSGD_iter`` (its ``average_parameters``, called after each step,
    is a collective); else None. Lin et al., 2020, https://arxiv.org/abs/1808.07217.

    Raises:
        ValueError: no ``period`` (``model_averaging_period``), or a ZeroRedundancy or PostLocalSGD optimizer (as
            Lightning's).
    """
    if not isinstance(config.state, post_localsgd.PostLocalSGDState):
        return None
    if period is None:
        raise ValueError(
            "Post-localSGD algorithm is used, but model averaging period is not provided to DDP strategy:"
            " pass MyDDPStrategy(model_averaging_period=N)."
        )
    for inner in (getattr(optimizer, "_optimizer", optimizer) for optimizer in optimizers):  # Lightning's wrapper
        if isinstance(inner, ZeroRedundancyOptimizer | PostLocalSGDOptimizer):
            raise ValueError(
                f"Currently model averaging cannot work with a distributed optimizer of type {type(inner).__name__}."
            )
    return PeriodicModelAverager(period=period, warmup_steps=config.state.start_localSGD_iter)


@dataclass(eq=False)
class CollectiveBytes:
    """What the comm hooks all-reduced on this rank while :func:`count_collective_bytes` was open.

    ``calls`` all-reduces; ``bytes_sent``: their input tensors' ``numel * element_size`` summed, the payload
    this rank contributes (a ring all-reduce moves about ``2 * (world_size - 1) / world_size`` times that);
    ``by_dtype``: the same bytes by dtype name (``"torch.bfloat16"``).
    """

    calls: int = 0
    by_dtype: dict[str, int] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def bytes_sent(self) -> int:
        """Bytes all-reduced by this rank, all dtypes together."""
        return sum(self.by_dtype.values())


_open: list[CollectiveBytes] = []  # the counters of the count_collective_bytes() blocks now open


def _count(tensors: list[torch.Tensor]) -> None:
    for counts in _open:
        with counts._lock:
            counts.calls += 1
            for t in tensors:
                counts.by_dtype[str(t.dtype)] = counts.by_dtype.get(str(t.dtype), 0) + t.numel() * t.element_size()


@contextmanager
def count_collective_bytes() -> Generator[CollectiveBytes, None, None]:
    """Count the gradient all-reduces of the registered DDP comm hooks, and their bytes, on this rank.

    Counts what every hook registered by ``MyDDPStrategy(ddp_comm_hook=...)`` (or :func:`register_comm_hook`)
    sends over its process group: the built-in hooks and any hook whose state is a process group or a
    ``PowerSGDState`` (PowerSGD: its P and Q factors and uncompressed tensors). Nothing is patched: the hook's
    process group is a counting wrapper, which counts only while a block is open (blocks may nest; process-wide).
    Not counted: DDP's own C++ all-reduce when no hook is registered (register ``ddp_comm_hook="allreduce"``,
    the same algorithm, to measure the uncompressed baseline) and collectives outside the hooks.
    """
    counts = CollectiveBytes()
    _open.append(counts)
    try:
        yield counts
    finally:
        _open.remove(counts)
