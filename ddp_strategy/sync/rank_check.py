"""Checking that every rank holds the same parameters: a silent desync becomes a loud error.

DDP keeps replicas identical only if every rank applies the same update to the same weights. Code that
edits weights on one rank (a callback guarded by ``if trainer.is_global_zero``, a non-deterministic
custom op, a missed broadcast after loading) breaks that silently. ``MyDDPStrategy(verify_sync_every_n_steps=N)``
calls :func:`verify_parameters_in_sync` after every N-th optimizer step.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch import nn

log = logging.getLogger(__name__)


def parameter_checksums(module: nn.Module) -> tuple[list[str], torch.Tensor]:
    """Per-parameter checksums of ``module``.

    Returns:
        ``(names, sums)``: parameter names, and a float64 tensor of shape (P, 2) on CPU holding each
        parameter's sum and sum of |x| (so sign flips and permutation-free changes are both seen).
    """
    names, rows = [], []
    with torch.no_grad():
        for name, param in module.named_parameters():
            p = param.detach().double()
            names.append(name)
            rows.append(torch.stack([p.sum(), p.abs().sum()]).cpu())
    return names, torch.stack(rows) if rows else torch.zeros(0, 2, dtype=torch.float64)


def verify_parameters_in_sync(module: nn.Module, step: int, device: torch.device) -> None:
    """Raise on every rank if any parameter of ``module`` differs between ranks.

    A collective: every rank must call it, with the same module structure. Gathers each rank's
    :func:`parameter_checksums` (16 bytes per parameter tensor) and compares them exactly; every rank
    gets all checksums, so every rank reaches the same verdict and raises the same error. A no-op
    without a process group or with one rank.

    Args:
        module: the model (wrapped or not; names are those of ``module.named_parameters()``).
        step: the optimizer step just taken, for the error message.
        device: where to place the gathered tensor (the rank's device; NCCL needs CUDA tensors).

    Raises:
        RuntimeError: naming the differing parameters, the ranks holding other values than rank 0, and
            ``step``.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    names, sums = parameter_checksums(module)
    gathered = [torch.empty_like(sums, device=device) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, sums.to(device))
    reference = gathered[0].cpu()
    differing: dict[str, list[int]] = {}
    for rank, other in enumerate(gathered[1:], start=1):
        rows = (other.cpu() != reference).any(dim=1)
        for i in rows.nonzero().flatten().tolist():
            differing.setdefault(names[i], []).append(rank)
    if differing:
        detail = ", ".join(f"{name} (ranks {ranks} differ from rank 0)" for name, ranks in differing.items())
        raise RuntimeError(
            f"[rank {dist.get_rank()}] parameters differ between ranks after optimizer step {step}: {detail}."
            " DDP replicas have diverged: something changed weights on some ranks only (a callback or"
            " hook under `if trainer.is_global_zero`, a weight load on one rank, non-deterministic"
            " in-place edits). Make the change on every rank, or broadcast from rank 0 afterwards."
        )
    log.debug("step %d: %d parameters identical on all ranks", step, len(names))
