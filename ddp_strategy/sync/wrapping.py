"""Wrapping the LightningModule in DistributedDataParallel, its options, and the checks around it.

:class:`torch.nn.parallel.DistributedDataParallel` broadcasts rank 0's parameters and buffers when it is
built, then all-reduces (averages) gradients bucket by bucket while backward runs, so every rank applies
the same update (https://pytorch.org/docs/stable/notes/ddp.html).
"""

from __future__ import annotations

import inspect
import logging
from contextlib import nullcontext
from operator import attrgetter
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ddp_strategy import process
from ddp_strategy._compat import lightning_private as _pl
from ddp_strategy._compat import torch_private as _torch_private
from ddp_strategy.sync import comm_hooks

log = logging.getLogger(__name__)

#: DDP's keyword options and their defaults, from the installed PyTorch's signature, less those the strategy sets.
DDP_DEFAULTS: dict[str, Any] = {
    name: p.default
    for name, p in inspect.signature(DistributedDataParallel).parameters.items()
    if name not in ("module", "device_ids", "output_device")
}


def ddp_options(named: dict[str, Any], ddp_kwargs: dict[str, Any]) -> dict[str, Any]:
    """The options DDP is built with: the ``named`` ones (``MyDDPStrategy(find_unused_parameters=...)``) that differ
    from DDP's defaults, so ``MyDDPStrategy()`` passes DDP none, then ``ddp_kwargs`` as given, checked by name
    (``bucket_cap_mb=25`` is in MiB). ``broadcast_buffers=None`` in DDP's signature means True (torch 2.13 warns
    when it is passed at all).

    Raises:
        TypeError: an option in ``ddp_kwargs`` is not a ``DistributedDataParallel`` argument, or is one the strategy
            sets itself (``device_ids``, ``output_device``).
    """
    if unknown := sorted(set(ddp_kwargs) - set(DDP_DEFAULTS)):
        raise TypeError(
            f"MyDDPStrategy got unknown DistributedDataParallel option(s) {unknown}. The strategy sets"
            f" device_ids and output_device itself; valid options are {sorted(DDP_DEFAULTS)}."
        )
    changed = {k: v for k, v in named.items() if v != DDP_DEFAULTS[k] and not (v is True and DDP_DEFAULTS[k] is None)}
    return {**changed, **ddp_kwargs}


class LightningDDPAttributes:
    """``DDPStrategy``'s attributes that Lightning's tests and callbacks read (read-only, its values for our args, but
    ``_ddp_kwargs`` leaves out an option passed with DDP's default value), and its methods that subclasses override,
    called where Lightning's calls them."""

    _model_averager: Any = None  #: post-localSGD's ``PeriodicModelAverager`` (Lightning's), set at setup

    def _get_process_group_backend(self: Any) -> str:
        """The backend, else torch's default for ``root_device`` (``"nccl"`` on CUDA, ``"gloo"`` on CPU)."""
        return self._process_group_backend or dist.Backend.default_device_backend_map.get(self.root_device.type, "gloo")

    # Lightning's attributes, read from where the strategy keeps each (``attrgetter`` follows the dotted path).
    process_group_backend = property(attrgetter("_process_group_backend"), doc="In use after setup, else passed.")
    _ddp_kwargs = property(lambda self: dict(self._options.ddp_kwargs), doc="The options DDP is built with (a copy).")
    _timeout = property(attrgetter("_options.timeout"), doc="``timeout`` as a ``timedelta``.")
    _start_method = property(attrgetter("_options.start_method"), doc="``start_method`` as resolved.")
    _ddp_comm_hook = property(attrgetter("_options.comm_hook.hook"), doc="``ddp_comm_hook`` as passed.")
    _ddp_comm_state = property(attrgetter("_options.comm_hook.state"), doc="``ddp_comm_state`` as passed.")
    _ddp_comm_wrapper = property(attrgetter("_options.comm_hook.wrapper"), doc="``ddp_comm_wrapper`` as passed.")

    def determine_ddp_device_ids(self: Any) -> list[int] | None:
        """DDP's ``device_ids``: ``None`` on CPU, else ``[root_device.index]``."""
        return None if self.root_device.type == "cpu" else [self.root_device.index]

    def configure_ddp(self: Any) -> None:
        """At setup when fitting (Lightning's): ``self.model = self._setup_model(self.model)``, then
        :meth:`_register_ddp_hooks`. A collective, on every rank."""
        self.model = self._setup_model(self.model)
        self._register_ddp_hooks()

    def _setup_model(self: Any, model: nn.Module) -> DistributedDataParallel:
        """``model`` wrapped in DDP with the strategy's options (:func:`wrap`); no comm hook yet."""
        return wrap(model, self.root_device, self._options.ddp_kwargs, comm_hooks.CommHookConfig())

    def _register_ddp_hooks(self: Any) -> None:
        """Register the comm hook on ``self.model`` (every backend; Lightning's only on CUDA): see
        :func:`~ddp_strategy.sync.comm_hooks.register_comm_hook`; post-localSGD's default subgroup is the node's."""
        comm_hooks.register_comm_hook(self.model, self._options.comm_hook, self.node_group)


def wrap(
    model: nn.Module,
    device: torch.device,
    ddp_kwargs: dict[str, Any],
    comm_hook: comm_hooks.CommHookConfig,
    defer: bool = False,
) -> DistributedDataParallel:
    """Wrap ``model`` (already on ``device``) in DDP and register the comm hook (every backend); called again with
    the wrapper, wrap its module anew where the parameters that require a gradient changed since it was built.

    A collective: every rank must call it (DDP broadcasts rank 0's parameters and buffers here). On CUDA the
    wrapper is built on a side stream, as PyTorch's CUDA-semantics notes advise. ``process_group`` may be a
    zero-argument callable (e.g. ``lambda: dist.new_group([0, 1])``), called here on every rank, since a group
    can only be built after ``init_process_group``.

    DDP registers only the parameters with ``requires_grad`` when it is built (Lightning-AI/pytorch-lightning#20340):
    one unfrozen later (``BackboneFinetuning``, a callback's ``requires_grad_(True)``) would never be all-reduced,
    one frozen later would leave DDP's reducer waiting for its gradient. So the strategy calls this again before
    every training step's forward: unless that set (compared by identity, P tensors, no collective) changed, the
    wrapper comes back as is; else a new one over the same module, options and process group, the comm hook
    registered again (a ``PowerSGDState``'s per-bucket memories restart), the optimizer untouched (it holds the
    same parameters). Gradients that parameters frozen since hold are averaged over the group first (earlier
    micro-batches of an accumulation window), so the step equals one process's. Within ``no_sync`` (an
    accumulation window's earlier micro-batches, whose gradients stay local anyway: the final one re-wraps and
    all-reduces what accumulated), with ``defer`` (a step some ranks only shadow) or with nothing left to train
    (backward's error then, as under Lightning's ddp) the wrapper stays. Every rank must change the same parameters at
    the same step (the same user code does). A wrapper not built here (a subclass's ``_setup_model``) stays as it is.

    Returns:
        The wrapper (``wrapper.module`` is the module).

    Raises:
        ValueError: no parameter requires a gradient, at the first call (every rank raises, before DDP's error).
    """
    module = model.module if isinstance(model, DistributedDataParallel) else model
    trainable = tuple(id(p) for p in module.parameters() if p.requires_grad)  # identities: a swap shows
    if isinstance(model, DistributedDataParallel):
        if defer or not model.require_backward_grad_sync or trainable in ((), getattr(model, "_trainable", trainable)):
            return model
        for grad in [p.grad for p in module.parameters() if p.grad is not None and not p.requires_grad]:
            dist.all_reduce(grad.div_(model.process_group.size()), group=model.process_group)
        ddp_kwargs = {**ddp_kwargs, "process_group": model.process_group}
    if not trainable:
        raise ValueError(
            f"{type(module).__name__} has no parameters that require a gradient, so there is nothing to train or"
            " to all-reduce. Unfreeze some parameters (requires_grad=True), or use trainer.validate/test/predict,"
            " which do not wrap the model."
        )
    group = ddp_kwargs.get("process_group")
    if callable(group) and not isinstance(group, dist.ProcessGroup):
        ddp_kwargs = {**ddp_kwargs, "process_group": group()}
    ids = process.device_ids(device)
    log.debug("wrapping %s in DDP: device_ids=%s options=%s", type(module).__name__, ids, ddp_kwargs)
    with torch.cuda.stream(torch.cuda.Stream()) if ids is not None else nullcontext():
        wrapper = DistributedDataParallel(module, device_ids=ids, **ddp_kwargs)
    cast(Any, wrapper)._trainable = trainable  # a plain attribute: torch hints __setattr__ for tensors, modules
    comm_hooks.register_comm_hook(wrapper, comm_hook)
    return wrapper


def unwrap(model: nn.Module | None, failed: bool = False) -> nn.Module | None:
    """The module inside a DDP wrapper (or ``model`` itself); after a failed run the wrapper also lets go of its
    process group (:func:`~ddp_strategy._compat.torch_private.release_ddp_process_group`), so destroying the
    group closes its connections and the other ranks learn of the failure at once."""
    if failed and isinstance(model, DistributedDataParallel):
        _torch_private.release_ddp_process_group(model)
    return model.module if isinstance(model, DistributedDataParallel) else model


def broadcast_states(module: nn.Module, parameters: bool = True, buffers: bool = True) -> None:
    """Copy rank 0's parameters and/or buffers to every rank, in place, in 250 MiB buckets (DDP's own sync).

    Used for validate/test/predict (no DDP wrapper: rank 0's parameters, and buffers if ``broadcast_buffers``) and
    at each validation run's first step while fitting (buffers only). A collective: every rank must call it with the
    same module and flags. A no-op without a process group or with one rank.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    tensors = [*(module.parameters() if parameters else ()), *(module.buffers() if buffers else ())]
    _torch_private.broadcast_coalesced([t.detach() for t in tensors], src=0)  # detached: in place, outside autograd


class DDPForwardRedirection(_pl.DDPForwardRedirection):
    """Routes ``training_step`` through DDP's ``forward``, with manual optimization handled (Lightning DDP's).

    Under manual optimization ``training_step`` calls ``manual_backward`` inside the forward call, so DDP must
    not prepare its reducer after forward; the strategy's ``pre_backward`` does it instead. DDP's "Expected to
    have finished reduction in the prior iteration" error (raised on every rank by the forward after a backward
    that left parameters without gradient) is re-raised with the names of those parameters and the option.
    """

    def __call__(
        self, wrapper_module: nn.Module, original_module: Any, method_name: str, *args: Any, **kwargs: Any
    ) -> Any:
        try:
            return super().__call__(wrapper_module, original_module, method_name, *args, **kwargs)
        except RuntimeError as e:
            if isinstance(wrapper_module, DistributedDataParallel) and "Expected to have finished reduction" in str(e):
                raise RuntimeError(
                    unused_parameters_message(
                        _without_grad(original_module), dist.get_rank(), wrapper_module.static_graph
                    )
                ) from e
            raise


def _without_grad(module: nn.Module) -> list[str]:
    return [name for name, p in module.named_parameters() if p.requires_grad and p.grad is None]


def unused_parameters_message(names: list[str], rank: int, static_graph: bool = False) -> str:
    """The error for parameters that got no gradient while ``find_unused_parameters=False``; with
    ``static_graph``, that the graph changed (after the first step, which DDP records)."""
    return f"[rank {rank}] {len(names)} parameter(s) received no gradient in backward: {names}. " + (
        "The graph changed: static_graph=True promises that every step uses the same parameters as the first (DDP"
        " records them there, and waits for those gradients in every later step). Pass"
        " MyDDPStrategy(static_graph=False, find_unused_parameters=True) for a graph that changes between steps."
        if static_graph
        else "With find_unused_parameters=False (the default) DDP waits for a gradient of every parameter, so the"
        " gradient all-reduce can never finish. Pass MyDDPStrategy(find_unused_parameters=True) (costs one"
        " graph traversal per step), or remove / freeze (requires_grad=False) those parameters, or use"
        " static_graph=True if the same parameters are unused in every step."
    )


def after_backward(model: nn.Module, first_step: bool) -> None:
    """After each backward (``strategy.post_backward``), on this rank alone; ``first_step``: before the first
    optimizer step. No collective but DDP's own.

    - A DDP wrapper with ``static_graph=True`` whose first step's gradients are not all-reduced yet (a backward
      that did not go through DDP's output: ``manual_backward`` inside ``training_step``) all-reduces them now
      (:func:`~ddp_strategy._compat.torch_private.all_reduce_first_static_graph_step`), as Lightning's DDP does.
    - Before the first optimizer step, in a backward that syncs gradients (not under ``no_sync``), with
      ``find_unused_parameters`` and ``static_graph`` off: parameters of this rank that got no gradient are
      named. DDP itself only notices at the next forward, by parameter index. The check makes no collective (one
      would pair with DDP's bucket all-reduce, which a peer that got every gradient is in by now); this rank's
      teardown leaves the group, which breaks that all-reduce within seconds, and the peers name this rank and its
      error (:mod:`ddp_strategy.process.failures`).

    Raises:
        RuntimeError: naming this rank's parameters without gradient and ``find_unused_parameters``.
    """
    _torch_private.all_reduce_first_static_graph_step(model)
    if (
        first_step
        and isinstance(model, DistributedDataParallel)
        and model.require_backward_grad_sync
        and not (model.find_unused_parameters or model.static_graph)
        and (unused := _without_grad(model.module))
    ):
        raise RuntimeError(unused_parameters_message(unused, dist.get_rank()))
