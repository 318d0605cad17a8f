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
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from ddp_strategy._compat import torch_private as _torch_private
from ddp_strategy._compat.namespace import lightning_getattr, lightning_hasattr, rank_zero_info, rank_zero_warn
from ddp_strategy.process import group as process_group

if TYPE_CHECKING:
    import lightning.pytorch as pl

log = logging.getLogger(__name__)

__all__ = [
    "COMM_DOMINATES_FRACTION",
    "CommStats",
    "FitRecord",
    "FitSummary",
    "GradientTracker",
    "batch_size_warnings",
    "communication_messages",
    "on_fit_end",
    "on_fit_start",
]

#: The hint is given when un-overlapped all-reduce time exceeds this share of a step (0.5: communication
#: takes longer than forward and backward compute together).
COMM_DOMINATES_FRACTION = 0.5
_NS_PER_MS = 1e6


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
        nodes = f"{_plural(self.num_nodes, 'node')} x {_plural(per_node, 'process')}"
        lines = [f"DDP fit summary: world size {self.world_size} ({nodes}), backend {self.backend},"
                 f" start method {self.start_method}"]
        if self.per_device_batch_size is None:
            lines.append("  batch: per-device batch size unknown (the loader has no batch_size)")
        else:
            lines.append(f"  batch: {self.per_device_batch_size} per device x {_plural(self.world_size, 'process')}"
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


def _plural(count: int, word: str) -> str:
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


# ------------------------------------------------------------------------------------------------- fit end
@dataclass(frozen=True)
class CommStats:
    """DDP's per-step timings, in milliseconds, averaged over the steps DDP sampled (and over ranks).

    DDP's reducer times forward, backward compute (backward start until the last gradient is ready),
    gradient communication (first bucket's all-reduce launched until the last one finished) and their overlap
    (communication that ran while backward was still computing), on iterations 1-10 and every 100th after.

    Attributes:
        forward_ms, backward_compute_ms, allreduce_ms, overlap_ms: per-step averages in ms.
    """

    forward_ms: float
    backward_compute_ms: float
    allreduce_ms: float
    overlap_ms: float

    @classmethod
    def from_ddp_logging_data(cls, data: dict[str, Any]) -> CommStats | None:
        """Build from ``DistributedDataParallel._get_ddp_logging_data()`` (ns); None before DDP timed a step."""
        if not all(key in data for key in _torch_private.DDP_TIMING_KEYS):
            return None
        return cls(*(float(data[key]) / _NS_PER_MS for key in _torch_private.DDP_TIMING_KEYS))

    def as_tensor(self) -> torch.Tensor:
        """``[forward, backward compute, all-reduce, overlap]`` in ms, float64."""
        return torch.tensor([self.forward_ms, self.backward_compute_ms, self.allreduce_ms, self.overlap_ms],
                            dtype=torch.float64)

    @property
    def compute_ms(self) -> float:
        """Forward plus backward compute, in ms per step."""
        return self.forward_ms + self.backward_compute_ms

    @property
    def exposed_comm_ms(self) -> float:
        """All-reduce time not hidden behind backward, in ms per step (never negative)."""
        return max(self.allreduce_ms - self.overlap_ms, 0.0)

    @property
    def comm_fraction(self) -> float:
        """Share of a step spent waiting for communication: ``exposed / (compute + exposed)``, in [0, 1]."""
        total = self.compute_ms + self.exposed_comm_ms
        return self.exposed_comm_ms / total if total > 0 else 0.0

    @property
    def overlap_fraction(self) -> float:
        """Share of the all-reduce time that overlapped with backward, in [0, 1]."""
        return min(self.overlap_ms / self.allreduce_ms, 1.0) if self.allreduce_ms > 0 else 0.0


def communication_messages(
    stats: CommStats | None,
    unused: list[str],
    world_size: int,
    per_device_batch_size: int | None = None,
    bucket_cap_mb: float | None = None,
) -> tuple[list[str], list[str]]:
    """The fit-end messages: ``(infos, warnings)``.

    Args:
        stats: rank-averaged timings, or None when DDP timed no step (then the info says so).
        unused: names of parameters that never received a gradient on any rank.
        world_size: W.
        per_device_batch_size: B, quoted in the hint; None leaves it out.
        bucket_cap_mb: DDP's bucket size in MiB, quoted in the hint; None leaves it out.

    Returns:
        ``infos``: the communication summary, plus a hint when the un-overlapped all-reduce exceeds
        :data:`COMM_DOMINATES_FRACTION` of the step. ``warnings``: one naming the unused parameters, if any.
    """
    infos: list[str] = []
    warnings: list[str] = []
    if stats is None:
        infos.append("DDP communication: no step was timed (DDP times iterations 1-10 and every 100th after).")
    else:
        infos.append(
            f"DDP communication per step (ms, averaged over DDP's sampled steps and {_plural(world_size, 'rank')}):"
            f" compute {stats.compute_ms:.2f} (forward {stats.forward_ms:.2f} + backward"
            f" {stats.backward_compute_ms:.2f}), gradient all-reduce {stats.allreduce_ms:.2f}, of which"
            f" {stats.overlap_ms:.2f} ({stats.overlap_fraction:.0%}) overlapped with backward; waiting for"
            f" communication {stats.exposed_comm_ms:.2f} = {stats.comm_fraction:.0%} of the step."
        )
        if stats.comm_fraction > COMM_DOMINATES_FRACTION:
            batch = f" than {per_device_batch_size}" if per_device_batch_size is not None else ""
            bucket = f" (now {bucket_cap_mb:g} MiB)" if bucket_cap_mb is not None else ""
            infos.append(
                f"Hint: communication dominates ({stats.comm_fraction:.0%} of each step waits for the gradient"
                f" all-reduce), so {world_size} processes may be slower than one. Give each all-reduce more work:"
                f" a larger per-device batch_size{batch} or accumulate_grad_batches; a larger"
                f" MyDDPStrategy(bucket_cap_mb=...){bucket}; a compression comm hook such as"
                " torch.distributed.algorithms.ddp_comm_hooks.default_hooks.fp16_compress_hook; or fewer devices."
            )
    if unused:
        warnings.append(
            f"{len(unused)} parameter(s) never received a gradient on any rank during fit: {', '.join(unused)}."
            " They are not trained. Use them in the forward pass, freeze them (requires_grad=False) or remove"
            " them; with find_unused_parameters=True DDP also pays an extra graph traversal every step."
        )
    return infos, warnings


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
    total = process_group.all_reduce(packed.to(device), op="sum").cpu()
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

