"""Synchronised batch normalisation on every device, CPU/gloo included.

``Trainer(sync_batchnorm=True)`` gives the strategy Lightning's ``TorchSyncBatchNorm`` plugin, which converts each
BatchNorm layer to :class:`torch.nn.SyncBatchNorm` while fitting and back at teardown. PyTorch's ``SyncBatchNorm``
refuses CPU tensors in training, and DDP refuses it in CPU modules, so the strategy uses :class:`DDPSyncBatchNorm`
instead: CUDA layers become PyTorch's ``SyncBatchNorm``, CPU layers :class:`CPUSyncBatchNorm`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm
from typing_extensions import override

from ddp_strategy._compat import lightning_private as _pl
from ddp_strategy._compat import namespace as _namespace

if TYPE_CHECKING:
    from lightning.pytorch.plugins import LayerSync, TorchSyncBatchNorm
else:  # this process's Lightning namespace (see ddp_strategy._compat.namespace)
    TorchSyncBatchNorm = _namespace.get("pytorch.plugins:TorchSyncBatchNorm")


class CPUSyncBatchNorm(_BatchNorm):
    """Batch normalisation whose training statistics are computed over all ranks, for CPU tensors (gloo).

    Not a subclass of ``torch.nn.SyncBatchNorm``: DDP refuses those on CPU modules. Training forward, with
    input (N, C, *) on each rank: all-reduce ``[sum of x over (N, *) (C,), element count per channel (1,)]``
    for the global ``mean``; all-reduce ``sum of (x - mean)^2`` (C,) for the biased ``var`` (two passes avoid
    the cancellation of ``E[x^2] - E[x]^2``); ``y = (x - mean) / sqrt(var + eps) * weight + bias``. Running
    statistics get ``mean`` and the unbiased variance, with ``momentum`` as ``BatchNorm``. The backward of
    :func:`torch.distributed.nn.functional.all_reduce` all-reduces the incoming gradient, so gradients equal
    one BatchNorm's over the global batch. A collective in training mode: all ranks run the same number of
    training forwards (the padded training sampler guarantees it). In eval mode, or without a process group,
    it is plain ``BatchNorm``.

    Args:
        num_features, eps, momentum, affine, track_running_stats: as for ``torch.nn.BatchNorm1d``.
        process_group: the group to synchronise over; ``None`` = the world.
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        self.process_group = process_group

    @override
    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (N, C, *), got {input.dim()}D input")

    @override
    def forward(self, x: Tensor) -> Tensor:
        group = self.process_group or dist.group.WORLD
        if not (self.training and dist.is_initialized() and dist.get_world_size(group) > 1):
            return super().forward(x)
        self._check_input_dim(x)
        dims = [0, *range(2, x.dim())]
        shape = [1, -1] + [1] * (x.dim() - 2)
        # [per-channel sums, this rank's element count per channel]
        totals = dist_fn.all_reduce(torch.cat([x.sum(dims), x.new_full((1,), x.numel() // x.size(1))]), group=group)
        count = totals[-1]
        mean = totals[:-1] / count
        centred = x - mean.view(shape)
        var = dist_fn.all_reduce((centred * centred).sum(dims), group=group) / count
        y = centred * torch.rsqrt(var + self.eps).view(shape)
        if self.affine:
            y = y * self.weight.view(shape) + self.bias.view(shape)
        if self.track_running_stats:
            assert (
                self.num_batches_tracked is not None and self.running_mean is not None and self.running_var is not None
            )
            with torch.no_grad():
                self.num_batches_tracked.add_(1)
                momentum = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
                self.running_mean.lerp_(mean.detach(), momentum)
                self.running_var.lerp_(var.detach() * count / (count - 1).clamp(min=1), momentum)
        return y


_SYNCED = (nn.SyncBatchNorm, CPUSyncBatchNorm)
_ORIGINAL_CLASS = "_ddp_strategy_original_class"


def _rebuilt(source: _BatchNorm, cls: type[_BatchNorm]) -> _BatchNorm:
    """A ``cls`` layer with the settings, parameters and buffers (same tensors) and train/eval mode of ``source``."""
    target = cls(source.num_features, source.eps, source.momentum, source.affine, source.track_running_stats)
    for name in [*(("weight", "bias") if source.affine else ()), "running_mean", "running_var", "num_batches_tracked"]:
        setattr(target, name, getattr(source, name))
    target.train(source.training)
    if hasattr(source, "qconfig"):
        target.qconfig = source.qconfig
    return target


class DDPSyncBatchNorm(TorchSyncBatchNorm):
    """Lightning's ``TorchSyncBatchNorm`` plugin made to work on CPU/gloo too, and to revert exactly."""

    @override
    def apply(self, model: nn.Module) -> nn.Module:
        """Replace every BatchNorm layer by a synchronised one sharing its tensors (call once on the device): on CPU
        :class:`CPUSyncBatchNorm`, else ``torch.nn.SyncBatchNorm`` (as ``SyncBatchNorm.convert_sync_batchnorm``),
        remembering the original class for :meth:`revert`. Returns ``model`` (the new layer if it is a BatchNorm)."""
        converted = model
        if isinstance(model, _BatchNorm) and not isinstance(model, _SYNCED):
            on_cpu = all(t.device.type == "cpu" for t in [*model.parameters(), *model.buffers()])
            converted = _rebuilt(model, CPUSyncBatchNorm if on_cpu else nn.SyncBatchNorm)
            setattr(converted, _ORIGINAL_CLASS, type(model))
        for name, child in model.named_children():
            converted.add_module(name, self.apply(child))
        return converted

    @override
    def revert(self, model: nn.Module) -> nn.Module:
        """Undo :meth:`apply`: each layer gets its original class back, with the same parameters and buffers, so
        checkpoints and single-device inference see ordinary BatchNorm (layers converted elsewhere become the
        BatchNorm of any input rank Lightning's revert gives, its ``_BatchNormXd``; the state_dict keys are the
        same)."""
        reverted = model
        if isinstance(model, _SYNCED):
            reverted = _rebuilt(model, getattr(model, _ORIGINAL_CLASS, _pl.BatchNormXd))
        for name, child in model.named_children():
            reverted.add_module(name, self.revert(child))
        return reverted


def cpu_capable(layer_sync: LayerSync | None) -> LayerSync | None:
    """Swap Lightning's default ``TorchSyncBatchNorm`` for :class:`DDPSyncBatchNorm`; keep any other plugin."""
    return DDPSyncBatchNorm() if type(layer_sync) is TorchSyncBatchNorm else layer_sync
