"""What the strategy tells the user on global rank 0: a fit summary, batch-size warnings, a communication report.

Three messages turn the usual DDP pitfalls into text, all through Lightning's rank-zero utilities (so they are
logged once, by global rank 0, on the ``lightning.pytorch`` logger or as a ``UserWarning``):

1. at fit start, :class:`FitSummary`: world size, nodes, backend, start method, per-device batch size,
   gradient accumulation, global batch size, batches per epoch per rank, samples per rank and padding, DDP
   options and comm hook;
2. at fit start, :func:`batch_size_warnings` when the global batch looks like a mistake;
3. at fit end, :class:`CommStats` (time in the gradient all-reduce versus compute per step, and how much of it
   overlapped with backward, from DDP's own timers), the parameters that never received a gradient on any
   rank, and a hint when communication dominates the step (the "two devices are slower than one" pitfall).

The pure functions (:meth:`FitSummary.format`, :func:`batch_size_warnings`, :func:`communication_messages`)
take plain numbers and are tested with given values; :func:`on_fit_start` and :func:`on_fit_end` collect the
numbers from a running Trainer and are called by :class:`~ddp_strategy.strategy.MyDDPStrategy`.

This module holds the fit-start summary and the batch-size warnings; the communication report is in
:mod:`ddp_strategy.diagnostics.communication`, and the entry points the strategy calls in
:mod:`ddp_strategy.diagnostics.record`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from torch import nn
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from ddp_strategy._compat import torch_private as _torch_private
from ddp_strategy._compat.namespace import lightning_getattr, lightning_hasattr

if TYPE_CHECKING:
    import lightning.pytorch as pl

log = logging.getLogger(__name__)




# ----------------------------------------------------------------------------------------------- fit start
@dataclass(frozen=True)
class FitSummary:
    """The numbers of one distributed fit, as rank 0 sees them.

    Attributes:
        world_size: W, processes in total.
        num_nodes: machines.
        backend: process-group backend (``"gloo"``, ``"nccl"``).
        start_method: how the processes were started (``"popen"``, ``"spawn"``, ``"fork"``, ...).
        per_device_batch_size: B, samples per batch on each rank (the loader's ``batch_size``); None if unknown.
        accumulate_grad_batches: batches per optimizer step (Lightning's ``accumulate_grad_batches``).
        dataset_size: N, samples in the training set; None if unknown (iterable data sets).
        samples_per_rank: samples each rank draws per epoch (the sampler's ``num_samples``); None if unknown.
        padding: samples repeated in total so all ranks get ``samples_per_rank`` (negative: samples dropped by
            ``drop_last``).
        batches_per_epoch: training batches per epoch on each rank (after ``limit_train_batches``); may be inf.
        ddp_options: keyword options passed to ``DistributedDataParallel``.
        comm_hook: the registered DDP comm hook's name, or ``"none"`` (plain all-reduce, averaged).
    """

    world_size: int
    num_nodes: int
    backend: str
    start_method: str
    per_device_batch_size: int | None
    accumulate_grad_batches: int = 1
    dataset_size: int | None = None
    samples_per_rank: int | None = None
    padding: int = 0
    batches_per_epoch: float = math.inf
    ddp_options: dict[str, Any] = field(default_factory=dict)
    comm_hook: str = "none"

    @property
    def global_batch_size(self) -> int | None:
        """Samples per optimizer step over all ranks: ``B * W * accumulate_grad_batches``, or None."""
        if self.per_device_batch_size is None:
            return None
        return self.per_device_batch_size * self.world_size * self.accumulate_grad_batches

    @property
    def optimizer_steps_per_epoch(self) -> float:
        """``ceil(batches_per_epoch / accumulate_grad_batches)`` (inf if the batch count is)."""
        if math.isinf(self.batches_per_epoch):
            return math.inf
        return math.ceil(self.batches_per_epoch / self.accumulate_grad_batches)

    def format(self) -> str:
        """The summary as 4 lines of text.

        Example (2 processes, B = 32, 2 accumulation steps, 1,437 samples)::

            DDP fit summary: world size 2 (1 node x 2 processes), backend gloo, start method spawn
              batch: 32 per device x 2 processes x 2 accumulation = global batch size 128 samples per step
              data: 1437 training samples, 719 per rank per epoch (1 repeated as padding), 23 batches
                per epoch per rank = 12 optimizer steps
              DDP options: find_unused_parameters=True; comm hook: none
        """
        per_node = self.world_size // max(self.num_nodes, 1)
        nodes = f"{plural(self.num_nodes, 'node')} x {plural(per_node, 'process')}"
        lines = [f"DDP fit summary: world size {self.world_size} ({nodes}), backend {self.backend},"
                 f" start method {self.start_method}"]
        if self.per_device_batch_size is None:
            lines.append("  batch: per-device batch size unknown (the loader has no batch_size)")
        else:
            lines.append(f"  batch: {self.per_device_batch_size} per device x {plural(self.world_size, 'process')}"
                         f" x {self.accumulate_grad_batches} accumulation = global batch size"
                         f" {self.global_batch_size} samples per step")
        data = f"{self.dataset_size} training samples" if self.dataset_size is not None else "training samples: ?"
        if self.samples_per_rank is not None:
            data += f", {self.samples_per_rank} per rank per epoch"
            if self.padding >= 0:
                data += f" ({self.padding} repeated as padding)"
            else:
                data += f" ({-self.padding} dropped by drop_last)"
        steps = _fmt_count(self.batches_per_epoch)
        data += f", {steps} batches per epoch per rank = {_fmt_count(self.optimizer_steps_per_epoch)} optimizer steps"
        lines.append("  data: " + data)
        options = ", ".join(f"{k}={v!r}" for k, v in sorted(self.ddp_options.items())) or "defaults"
        lines.append(f"  DDP options: {options}; comm hook: {self.comm_hook}")
        return "\n".join(lines)


def plural(count: int, word: str) -> str:
    return f"{count} {word}" + ("" if count == 1 else "es" if word.endswith("s") else "s")


def _fmt_count(value: float) -> str:
    return "inf" if math.isinf(value) else str(int(value))


def batch_size_warnings(
    per_device_batch_size: int | None,
    world_size: int,
    dataset_size: int | None,
    configured_batch_size: int | None = None,
) -> list[str]:
    """Warnings for a global batch size that looks like a mistake; ``[]`` when none applies.

    The loader's ``batch_size`` B is per device, so one optimizer step sees ``B * W`` samples. Two rules:

    1. **Global batch larger than the data set**: ``B * W > N``. Each rank then holds only ``ceil(N / W)``
       samples, fewer than B, so every epoch is a single, partial step: almost always B was meant as the
       global batch size.
    2. **Batch size multiplied by the device count** (a heuristic): W > 1 and the loader's B equals
       ``configured * W``, where ``configured`` is the ``batch_size`` the user configured on the DataModule or
       LightningModule (attribute or hyperparameter, found as Lightning's batch-size finder finds it). This is
       the pattern ``DataLoader(batch_size=self.batch_size * self.trainer.world_size)``, written by someone
       who expects DDP to split the batch (as ``DataParallel`` does); DDP does not, so the global batch is
       W times larger than intended.

    Args:
        per_device_batch_size: B, the training loader's ``batch_size``; None skips both rules.
        world_size: W.
        dataset_size: N, training samples; None skips rule 1.
        configured_batch_size: the user's ``batch_size`` setting, if any; None skips rule 2.

    Returns:
        One message per rule that fires; each says what was found and what to do.

    Example:
        >>> batch_size_warnings(1024, 2, 1438)[0][:60]
        'Global batch size 2048 (batch_size=1024 per device x 2 proce'
    """
    if per_device_batch_size is None:
        return []
    b, w = per_device_batch_size, world_size
    messages = []
    if dataset_size is not None and b * w > dataset_size:
        per_rank = math.ceil(dataset_size / w)
        messages.append(
            f"Global batch size {b * w} (batch_size={b} per device x {w} processes) exceeds the {dataset_size}"
            f" training samples: each rank holds only {per_rank} samples, so every epoch is one partial step."
            f" batch_size is the per-device batch size: for a global batch of {b} pass batch_size={max(b // w, 1)}"
            f", and keep batch_size x {w} <= {dataset_size}."
        )
    if configured_batch_size is not None and w > 1 and configured_batch_size > 0 and b == configured_batch_size * w:
        messages.append(
            f"The training loader's batch_size={b} is the configured batch_size={configured_batch_size} x"
            f" {w} processes. DDP does not split a batch across devices: batch_size is already per device, so"
            f" each step sees {b * w} samples, not {b}. Build the loader with batch_size={configured_batch_size}"
            f" (global batch {configured_batch_size * w}) unless a global batch of {b * w} is what you want."
        )
    return messages


def _loaders(obj: Any) -> Iterator[DataLoader]:
    """The DataLoaders inside ``trainer.train_dataloader`` (a loader, or a list/tuple/dict of them)."""
    if isinstance(obj, DataLoader):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _loaders(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _loaders(item)


def _loader_batch_size(loader: DataLoader) -> int | None:
    if loader.batch_size is not None:
        return int(loader.batch_size)
    size = getattr(loader.batch_sampler, "batch_size", None)
    return int(size) if isinstance(size, int) else None


def _sampler_numbers(loader: DataLoader) -> tuple[int | None, int | None, int]:
    """``(N, samples per rank, padding)`` from the loader's ``DistributedSampler``, else from its data set."""
    sampler = loader.sampler
    if not isinstance(sampler, DistributedSampler):
        sampler = getattr(loader.batch_sampler, "sampler", None)
    if isinstance(sampler, DistributedSampler):
        n = len(sampler.dataset)  # type: ignore[arg-type]
        return n, int(sampler.num_samples), int(sampler.total_size) - n
    try:
        n = len(loader.dataset)  # type: ignore[arg-type]
    except TypeError:
        return None, None, 0
    return n, None, 0


def _configured_batch_size(trainer: pl.Trainer) -> int | None:
    module = trainer.lightning_module
    if module is None or not lightning_hasattr(module, "batch_size"):
        return None
    value = lightning_getattr(module, "batch_size")
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def collect_fit_summary(
    trainer: pl.Trainer, backend: str, start_method: str, ddp_options: dict[str, Any], ddp_model: nn.Module
) -> tuple[FitSummary, int | None]:
    """Read a :class:`FitSummary` (and the configured ``batch_size``) off a Trainer at ``on_train_start``.

    Uses the first training DataLoader; rank-agnostic (every rank computes the same numbers).

    Returns:
        ``(summary, configured_batch_size)``.
    """
    loader = next(_loaders(trainer.train_dataloader), None)
    batch_size, n, per_rank, padding = None, None, None, 0
    if loader is not None:
        batch_size = _loader_batch_size(loader)
        n, per_rank, padding = _sampler_numbers(loader)
    comm_hook = _torch_private.ddp_logging_data(ddp_model).get("comm_hook") or "none"
    summary = FitSummary(
        world_size=trainer.world_size,
        num_nodes=trainer.num_nodes,
        backend=backend,
        start_method=start_method,
        per_device_batch_size=batch_size,
        accumulate_grad_batches=trainer.accumulate_grad_batches,
        dataset_size=n,
        samples_per_rank=per_rank,
        padding=padding,
        batches_per_epoch=float(trainer.num_training_batches),
        ddp_options=dict(ddp_options),
        comm_hook=str(comm_hook),
    )
    return summary, _configured_batch_size(trainer)
