"""What global rank 0 tells the user about a fit, once, through Lightning's ``rank_zero_info``/``rank_zero_warn``.

At fit start the :class:`FitSummary` and the :func:`batch_size_warnings`; at fit end the
:func:`communication_messages` from DDP's own timers (:class:`CommStats`) and the parameters no rank gave a
gradient (docs/diagnostics.md shows each). The message functions take plain numbers (the notebook calls them);
:class:`FitDiagnostics`, a callback the strategy adds while fitting, reads them off the running fit. Only reads.
"""

from __future__ import annotations

import math
from dataclasses import astuple, dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

from ddp_strategy._compat import namespace as _namespace
from ddp_strategy._compat import torch_private as _torch_private
from ddp_strategy.sampling import flat_loaders

if TYPE_CHECKING:
    from lightning.pytorch import LightningModule, Trainer

#: The hint is given when un-overlapped all-reduce time exceeds this share of a step (0.5: communication
#: takes longer than forward and backward compute together).
COMM_DOMINATES_FRACTION = 0.5


@dataclass(frozen=True)
class FitSummary:
    """The numbers of one distributed fit, as rank 0 sees them.

    W = ``world_size`` processes on ``num_nodes`` machines; B = ``per_device_batch_size`` (None: unknown);
    N = ``dataset_size`` (None: iterable data); ``samples_per_rank`` is the sampler's ``num_samples``;
    ``padding`` the samples repeated so all ranks get as many (negative: dropped by ``drop_last``);
    ``batches_per_epoch`` per rank after ``limit_train_batches`` (may be inf); ``comm_hook`` its name or "none".
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
        b = self.per_device_batch_size
        return None if b is None else b * self.world_size * self.accumulate_grad_batches

    @property
    def optimizer_steps_per_epoch(self) -> float:
        """``ceil(batches_per_epoch / accumulate_grad_batches)`` (inf if the batch count is)."""
        batches = self.batches_per_epoch
        return batches if math.isinf(batches) else math.ceil(batches / self.accumulate_grad_batches)

    def format(self) -> str:
        """The summary as 4 lines of text (example in docs/diagnostics.md)."""
        nodes = f"{_plural(self.num_nodes, 'node')} x {_plural(self.world_size // max(self.num_nodes, 1), 'process')}"
        batch = (
            "per-device batch size unknown (the loader has no batch_size)"
            if self.per_device_batch_size is None
            else f"{self.per_device_batch_size} per device x {_plural(self.world_size, 'process')}"
            f" x {self.accumulate_grad_batches} accumulation = global batch size"
            f" {self.global_batch_size} samples per step"
        )
        data = f"{self.dataset_size} training samples" if self.dataset_size is not None else "training samples: ?"
        if self.samples_per_rank is not None:
            data += f", {self.samples_per_rank} per rank per epoch" + (
                f" ({self.padding} repeated as padding)"
                if self.padding >= 0
                else f" ({-self.padding} dropped by drop_last)"
            )
        options = ", ".join(f"{k}={v!r}" for k, v in sorted(self.ddp_options.items())) or "defaults"
        return (
            f"DDP fit summary: world size {self.world_size} ({nodes}), backend {self.backend},"
            f" start method {self.start_method}\n  batch: {batch}\n  data: {data},"
            + (  # a loader without a length (a stream): Lightning's progress bar shows no total either
                " batches and optimizer steps per epoch unknown (streaming loader)\n"
                if math.isinf(self.batches_per_epoch)
                else f" {_plural(int(self.batches_per_epoch), 'batch')} per epoch per rank ="
                f" {_plural(int(self.optimizer_steps_per_epoch), 'optimizer step')}\n"
            )
            + f"  DDP options: {options}; comm hook: {self.comm_hook}"
        )


def _plural(count: int, word: str) -> str:
    return f"{count} {word}" + ("" if count == 1 else "es" if word.endswith(("s", "ch")) else "s")


def batch_size_warnings(
    per_device_batch_size: int | None,
    world_size: int,
    dataset_size: int | None,
    configured_batch_size: int | None = None,
) -> list[str]:
    """Warnings for a global batch size that looks like a mistake (the rules: docs/diagnostics.md); ``[]`` if none.

    The loader's ``batch_size`` B is per device, so a step sees ``B * W`` samples. Rule 1: ``B * W > N``, so each
    epoch is one partial step; the batch size it suggests, ``min(B, N) // W`` (at least 1), gives no warning when
    ``N >= W``. Rule 2 (a heuristic): W > 1 and ``B == configured * W``, as
    ``DataLoader(batch_size=self.batch_size * self.trainer.world_size)`` gives, written expecting DDP to split the
    batch (as ``DataParallel`` does).

    Args:
        per_device_batch_size: B, the training loader's ``batch_size``; None skips both rules.
        world_size: W. dataset_size: N, training samples; None skips rule 1.
        configured_batch_size: the ``batch_size`` on the DataModule or LightningModule (attribute or
            hyperparameter, as Lightning's batch-size finder finds it); None skips rule 2.

    Returns one message per rule that fires, saying what was found and what to do. Example:
        >>> batch_size_warnings(1024, 2, 1438)[0][:60]
        'Global batch size 2048 (batch_size=1024 per device x 2 proce'
    """
    b, w, configured, messages = per_device_batch_size, world_size, configured_batch_size, []
    if b is not None and dataset_size is not None and b * w > dataset_size:
        fits = max(min(b, dataset_size) // w, 1)  # the global batch b meant, split over W, or if larger all N
        messages.append(
            f"Global batch size {b * w} (batch_size={b} per device x {_plural(w, 'process')}) exceeds the"
            f" {dataset_size} training samples: each rank holds only {math.ceil(dataset_size / w)} samples, so every"
            f" epoch is one partial step. batch_size is the per-device batch size: for a global batch of {fits * w}"
            f" pass batch_size={fits}, and keep batch_size x {w} <= {dataset_size}."
        )
    if b is not None and configured is not None and w > 1 and configured > 0 and b == configured * w:
        messages.append(
            f"The training loader's batch_size={b} is the configured batch_size={configured} x {w} processes."
            f" DDP does not split a batch across devices: batch_size is already per device, so each step sees"
            f" {b * w} samples, not {b}. Build the loader with batch_size={configured} (global batch"
            f" {configured * w}) unless a global batch of {b * w} is what you want."
        )
    return messages


@dataclass(frozen=True)
class CommStats:
    """DDP's per-step timings, in milliseconds, averaged over the steps DDP sampled (and over ranks).

    DDP's reducer times forward, backward compute (backward start until the last gradient is ready), gradient
    communication (first bucket's all-reduce launched until the last one finished) and their overlap
    (communication while backward was still computing), on iterations 1-10 and every 100th after.
    """

    forward_ms: float
    backward_compute_ms: float
    allreduce_ms: float
    overlap_ms: float

    @classmethod
    def from_ddp_logging_data(cls, data: dict[str, Any]) -> CommStats | None:
        """Build from ``DistributedDataParallel._get_ddp_logging_data()`` (ns); None before DDP timed a step."""
        keys = _torch_private.DDP_TIMING_KEYS
        return cls(*(float(data[key]) / 1e6 for key in keys)) if all(key in data for key in keys) else None

    def as_tensor(self) -> torch.Tensor:
        """``[forward, backward compute, all-reduce, overlap]`` in ms, float64, shape (4,)."""
        return torch.tensor(astuple(self), dtype=torch.float64)

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
    static_graph: bool = False,
) -> tuple[list[str], list[str]]:
    """The fit-end messages: ``(infos, warnings)``.

    Args:
        stats: rank-averaged timings, or None when DDP timed no step (then the info says so).
        unused: names of parameters that never received a gradient on any rank; world_size: W.
        per_device_batch_size, bucket_cap_mb: B and DDP's bucket size (MiB), quoted in the hint if given.
        static_graph: DDP's option; under it every micro-batch all-reduces, so the hint leaves accumulation out.

    Returns:
        ``infos``: the communication summary, plus a hint when the un-overlapped all-reduce exceeds
        :data:`COMM_DOMINATES_FRACTION` of the step on W > 1 ranks.
        ``warnings``: one naming the unused parameters, if any.
    """
    warnings = (
        [
            f"{len(unused)} parameter(s) never received a gradient on any rank during fit: {', '.join(unused)}."
            " They are not trained. Use them in the forward pass, freeze them (requires_grad=False) or remove"
            " them; with find_unused_parameters=True DDP also pays an extra graph traversal every step."
        ]
        if unused
        else []
    )
    if stats is None:
        return ["DDP communication: no step was timed (DDP times iterations 1-10 and every 100th after)."], warnings
    infos = [
        f"DDP communication per step (ms, averaged over DDP's sampled steps and {_plural(world_size, 'rank')}):"
        f" compute {stats.compute_ms:.2f} (forward {stats.forward_ms:.2f} + backward"
        f" {stats.backward_compute_ms:.2f}), gradient all-reduce {stats.allreduce_ms:.2f}, of which"
        f" {stats.overlap_ms:.2f} ({stats.overlap_fraction:.0%}) overlapped with backward; waiting for"
        f" communication {stats.exposed_comm_ms:.2f} = {stats.comm_fraction:.0%} of the step."
    ]
    if world_size > 1 and stats.comm_fraction > COMM_DOMINATES_FRACTION:  # one process: nothing to compare with
        batch = f" than {per_device_batch_size}" if per_device_batch_size is not None else ""
        bucket = f" (now {bucket_cap_mb:g} MiB)" if bucket_cap_mb is not None else ""
        # without static_graph, accumulation's micro-batches skip the all-reduce (no_sync); under it each makes one
        accumulate = "" if static_graph else " or accumulate_grad_batches"
        infos.append(
            f"Hint: communication dominates ({stats.comm_fraction:.0%} of each step waits for the gradient"
            f" all-reduce), so {world_size} processes may be slower than one. Give each all-reduce more work:"
            f" a larger per-device batch_size{batch}{accumulate}; a larger"
            f" MyDDPStrategy(bucket_cap_mb=...){bucket}; a compression comm hook such as"
            " torch.distributed.algorithms.ddp_comm_hooks.default_hooks.fp16_compress_hook; or fewer devices."
        )
    return infos, warnings


class GradientTracker:
    """Records which parameters with ``requires_grad=True`` receive a gradient, through one autograd hook each.

    The hooks only set a flag. :meth:`prune` (after each optimizer step) removes the hooks of parameters
    already seen, so after the first step only never-updated parameters still pay for one; :meth:`close`
    removes the rest. ``names`` are relative to ``module`` (no DDP ``module.`` prefix); ``seen[i]``: whether
    ``names[i]`` received a gradient.
    """

    def __init__(self, module: torch.nn.Module) -> None:
        params = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        self.names: list[str] = [name for name, _ in params]
        self.seen: list[bool] = [False] * len(params)
        self._handles: dict[int, Any] = {
            i: p.register_hook(lambda grad, i=i: self.seen.__setitem__(i, True)) for i, (_, p) in enumerate(params)
        }

    def prune(self) -> None:
        """Remove the hooks of parameters that have already received a gradient (not from inside a hook)."""
        for index in [i for i in self._handles if self.seen[i]]:
            self._handles.pop(index).remove()

    def close(self) -> None:
        """Remove the hooks (idempotent)."""
        while self._handles:
            self._handles.popitem()[1].remove()


class FitDiagnostics(_namespace.Callback):
    """What rank 0 tells the user about a fit, as a callback the strategy adds while fitting: at the training start
    the fit summary and the batch-size warnings (no collective), gradients tracked on every rank; at its end the
    communication summary and the parameters no rank updated (:meth:`on_train_end`, a collective).

    Args:
        ddp_options: the DDP options the strategy passes (shown in the summary); start_method: how ranks started.
    """

    def __init__(self, ddp_options: dict[str, Any], start_method: str) -> None:
        self.ddp_options, self.start_method = ddp_options, start_method
        self.tracker: GradientTracker | None = None

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Log the fit summary and batch-size warnings on rank 0; start tracking gradients on every rank.

        After the DDP wrapper (and its comm hook) and the training loaders exist; no collective. Reads the first
        training loader if it is a DataLoader (every rank computes the same numbers).
        """
        ddp = trainer.strategy.model
        if not isinstance(ddp, DistributedDataParallel):
            return
        loader = next(iter(flat_loaders(trainer.train_dataloader)), None)
        batch_size, n, per_rank, padding = None, None, None, 0
        if isinstance(loader, DataLoader):
            # DataLoader(batch_size=B) batches with a BatchSampler of B; a custom batch sampler may have one too
            size = getattr(loader.batch_sampler, "batch_size", None)
            batch_size = int(size) if isinstance(size, int) else None
            n = _namespace.sized_len(loader.dataset)  # None for an iterable data set
            for sampler in (loader.sampler, getattr(loader.batch_sampler, "sampler", None)):  # one is distributed
                if isinstance(sampler, DistributedSampler):
                    per_rank, padding = (  # ignore below: torch hints a plain Dataset, yet the sampler len()s it
                        int(sampler.num_samples),
                        int(sampler.total_size) - len(sampler.dataset),  # type: ignore[arg-type]
                    )
        self.summary = FitSummary(
            world_size=trainer.world_size,
            num_nodes=trainer.num_nodes,
            backend=str(dist.get_backend()),
            start_method=self.start_method,
            per_device_batch_size=batch_size,
            accumulate_grad_batches=trainer.accumulate_grad_batches,
            dataset_size=n,
            samples_per_rank=per_rank,
            padding=padding,
            batches_per_epoch=float(trainer.num_training_batches),
            ddp_options=dict(self.ddp_options),
            comm_hook=str(_torch_private.ddp_logging_data(ddp).get("comm_hook") or "none"),
        )
        configured = (
            _namespace.lightning_getattr(pl_module, "batch_size")
            if _namespace.lightning_hasattr(pl_module, "batch_size")
            else None
        )
        configured = configured if isinstance(configured, int) and not isinstance(configured, bool) else None
        _namespace.rank_zero_info(self.summary.format())
        for message in batch_size_warnings(batch_size, self.summary.world_size, n, configured):
            _namespace.rank_zero_warn(message)
        self.tracker = GradientTracker(pl_module)

    def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
        """After each batch's step: stop tracking the parameters that got a gradient (no collective)."""
        if self.tracker is not None:
            self.tracker.prune()

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Average DDP's timings and the gradient flags over ranks, then log the fit-end messages on rank 0.

        A collective (one all-reduce of ``4 + 1 + P`` float64 values, P = tracked parameters) in the group the DDP
        wrapper was built in (world size 1 too), on every rank, before the wrapper is released; the gradient
        hooks are removed."""
        tracker, self.tracker = self.tracker, None
        if tracker is None:  # (on_train_start sets self.summary before the tracker)
            return
        tracker.close()
        data = _torch_private.ddp_logging_data(trainer.strategy.model)
        local = CommStats.from_ddp_logging_data(data)
        total = torch.cat(
            [
                local.as_tensor() if local is not None else torch.zeros(4, dtype=torch.float64),
                torch.tensor([local is not None, *tracker.seen], dtype=torch.float64),  # timed?, gradients seen
            ]
        ).to(trainer.strategy.root_device)
        dist.all_reduce(total)
        ranks_timed = int(total[4].item())
        stats = CommStats(*(total[:4] / ranks_timed).tolist()) if ranks_timed else None
        unused = [name for name, count in zip(tracker.names, total[5:].tolist(), strict=True) if count == 0]
        bucket_bytes = data.get("bucket_cap_bytes")
        bucket_mb = bucket_bytes / 2**20 if isinstance(bucket_bytes, (int, float)) and bucket_bytes > 0 else None
        world_size, batch_size = dist.get_world_size(), self.summary.per_device_batch_size
        infos, warnings = communication_messages(
            stats, unused, world_size, batch_size, bucket_mb, static_graph=bool(data.get("static_graph"))
        )
        for message in infos:
            _namespace.rank_zero_info(message)
        for message in warnings:
            _namespace.rank_zero_warn(message)

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        """Remove the gradient hooks; no collective (other ranks may be gone)."""
        if self.tracker is not None:
            self.tracker.close()
