"""The fit-end communication report: DDP's own per-step timings turned into what to change.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ddp_strategy._compat import torch_private as _torch_private
from ddp_strategy.diagnostics.summary import plural

if TYPE_CHECKING:
    pass

log = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------------------- fit end
#: The hint is given when un-overlapped all-reduce time exceeds this share of a step (0.5: communication
#: takes longer than forward and backward compute together).
COMM_DOMINATES_FRACTION = 0.5
NS_PER_MS = 1e6


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
        return cls(*(float(data[key]) / NS_PER_MS for key in _torch_private.DDP_TIMING_KEYS))

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
            f"DDP communication per step (ms, averaged over DDP's sampled steps and {plural(world_size, 'rank')}):"
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
