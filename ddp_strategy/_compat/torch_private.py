"""Every use of PyTorch's private (underscore) API, in one place.

PyTorch calls these "prototype" interfaces and may change them in any release. ``tests/_compat/test_torch_private.py``
checks each one against the installed PyTorch, so an upgrade that moves or changes one fails loudly there;
at run time each wrapper degrades to "no data" instead of failing a training run. Tested with torch 2.13.
"""

from __future__ import annotations

import contextlib
from typing import Any, cast

import torch.distributed as dist
from torch import nn

#: Keys of ``DistributedDataParallel._get_ddp_logging_data()`` this package reads. Times are in nanoseconds,
#: averaged by DDP's reducer over the iterations it samples (each of the first 10, then every 100th; the
#: first iteration is not timed). Populated on gloo/CPU and NCCL/CUDA alike in torch 2.13.
DDP_TIMING_KEYS: tuple[str, ...] = (
    "avg_forward_compute_time",
    "avg_backward_compute_time",
    "avg_backward_comm_time",
    "avg_backward_compute_comm_overlap_time",
)


def ddp_logging_data(model: nn.Module | None) -> dict[str, Any]:
    """A new dict of ``DistributedDataParallel._get_ddp_logging_data()`` for ``model``; ``{}`` if it is no DDP
    wrapper (None included) or the call fails.

    It holds the constructor options (``bucket_cap_bytes``, ...), ``comm_hook`` (once one is registered),
    ``unused_parameter_size`` (bytes) and the timings in :data:`DDP_TIMING_KEYS` (once DDP has timed one).
    """
    with contextlib.suppress(AttributeError, RuntimeError):  # the reducer can be gone after a failed step:
        return dict(cast(Any, model)._get_ddp_logging_data())  # (diagnostics must not fail the run)
    return {}


def release_ddp_process_group(model: Any) -> None:
    """After a failed run: drop a DDP wrapper's references to its group (``process_group``, its private C++
    ``reducer`` and ``logger``), so destroying the group closes it while the exception's frames keep the wrapper
    alive, and peers blocked in a collective learn of the failure now. The wrapper is unusable afterwards.
    """
    for name in ("logger", "reducer"):
        if hasattr(model, name):
            delattr(model, name)
    model.process_group = None


def broadcast_coalesced(tensors: list[Any], src: int = 0) -> None:
    """Broadcast ``tensors`` from rank ``src`` in place, coalesced into 250 MiB buckets, over the world group.

    Wraps ``torch.distributed.utils._sync_params_and_buffers`` (``dist._broadcast_coalesced``), what DDP uses
    to sync module states at construction. A collective: every rank passes tensors of the same shapes and
    dtypes, on one device.
    """
    from torch.distributed.utils import _sync_params_and_buffers

    _sync_params_and_buffers(cast(dist.ProcessGroup, dist.group.WORLD), tensors, 250 * 2**20, src)


class CountingProcessGroup:
    """A process group (``None`` = the world, looked up at each call) whose ``allreduce`` calls ``count(tensors)``.

    Relies on ``torch.distributed.all_reduce(t, group=g)`` calling ``g.allreduce([t], opts)`` and the comm hooks
    calling only ``all_reduce`` and ``size()`` on their group (guarded by ``tests/_compat/test_torch_private.py``);
    everything else is forwarded to the group.
    """

    def __init__(self, group: Any, count: Any) -> None:
        self.group, self.count = group, count

    def _target(self) -> Any:
        return self.group if self.group is not None else dist.group.WORLD

    def __getattr__(self, name: str) -> Any:
        if name in ("group", "count"):  # not yet set (copy, unpickling)
            raise AttributeError(name)
        return getattr(self._target(), name)

    def allreduce(self, tensors: list[Any], *args: Any) -> Any:
        self.count(tensors)
        return self._target().allreduce(tensors, *args)


def release_world_defaults(world: Any) -> None:
    """Replace ``world`` by ``None`` (the default group, as torch reads ``group=None``) in the default arguments of
    ``torch.distributed.nn.functional``'s collectives and ``zero_redundancy_optimizer._broadcast_object``: they take
    ``group=dist.group.WORLD``, evaluated on import, so imported while a group exists (Ray Train makes it before
    ``train_func`` imports Lightning, which imports them) they hold it, and destroying it would not close it."""
    from torch.distributed.nn import functional as f
    from torch.distributed.optim import zero_redundancy_optimizer as zero

    for function in (
        *(f.broadcast, f.gather, f.scatter, f.reduce, f.reduce_scatter, f.all_gather, f._all_gather_base),
        *(f.all_to_all, f.all_to_all_single, f.all_reduce, zero._broadcast_object),
    ):
        function.__defaults__ = tuple(None if d is world else d for d in function.__defaults__ or ())


def default_store() -> Any:
    """The default process group's store (``distributed_c10d._get_default_store()``), where
    :mod:`ddp_strategy.process.failures` keeps its reports.

    Raises:
        ValueError: no default process group.
    """
    return dist.distributed_c10d._get_default_store()


#: The attribute (and the state-dict key segment) under which ``torch.compile``'s ``OptimizedModule`` keeps the
#: module it compiled: ``torch.compile(net).state_dict()`` keys are ``"_orig_mod.<net's key>"``.
COMPILE_SEGMENT = "_orig_mod"


def compiled_original(module: Any) -> nn.Module | None:
    """The module ``torch.compile`` wrapped, if ``module`` is its ``OptimizedModule`` (matched by class name, so
    ``torch._dynamo`` is not imported); else None."""
    return getattr(module, COMPILE_SEGMENT, None) if type(module).__name__ == "OptimizedModule" else None


def set_ddp_join_mode(ddp: Any, enabled: bool) -> None:
    """Make ``ddp``'s forward act as inside DDP's join context (``enabled``) or not: broadcast buffers from the
    highest rank that still has inputs (rank 0 may have none) and tell the joined ranks whether the backward syncs
    gradients (one all-reduce each, matched by :func:`shadow_ddp_forward`). As a joinable that is not the first, so
    DDP makes no notification of its own (``_join_config``; ``DistributedDataParallel._pre_forward``)."""
    from torch.distributed.algorithms.join import _JoinConfig

    ddp._join_config = _JoinConfig(True, False, False) if enabled else _JoinConfig.construct_disabled_join_config()


def shadow_ddp_forward(ddp: Any) -> None:
    """On a rank that has joined (run out of inputs): take part in the collectives of DDP's forward in join mode on
    the others, as DDP's own join hook (``_DDPJoinHook.main_hook``) does: the one-time bucket rebuild, the buffer
    broadcast from the highest active rank, the all-reduce saying whether the backward syncs gradients."""
    ddp.reducer._rebuild_buckets()
    ddp._check_and_sync_module_buffers()
    ddp.require_forward_param_sync = ddp._check_global_requires_backward_grad_sync(is_joined_rank=True)


def shadow_ddp_backward(ddp: Any) -> None:
    """On a joined rank: take part in the gradient all-reduce of the others' backward with zeros (one per bucket,
    in the reducer's order, through its comm hook) and, with ``find_unused_parameters``, in the used-parameter
    all-reduce; then record the bucket order as DDP's join hook does (``_push_all_rebuilt_params``)."""
    ddp._match_all_reduce_for_bwd_pass()
    if ddp.find_unused_parameters:
        ddp._match_unused_params_allreduce()
    ddp.reducer._push_all_rebuilt_params()


def set_gradient_divisor(ddp: Any, work: Any, static: bool) -> None:
    """Have ``ddp``'s reducer divide the next backward's gradients by the sum ``work`` (an all-reduce of one
    number per rank with inputs, as torch's ``Join.notify_join_context`` makes) computes, or (``static``, or ``work``
    None: no handle, as outside a join) by the world size: DDP's ``divide_by_initial_world_size``
    (``Reducer._set_forward_pass_work_handle``)."""
    ddp.reducer._set_forward_pass_work_handle(work, static)


def all_reduce_first_static_graph_step(model: Any) -> None:
    """After a backward: if ``model`` is a DDP wrapper with ``static_graph=True`` whose first step's gradients are
    not yet all-reduced, all-reduce them now (every rank, a collective), as DDP does at the end of the first
    backward through its output (``_DDPSink.backward`` queues ``reducer._delay_all_reduce``). A backward not through
    DDP's output (``manual_backward`` inside ``training_step``) never does; Lightning's ``DDPStrategy.post_backward``
    calls it there (Lightning-AI/pytorch-lightning#21251). Else a no-op."""
    if getattr(model, "static_graph", False) and not model._static_graph_delay_allreduce_enqueued:
        model._static_graph_delay_allreduce_enqueued = True
        model.reducer._delay_all_reduce()
