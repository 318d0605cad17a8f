"""Checking that every rank holds the same parameters: a silent desync becomes a loud error.

DDP keeps replicas identical only if every rank applies the same update to the same weights. Code that edits
weights on one rank (a callback under ``if trainer.is_global_zero``, a non-deterministic custom op, a missed
broadcast after loading) breaks that silently. ``MyDDPStrategy(verify_sync_every_n_steps=N)`` calls
:func:`verify_parameters_in_sync` after every N-th optimizer step.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ddp_strategy._compat import lightning_private as _pl


def parameter_checksums(module: torch.nn.Module) -> tuple[list[str], torch.Tensor]:
    """``(names, sums)``: parameter names and a float64 CPU tensor (P, 2) of each one's sum and sum of |x|."""
    rows = [
        (name, torch.stack([p.detach().double().sum(), p.detach().double().abs().sum()]).cpu())
        for name, p in module.named_parameters()
    ]
    return [name for name, _ in rows], torch.stack([r for _, r in rows]) if rows else torch.zeros(0, 2).double()


def verify_parameters_in_sync(module: torch.nn.Module, step: int, device: torch.device) -> None:
    """Raise on every rank if any parameter of ``module`` differs between ranks.

    A collective: every rank must call it, with the same module structure. All-gathers (Lightning's
    ``_all_gather_ddp_if_available``) each rank's :func:`parameter_checksums` (16 bytes per parameter tensor, placed
    on ``device``: NCCL needs CUDA) and compares them exactly, so every rank reaches the same verdict. A no-op
    without a group or with one rank.

    Raises:
        RuntimeError: naming the differing parameters, the ranks holding other values than rank 0, and ``step``
            (the optimizer step just taken).
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    names, sums = parameter_checksums(module)
    gathered = _pl.all_gather_ddp_if_available(sums.to(device)).cpu()  # (W, P, 2)
    differs = (gathered != gathered[0]).any(dim=2)  # (W, P): rank r's parameter p is not rank 0's
    differing = {
        name: differs[:, i].nonzero().flatten().tolist() for i, name in enumerate(names) if differs[:, i].any()
    }
    if differing:
        detail = ", ".join(f"{name} (ranks {ranks} differ from rank 0)" for name, ranks in differing.items())
        raise RuntimeError(
            f"[rank {dist.get_rank()}] parameters differ between ranks after optimizer step {step}: {detail}."
            " DDP replicas have diverged: something changed weights on some ranks only (a callback or"
            " hook under `if trainer.is_global_zero`, a weight load on one rank, non-deterministic"
            " in-place edits). Make the change on every rank, or broadcast from rank 0 afterwards."
        )
