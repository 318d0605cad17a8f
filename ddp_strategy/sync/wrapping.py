"""Wrapping the LightningModule in DistributedDataParallel, and unwrapping it.

:class:`torch.nn.parallel.DistributedDataParallel` broadcasts rank 0's parameters and buffers when it is
built, then all-reduces (averages) gradients bucket by bucket while backward runs, so every rank applies
the same update (https://pytorch.org/docs/stable/notes/ddp.html).
"""

from __future__ import annotations

import inspect
import logging
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ddp_strategy._compat import lightning_private as _pl
from ddp_strategy.process import device_ids

log = logging.getLogger(__name__)

#: ``DistributedDataParallel`` arguments the strategy sets itself; users may pass any other one.
_SET_BY_STRATEGY = ("self", "module", "device_ids", "output_device")
#: Keyword options accepted by ``MyDDPStrategy(**ddp_kwargs)``: those of the installed PyTorch's DDP.
DDP_OPTIONS: tuple[str, ...] = tuple(
    name for name in inspect.signature(DistributedDataParallel.__init__).parameters if name not in _SET_BY_STRATEGY
)
#: Defaults this package changes from DDP's: none, so that code written for Lightning's ``ddp`` (which passes
#: DDP's defaults) runs unchanged; ``gradient_as_bucket_view=True`` saves one gradient-sized copy of memory.
DDP_DEFAULTS: dict[str, Any] = {}


#: DistributedDataParallel's own defaults for the options MyDDPStrategy names explicitly.
_DDP_OWN_DEFAULTS: dict[str, Any] = {"find_unused_parameters": False, "static_graph": False,
                                     "gradient_as_bucket_view": False, "bucket_cap_mb": None,
                                     "broadcast_buffers": True}


def non_default_options(named: dict[str, Any]) -> dict[str, Any]:
    """Keep the named DDP options that differ from DDP's defaults, plus this package's own defaults.

    So ``MyDDPStrategy()`` passes DDP no option and the logged options stay short; an explicit
    ``find_unused_parameters=True`` is passed on.
    """
    return {k: v for k, v in named.items() if k in DDP_DEFAULTS or v != _DDP_OWN_DEFAULTS.get(k)}


def validate_ddp_kwargs(ddp_kwargs: dict[str, Any]) -> dict[str, Any]:
    """Check DDP keyword options by name and fill in this package's defaults.

    Args:
        ddp_kwargs: options for :class:`~torch.nn.parallel.DistributedDataParallel`, such as
            ``find_unused_parameters=True`` or ``bucket_cap_mb=25`` (MiB).

    Returns:
        A new dict: :data:`DDP_DEFAULTS` updated with ``ddp_kwargs``.

    Raises:
        TypeError: an option is not a ``DistributedDataParallel`` argument, or is one the strategy sets
            itself (``device_ids``, ``output_device``).
    """
    unknown = sorted(set(ddp_kwargs) - set(DDP_OPTIONS))
    if unknown:
        raise TypeError(
            f"MyDDPStrategy got unknown DistributedDataParallel option(s) {unknown}. The strategy sets"
            f" device_ids and output_device itself; valid options are {sorted(DDP_OPTIONS)}."
        )
    return {**DDP_DEFAULTS, **ddp_kwargs}


def check_trainable(module: nn.Module) -> None:
    """Refuse a module with no parameter that requires a gradient: there is nothing for DDP to synchronise.

    Every rank holds the same module, so every rank raises, before DDP's own less helpful error.

    Raises:
        ValueError: no parameter has ``requires_grad=True``.
    """
    if not any(p.requires_grad for p in module.parameters()):
        raise ValueError(
            f"{type(module).__name__} has no parameters that require a gradient, so there is nothing to train or"
            " to all-reduce. Unfreeze some parameters (requires_grad=True), or use trainer.validate/test/predict,"
            " which do not wrap the model."
        )


def wrap_module(module: nn.Module, device: torch.device, ddp_kwargs: dict[str, Any]) -> DistributedDataParallel:
    """Wrap ``module`` (already on ``device``) in ``DistributedDataParallel``.

    A collective: every rank must call it (DDP broadcasts rank 0's parameters and buffers here). On CUDA
    the wrapper is built on a side stream, as PyTorch's CUDA-semantics notes advise.

    Args:
        module: the LightningModule, on this rank's device.
        device: this rank's device.
        ddp_kwargs: options from :func:`validate_ddp_kwargs`.

    Returns:
        The wrapped module; ``wrapper.module is module``.

    Raises:
        RuntimeError: from DDP when no process group is initialised.
    """
    ids = device_ids(device)
    log.debug("wrapping %s in DDP: device_ids=%s options=%s", type(module).__name__, ids, ddp_kwargs)
    ctx = torch.cuda.stream(torch.cuda.Stream()) if ids is not None else nullcontext()
    with ctx:
        return DistributedDataParallel(module, device_ids=ids, **ddp_kwargs)


def release_process_group(model: DistributedDataParallel) -> None:
    """After a failed run: drop the wrapper's references to its process group, so destroying the group closes it.

    A DDP wrapper holds its group twice, in ``process_group`` and in its C++ reducer (and the reducer's logger).
    When the run failed, the propagating exception's frames keep the wrapper alive, so without this the group,
    and with gloo its connections to the other ranks, would live until this process exits, and the other ranks
    (blocked in a collective) could not learn of the failure before then. The wrapper is unusable afterwards;
    the strategy has already swapped it for the plain module.
    """
    for name in ("logger", "reducer"):
        if hasattr(model, name):
            delattr(model, name)
    model.process_group = None


def unwrap_module(model: nn.Module) -> nn.Module:
    """Return the module inside a ``DistributedDataParallel`` wrapper, or ``model`` itself."""
    return model.module if isinstance(model, DistributedDataParallel) else model


def broadcast_module_states(module: nn.Module, src: int = 0, buffers: bool = True) -> None:
    """Copy rank ``src``'s parameters (and buffers, if ``buffers``) to every rank, in place.

    Used when evaluating without the DDP wrapper (validate, test, predict), so all ranks evaluate the
    same weights; ``buffers`` follows the strategy's ``broadcast_buffers``. A collective: every rank must
    call it with the same module structure and flag. A no-op without a process group.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    with torch.no_grad():
        for tensor in [*module.parameters(), *(module.buffers() if buffers else ())]:
            dist.broadcast(tensor.data, src=src)


def broadcast_buffers(module: nn.Module, src: int = 0) -> None:
    """Copy rank ``src``'s buffers (BatchNorm running statistics, ...) to every rank, in place.

    What DDP's ``broadcast_buffers=True`` does before each forward (PyTorch's ``_sync_buffers``), done
    with public collectives. A collective: every rank must call it with the same module structure. A
    no-op without a process group.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    with torch.no_grad():
        for tensor in module.buffers():
            dist.broadcast(tensor.data, src=src)


class DDPForwardRedirection(_pl.ForwardRedirection):
    """Routes ``training_step`` through DDP's ``forward``, with manual optimization handled.

    Under manual optimization ``training_step`` calls ``manual_backward`` inside the forward call, so DDP
    must not prepare its reducer after forward; the strategy's ``pre_backward`` does it instead. This is
    the same behaviour as Lightning's own DDP strategy.

    DDP's "Expected to have finished reduction in the prior iteration" error (raised on every rank by the
    forward after a backward that left parameters without gradient) is re-raised with the names of those
    parameters and the option to turn on.
    """

    def __call__(self, wrapper_module: nn.Module, original_module: Any, method_name: str, *args: Any,
                 **kwargs: Any) -> Any:
        try:
            return super().__call__(wrapper_module, original_module, method_name, *args, **kwargs)
        except RuntimeError as e:
            if isinstance(wrapper_module, DistributedDataParallel) and _UNFINISHED_REDUCTION in str(e):
                names = parameters_without_grad(original_module)
                raise RuntimeError(unused_parameters_message(names, dist.get_rank())) from e
            raise

    def on_after_inner_forward(self, wrapper_module: nn.Module, original_module: Any) -> None:
        if isinstance(wrapper_module, DistributedDataParallel) and not original_module.automatic_optimization:
            wrapper_module.require_backward_grad_sync = False

    def on_after_outer_forward(self, wrapper_module: nn.Module, original_module: Any) -> None:
        if isinstance(wrapper_module, DistributedDataParallel) and not original_module.automatic_optimization:
            wrapper_module.require_backward_grad_sync = True


def prepare_manual_backward(model: nn.Module, loss: torch.Tensor) -> None:
    """Prepare DDP's reducer before a ``manual_backward`` (manual optimization only); no-op otherwise."""
    if isinstance(model, DistributedDataParallel):
        _pl.prepare_for_backward(model, loss)


_UNFINISHED_REDUCTION = "Expected to have finished reduction"


def resolve_process_group(ddp_kwargs: dict[str, Any]) -> dict[str, Any]:
    """Create a user's process group now that the world group exists.

    ``MyDDPStrategy(process_group=fn)`` may pass a zero-argument callable (e.g.
    ``lambda: dist.new_group([0, 1])``): the group can only be built after ``init_process_group``, which
    happens in each rank after launch. A collective when ``fn`` creates a group: called on every rank.

    Returns:
        ``ddp_kwargs`` with ``process_group`` replaced by ``fn()``; unchanged if it is a group or absent.
    """
    group = ddp_kwargs.get("process_group")
    if callable(group) and not isinstance(group, dist.ProcessGroup):
        return {**ddp_kwargs, "process_group": group()}
    return ddp_kwargs


def parameters_without_grad(module: nn.Module) -> list[str]:
    """Names of parameters that require grad but have ``.grad is None`` (got no gradient in backward)."""
    return [name for name, p in module.named_parameters() if p.requires_grad and p.grad is None]


def unused_parameters_message(names: list[str], rank: int) -> str:
    """The error for parameters that got no gradient while ``find_unused_parameters=False``."""
    return (
        f"[rank {rank}] {len(names)} parameter(s) received no gradient in backward: {names}. With"
        " find_unused_parameters=False (the default) DDP waits for a gradient of every parameter, so the"
        " gradient all-reduce can never finish. Pass MyDDPStrategy(find_unused_parameters=True) (costs one"
        " graph traversal per step), or remove / freeze (requires_grad=False) those parameters, or use"
        " static_graph=True if the same parameters are unused in every step."
    )


def check_unused_parameters(model: nn.Module, device: torch.device) -> None:
    """After a backward, raise on every rank if any rank has parameters that got no gradient.

    Meant for the first backward with ``find_unused_parameters=False`` and ``static_graph=False``: DDP
    itself only notices at the next forward, and only by parameter index. A collective (one all-reduce
    of P int32 flags, P = number of parameter tensors): every rank must call it, so all ranks agree and
    raise the same error instead of some of them hanging.

    Args:
        model: the DDP wrapper or the plain module, right after backward.
        device: this rank's device (NCCL needs CUDA tensors).

    Raises:
        RuntimeError: naming the parameters without gradient on any rank and ``find_unused_parameters``.
    """
    module = unwrap_module(model)
    names = [name for name, p in module.named_parameters() if p.requires_grad]
    missing = set(parameters_without_grad(module))
    flags = torch.tensor([name in missing for name in names], dtype=torch.int32, device=device)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    unused = [name for name, flag in zip(names, flags.tolist(), strict=False) if flag]
    if unused:
        raise RuntimeError(unused_parameters_message(unused, dist.get_rank() if dist.is_initialized() else 0))


def needs_unused_parameter_check(ddp_kwargs: dict[str, Any]) -> bool:
    """Whether DDP runs without its own unused-parameter handling (then the strategy checks once)."""
    return not ddp_kwargs.get("find_unused_parameters", False) and not ddp_kwargs.get("static_graph", False)
