"""Synchronised batch normalisation on every device, CPU/gloo included.

``Trainer(sync_batchnorm=True)`` gives the strategy Lightning's ``TorchSyncBatchNorm`` plugin, which converts
each BatchNorm layer to :class:`torch.nn.SyncBatchNorm` while fitting and back to a plain BatchNorm at
teardown. PyTorch's ``SyncBatchNorm`` refuses CPU tensors in training ("SyncBatchNorm expected input tensor
to be on GPU or XPU ..."), and DDP refuses it in CPU modules, so the strategy uses :class:`DDPSyncBatchNorm`
instead: CUDA layers become PyTorch's ``SyncBatchNorm``; CPU layers become :class:`CPUSyncBatchNorm`,
which computes the batch statistics over all ranks with differentiable all-reduces
(:func:`torch.distributed.nn.functional.all_reduce`, whose backward all-reduces the incoming gradient),
so outputs, running statistics and gradients equal those of one ``BatchNorm`` over the global batch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm
from typing_extensions import override

from ddp_strategy._compat import namespace as _namespace

if TYPE_CHECKING:
    from lightning.pytorch.plugins import LayerSync, TorchSyncBatchNorm
else:  # built for the user's Lightning namespace on construction (see ddp_strategy._compat.namespace)
    TorchSyncBatchNorm = _namespace.lightning_base("pytorch.plugins:TorchSyncBatchNorm")

_TORCH_SYNC_BATCHNORM = "pytorch.plugins:TorchSyncBatchNorm"


class CPUSyncBatchNorm(_BatchNorm):
    """Batch normalisation whose training statistics are computed over all ranks, for CPU tensors (gloo).

    Not a subclass of ``torch.nn.SyncBatchNorm``: DDP refuses those on CPU modules
    (``DistributedDataParallel._passing_sync_batchnorm_handle``). Training forward, with C channels and
    input (N, C, *) on each rank:

    1. all-reduce ``[sum over (N, *) of x  (C,), local element count per channel (1,)]``;
       ``mean = sum / count`` over the global batch;
    2. all-reduce ``sum over (N, *) of (x - mean)^2`` (C,); ``var = that / count`` (biased, used to normalise);
    3. ``y = (x - mean) / sqrt(var + eps) * weight + bias``; running statistics get ``mean`` and the
       unbiased ``var * count / (count - 1)``, with ``momentum`` exactly as ``BatchNorm`` does.

    Both all-reduces go through :func:`torch.distributed.nn.functional.all_reduce`, whose backward
    all-reduces the incoming gradient, so backward sums every rank's contribution (two more all-reduces
    per layer) and gradients equal those of one BatchNorm over the global batch. The two-pass variance
    avoids the cancellation of ``E[x^2] - E[x]^2``. A collective in training mode: all ranks must run the
    same number of training forwards (the strategy's padded training sampler guarantees it). In eval mode,
    or without a process group, it is plain ``BatchNorm`` (no communication).

    Args:
        num_features, eps, momentum, affine, track_running_stats: as for ``torch.nn.BatchNorm1d``.
        process_group: the group to synchronise over; ``None`` = the world.
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1, affine: bool = True,
                 track_running_stats: bool = True, process_group: dist.ProcessGroup | None = None) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        self.process_group = process_group

    @override
    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (N, C, *), got {input.dim()}D input")

    @override
    def forward(self, input: Tensor) -> Tensor:
        if not self._needs_sync():
            return super().forward(input)
        return self._sync_forward(input)

    def _needs_sync(self) -> bool:
        return (self.training and dist.is_available() and dist.is_initialized()
                and dist.get_world_size(self.process_group or dist.group.WORLD) > 1)

    def _sync_forward(self, x: Tensor) -> Tensor:
        self._check_input_dim(x)
        group = self.process_group or dist.group.WORLD
        dims = [0, *range(2, x.dim())]
        shape = [1, -1] + [1] * (x.dim() - 2)
        local_count = x.new_full((1,), x.numel() // x.size(1))
        totals = dist_fn.all_reduce(torch.cat([x.sum(dims), local_count]), group=group)
        count = totals[-1]
        mean = totals[:-1] / count
        centred = x - mean.view(shape)
        var = dist_fn.all_reduce((centred * centred).sum(dims), group=group) / count
        y = centred * torch.rsqrt(var + self.eps).view(shape)
        if self.affine:
            y = y * self.weight.view(shape) + self.bias.view(shape)
        if self.track_running_stats:
            self._update_running_stats(mean.detach(), var.detach(), count.item())
        return y

    @torch.no_grad()
    def _update_running_stats(self, mean: Tensor, var: Tensor, count: float) -> None:
        assert self.num_batches_tracked is not None and self.running_mean is not None
        self.num_batches_tracked.add_(1)
        momentum = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        unbiased = var * (count / max(count - 1.0, 1.0))
        self.running_mean.lerp_(mean, momentum)
        self.running_var.lerp_(unbiased, momentum)


_SYNCED = (nn.SyncBatchNorm, CPUSyncBatchNorm)
_ORIGINAL_CLASS = "_ddp_strategy_original_class"


def _move_state(source: _BatchNorm, target: _BatchNorm) -> _BatchNorm:
    """Give ``target`` the parameters and buffers (the same tensors) and the train/eval mode of ``source``."""
    if source.affine:
        with torch.no_grad():
            target.weight = source.weight
            target.bias = source.bias
    target.running_mean = source.running_mean
    target.running_var = source.running_var
    target.num_batches_tracked = source.num_batches_tracked
    target.train(source.training)
    if hasattr(source, "qconfig"):
        target.qconfig = source.qconfig
    return target


def convert_sync_batchnorm(module: nn.Module, process_group: dist.ProcessGroup | None = None) -> nn.Module:
    """Replace every BatchNorm layer of ``module`` by a synchronised one that shares its tensors.

    Layers on CPU become :class:`CPUSyncBatchNorm`, others ``torch.nn.SyncBatchNorm`` (as PyTorch's
    ``SyncBatchNorm.convert_sync_batchnorm`` does). Call after the module is on its device. The original
    class is remembered for :func:`revert_sync_batchnorm`.

    Returns:
        ``module`` with its children replaced (or the new layer, if ``module`` itself is a BatchNorm).
    """
    converted = module
    if isinstance(module, _BatchNorm) and not isinstance(module, _SYNCED):
        on_cpu = all(t.device.type == "cpu" for t in [*module.parameters(), *module.buffers()])
        cls = CPUSyncBatchNorm if on_cpu else nn.SyncBatchNorm
        converted = _move_state(module, cls(module.num_features, module.eps, module.momentum, module.affine,
                                            module.track_running_stats, process_group))
        setattr(converted, _ORIGINAL_CLASS, type(module))
    for name, child in module.named_children():
        converted.add_module(name, convert_sync_batchnorm(child, process_group))
    return converted


def revert_sync_batchnorm(module: nn.Module) -> nn.Module:
    """Undo :func:`convert_sync_batchnorm`: synchronised layers become their original BatchNorm class again.

    Layers converted elsewhere (no remembered class) become a plain BatchNorm that accepts any input rank,
    like Lightning's own revert; their state_dict keys are the same either way.

    Returns:
        ``module`` with its children replaced (or the new layer, if ``module`` itself is synchronised).
    """
    reverted = module
    if isinstance(module, _SYNCED):
        cls = getattr(module, _ORIGINAL_CLASS, _AnyDimBatchNorm)
        reverted = _move_state(module, cls(module.num_features, module.eps, module.momentum, module.affine,
                                           module.track_running_stats))
    for name, child in module.named_children():
        reverted.add_module(name, revert_sync_batchnorm(child))
    return reverted


class _AnyDimBatchNorm(_BatchNorm):
    """Plain BatchNorm accepting any input rank (for reverting layers whose original class is unknown)."""

    @override
    def _check_input_dim(self, input: Tensor) -> None:
        return


class DDPSyncBatchNorm(TorchSyncBatchNorm):
    """Lightning's ``TorchSyncBatchNorm`` plugin made to work on CPU/gloo too, and to revert exactly.

    ``apply`` is :func:`convert_sync_batchnorm` (CPU layers become :class:`CPUSyncBatchNorm`);
    ``revert`` is :func:`revert_sync_batchnorm` (each layer gets its original class back, with the same
    parameters and buffers), so checkpoints and single-device inference see ordinary BatchNorm.
    """

    @override
    def apply(self, model: nn.Module) -> nn.Module:
        return convert_sync_batchnorm(model)

    @override
    def revert(self, model: nn.Module) -> nn.Module:
        return revert_sync_batchnorm(model)


def cpu_capable(layer_sync: LayerSync | None) -> LayerSync | None:
    """Swap Lightning's default ``TorchSyncBatchNorm`` for :class:`DDPSyncBatchNorm`; keep any other plugin."""
    namespace = _namespace.namespace_of(layer_sync)  # the Trainer's: it made the plugin
    if namespace is not None and type(layer_sync) is _namespace.load(namespace).get(_TORCH_SYNC_BATCHNORM):
        return DDPSyncBatchNorm.for_namespace(namespace)()
    return layer_sync
