"""Step 3 for the strategy: one object that wraps the module in DDP, keeps the ranks' gradients in step, unwraps.

:class:`GradientSync` is the only thing :class:`~ddp_strategy.strategy.MyDDPStrategy` calls for gradient
synchronisation. It holds the DDP options, the communication hook and the parameter-sync check, and calls
:mod:`ddp_strategy.sync.wrapping`, :mod:`~ddp_strategy.sync.comm_hooks`,
:mod:`~ddp_strategy.sync.sync_batchnorm` and :mod:`~ddp_strategy.sync.rank_check` in the order
``DistributedDataParallel`` needs (https://pytorch.org/docs/stable/notes/ddp.html).
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ddp_strategy.sync import comm_hooks, rank_check, sync_batchnorm, wrapping


class GradientSync:
    """DDP wrapping and the checks around it, for one strategy (state kept across fits).

    Args:
        ddp_kwargs: options for :class:`~torch.nn.parallel.DistributedDataParallel`, already validated
            (:func:`ddp_strategy.sync.wrapping.validate_ddp_kwargs`); ``process_group`` may be a zero-argument
            callable that builds the group after launch.
        comm_hook: the communication hook to register (:class:`~ddp_strategy.sync.comm_hooks.CommHookConfig`).
        verify_every_n_steps: compare parameter checksums across ranks every N optimizer steps; None = never.
    """

    def __init__(self, ddp_kwargs: dict[str, Any], comm_hook: comm_hooks.CommHookConfig,
                 verify_every_n_steps: int | None) -> None:
        self.ddp_kwargs = ddp_kwargs
        self.comm_hook = comm_hook
        self.verify_every_n_steps = verify_every_n_steps
        self.optimizer_steps = 0
        self._check_unused_after_backward = False

    @property
    def broadcasts_buffers(self) -> bool:
        """DDP's ``broadcast_buffers`` option (default True)."""
        return bool(self.ddp_kwargs.get("broadcast_buffers", True))

    @staticmethod
    def sync_layers(layer_sync: Any, module: nn.Module) -> tuple[Any, nn.Module]:
        """Apply ``Trainer(sync_batchnorm=True)``'s plugin (Lightning's default swapped for one that also works on
        CPU); return the plugin used and the converted module. Without a plugin, both unchanged."""
        if not layer_sync:
            return layer_sync, module
        layer_sync = sync_batchnorm.cpu_capable(layer_sync)
        return layer_sync, layer_sync.apply(module)

    @staticmethod
    def unwrap(model: nn.Module | None, module: nn.Module | None, layer_sync: Any, fitting: bool,
               failed: bool = False) -> nn.Module | None:
        """The plain LightningModule ``module`` back from its DDP wrapper ``model``, layer syncing reverted; after a
        failure (``failed``) the wrapper also lets go of its process group (:func:`wrapping.release_process_group`)."""
        if isinstance(model, DistributedDataParallel):
            if failed:
                wrapping.release_process_group(model)
            model = module
        if fitting and layer_sync and model is not None:
            model = layer_sync.revert(model)
        return model

    def wrap(self, module: nn.Module, device: torch.device) -> DistributedDataParallel:
        """Wrap ``module`` (already on ``device``) in DDP and register the comm hook; a collective, every rank.

        DDP broadcasts rank 0's parameters and buffers on construction.

        Raises:
            ValueError: the module has no trainable parameter (DDP would fail with a less clear message).
        """
        wrapping.check_trainable(module)
        model = wrapping.wrap_module(module, device, wrapping.resolve_process_group(self.ddp_kwargs))
        comm_hooks.register_comm_hook(model, self.comm_hook, dist.get_backend())
        self._check_unused_after_backward = wrapping.needs_unused_parameter_check(self.ddp_kwargs)
        self.optimizer_steps = 0
        return model

    def broadcast_states(self, module: nn.Module) -> None:
        """Outside a fit (validate/test/predict): give every rank rank 0's parameters (and buffers). Collective."""
        wrapping.broadcast_module_states(module, buffers=self.broadcasts_buffers)

    def before_validation(self, model: nn.Module) -> None:
        """While fitting with ``broadcast_buffers=True``, give every rank rank 0's buffers. Collective."""
        if isinstance(model, DistributedDataParallel) and self.broadcasts_buffers:
            wrapping.broadcast_buffers(model.module)

    def before_backward(self, model: nn.Module | None, loss: torch.Tensor, module: Any) -> None:
        """Under manual optimization (``module.automatic_optimization`` False), prepare DDP's reducer."""
        if module is not None and not module.automatic_optimization:
            wrapping.prepare_manual_backward(model, loss)

    def after_backward(self, model: nn.Module, device: torch.device) -> None:
        """After the first backward (``find_unused_parameters`` off), name parameters that got no gradient.

        Raises:
            RuntimeError: on every rank, naming the parameters without a gradient.
        """
        if self._check_unused_after_backward:
            self._check_unused_after_backward = False
            wrapping.check_unused_parameters(model, device)

    def after_optimizer_step(self, model: nn.Module | None, device: torch.device) -> None:
        """Count the step; every ``verify_every_n_steps`` steps check that the ranks' parameters agree.

        Raises:
            RuntimeError: on every rank, naming the parameters that differ (:mod:`ddp_strategy.sync.rank_check`).
        """
        self.optimizer_steps += 1
        n = self.verify_every_n_steps
        if n is not None and self.optimizer_steps % n == 0 and model is not None:
            rank_check.verify_parameters_in_sync(wrapping.unwrap_module(model), self.optimizer_steps, device)

    @contextmanager
    def no_sync(self, model: nn.Module | None) -> Generator[None, None, None]:
        """Skip the gradient all-reduce (DDP's ``no_sync``), e.g. for non-final accumulation micro-batches."""
        if isinstance(model, DistributedDataParallel):
            with model.no_sync():
                yield
        else:
            yield
