"""One fit's diagnostics: what is recorded at fit start and reported at fit end (the strategy's entry point).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ddp_strategy import process
from ddp_strategy._compat import torch_private as _torch_private
from ddp_strategy._compat.namespace import rank_zero_info, rank_zero_warn
from ddp_strategy.diagnostics.communication import CommStats, communication_messages
from ddp_strategy.diagnostics.summary import FitSummary, batch_size_warnings, collect_fit_summary

if TYPE_CHECKING:
    import lightning.pytorch as pl

log = logging.getLogger(__name__)


class GradientTracker:
    """Records which parameters receive a gradient, through one autograd hook per parameter.

    Only parameters with ``requires_grad=True`` are tracked (frozen ones are not expected to get gradients).
    The hooks only set a flag. :meth:`prune` (called after each optimizer step) removes the hooks of
    parameters already seen, so after the first step only never-updated parameters still pay for a hook;
    :meth:`close` removes the rest.

    Args:
        module: the LightningModule (names are relative to it, without DDP's ``module.`` prefix).
    """

    def __init__(self, module: nn.Module) -> None:
        params = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        self.names: list[str] = [name for name, _ in params]
        self._seen: list[bool] = [False] * len(params)
        self._handles: dict[int, Any] = {i: p.register_hook(self._hook_for(i)) for i, (_, p) in enumerate(params)}

    @property
    def received(self) -> torch.Tensor:
        """Bool tensor of shape (number of tracked parameters,): True where a gradient arrived."""
        return torch.tensor(self._seen, dtype=torch.bool)

    def _hook_for(self, index: int) -> Any:
        def hook(grad: torch.Tensor) -> None:
            self._seen[index] = True

        return hook

    def prune(self) -> None:
        """Remove the hooks of parameters that have already received a gradient (not from inside a hook)."""
        for index in [i for i in self._handles if self._seen[i]]:
            self._handles.pop(index).remove()

    def close(self) -> None:
        """Remove the hooks (idempotent)."""
        for handle in self._handles.values():
            handle.remove()
        self._handles = {}


@dataclass
class FitRecord:
    """What :func:`on_fit_start` hands to :func:`on_fit_end`: the summary and the running gradient tracker."""

    summary: FitSummary
    tracker: GradientTracker


def on_fit_start(
    trainer: pl.Trainer, backend: str, start_method: str, ddp_options: dict[str, Any], ddp_model: nn.Module
) -> FitRecord:
    """Log the fit summary and batch-size warnings on rank 0; start tracking gradients on every rank.

    Called by the strategy's ``on_train_start`` on every rank, after the DDP wrapper (and any comm hook)
    exists and the training loader is built; no collective.

    Returns:
        The record to pass to :func:`on_fit_end`.
    """
    summary, configured = collect_fit_summary(trainer, backend, start_method, ddp_options, ddp_model)
    rank_zero_info(summary.format())
    for message in batch_size_warnings(summary.per_device_batch_size, summary.world_size, summary.dataset_size,
                                       configured):
        rank_zero_warn(message)
    assert trainer.lightning_module is not None
    return FitRecord(summary, GradientTracker(trainer.lightning_module))


def on_fit_end(record: FitRecord, ddp_model: nn.Module, device: torch.device) -> tuple[CommStats | None, list[str]]:
    """Average DDP's timings and the gradient flags over ranks, then log the fit-end messages on rank 0.

    A collective (one all-reduce of ``4 + 1 + P`` float64 values, P = tracked parameters): every rank must
    call it, after the last training step and before the DDP wrapper is released.

    Args:
        record: from :func:`on_fit_start`; its gradient hooks are removed here.
        ddp_model: the ``DistributedDataParallel`` wrapper (its logging data holds DDP's timings).
        device: this rank's device (CUDA for NCCL).

    Returns:
        ``(stats, unused)``: the rank-averaged timings (None if no rank has any) and the unused parameter names.
    """
    tracker = record.tracker
    tracker.close()
    data = _torch_private.ddp_logging_data(ddp_model)
    local = CommStats.from_ddp_logging_data(data)
    timed = local.as_tensor() if local is not None else torch.zeros(4, dtype=torch.float64)
    packed = torch.cat([timed, torch.tensor([float(local is not None)], dtype=torch.float64),
                        tracker.received.to(torch.float64)])
    total = process.all_reduce(packed.to(device), op="sum").cpu()
    ranks_timed = int(total[4].item())
    stats = CommStats(*(total[:4] / ranks_timed).tolist()) if ranks_timed else None
    unused = [name for name, count in zip(tracker.names, total[5:].tolist(), strict=True) if count == 0]
    world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    bucket_bytes = data.get("bucket_cap_bytes")
    bucket_mb = bucket_bytes / 2**20 if isinstance(bucket_bytes, (int, float)) and bucket_bytes > 0 else None
    infos, warnings = communication_messages(stats, unused, world_size, record.summary.per_device_batch_size,
                                             bucket_mb)
    for message in infos:
        rank_zero_info(message)
    for message in warnings:
        rank_zero_warn(message)
    return stats, unused


class FitDiagnostics:
    """The strategy's entry point: one fit's record from ``on_train_start`` to ``on_train_end`` (or a failure)."""

    def __init__(self) -> None:
        self._record: FitRecord | None = None

    def start(self, trainer: pl.Trainer, backend: str, start_method: str, ddp_options: dict[str, Any],
              model: nn.Module | None) -> None:
        """Log the fit summary (rank 0) and start tracking gradients, when ``model`` is DDP-wrapped. No collective."""
        if isinstance(model, DistributedDataParallel):
            self._record = on_fit_start(trainer, backend, start_method, ddp_options, model)

    def after_optimizer_step(self) -> None:
        """Stop watching parameters that have received a gradient."""
        if self._record is not None:
            self._record.tracker.prune()

    def end(self, model: nn.Module | None, device: torch.device) -> None:
        """Log the communication report (rank 0). A collective, on every rank, when a fit was started."""
        record, self._record = self._record, None
        if record is not None and isinstance(model, DistributedDataParallel):
            on_fit_end(record, model, device)

    def abort(self) -> None:
        """After an exception: remove the gradient hooks, no collective (other ranks may be gone)."""
        record, self._record = self._record, None
        if record is not None:
            record.tracker.close()
