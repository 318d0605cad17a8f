"""Scenarios for tests/sync/test_backward.py: the backward hooks under DDP options, side by side with ``"ddp"``.

Each scenario runs several fits in one launch of 2 ranks (``ddp_testing.launch``); each fit writes, per rank, the
batches it read, its gradients after every backward, its initial and final weights, or its error.
"""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from ddp_testing import quiet_trainer, save
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.utils.data import DataLoader, TensorDataset

from ddp_strategy import MyDDPStrategy

N, B, LR = 16, 2, 0.1  # samples, per-device batch size, SGD learning rate


def data() -> TensorDataset:
    """``N`` rows ``(x (4,), index)``, seeded."""
    return TensorDataset(torch.randn(N, 4, generator=torch.Generator().manual_seed(3)), torch.arange(N))


class AuxNet(pl.LightningModule):
    """``body -> head``; ``aux`` also takes part on the ranks in ``aux_ranks`` at the steps in ``aux_steps`` (all:
    None). Records batches, gradients after each backward (summed per parameter), initial and final weights."""

    def __init__(
        self, manual: bool = False, aux_ranks: tuple[int, ...] = (0, 1), aux_steps: tuple[int, ...] | None = None
    ) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body, self.head, self.aux = nn.Linear(4, 4), nn.Linear(4, 1), nn.Linear(4, 1)
        self.automatic_optimization = not manual
        self.aux_ranks, self.aux_steps = aux_ranks, aux_steps
        self.rec: dict[str, Any] = {"batches": [], "grads": []}

    def train_dataloader(self) -> DataLoader:
        return DataLoader(data(), batch_size=B, shuffle=True)

    def loss(self, x: torch.Tensor, step: int) -> torch.Tensor:
        """The loss of one batch; with ``aux`` if this rank and step use it."""
        h = self.body(x).tanh()
        loss = self.head(h).pow(2).mean()
        if self.global_rank in self.aux_ranks and (self.aux_steps is None or step in self.aux_steps):
            loss = loss + self.aux(h).pow(2).mean()
        return loss

    def on_train_start(self) -> None:
        self.rec["initial"] = {k: v.clone() for k, v in self.state_dict().items()}

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor | None:
        x, index = batch
        self.rec["batches"].append(index.tolist())
        loss = self.loss(x, batch_idx)
        if self.automatic_optimization:
            return loss
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(loss)
        self.rec["grads"].append(self.gradients())  # after the strategy's post_backward (on_after_backward: before)
        opt.step()
        return None

    def on_after_backward(self) -> None:
        if self.automatic_optimization:
            self.rec["grads"].append(self.gradients())

    def gradients(self) -> dict[str, torch.Tensor]:
        return {n: p.grad.clone() for n, p in self.named_parameters() if p.grad is not None}

    def on_train_end(self) -> None:
        self.rec["final"] = {k: v.clone() for k, v in self.state_dict().items()}

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR)


def fit(name: str, out: Path, strategy: Any, model: AuxNet, accumulate: int = 1, steps: int = 4) -> None:
    """Fit ``model`` on 2 ranks for ``steps`` batches; save its record with its error (``"Type: message"``, or None)
    and the seconds the fit took."""
    started = time.monotonic()
    try:
        quiet_trainer(
            2,
            strategy,
            max_epochs=1,
            limit_train_batches=steps,
            accumulate_grad_batches=accumulate,
            default_root_dir=str(out),
        ).fit(model)
        model.rec["error"] = None
    except Exception as e:  # noqa: BLE001 - the error is the record
        model.rec["error"] = f"{type(e).__name__}: {e}"
    model.rec["seconds"] = time.monotonic() - started
    save(out, name, model.rec)


#: Manual optimization (``manual_backward``, ``opt.step()`` per batch) under the DDP option combinations
#: docs/gradients.md offers (name -> options); the plain one is tests/sync/test_ddp_equivalence.py's.
MANUAL_OPTIONS: dict[str, dict[str, Any]] = {
    "static": {"static_graph": True},
    "static_view_hook": {"static_graph": True, "gradient_as_bucket_view": True, "ddp_comm_hook": "allreduce"},
    "unused_found": {"find_unused_parameters": True, "gradient_as_bucket_view": True},
    "static_unused_found_buckets": {"static_graph": True, "find_unused_parameters": True, "bucket_cap_mb": 1e-4},
}
#: ``accumulate_grad_batches=2`` with ``static_graph`` (name -> options); only the first also under ``"ddp"``.
ACCUMULATE_OPTIONS: dict[str, dict[str, Any]] = {
    "static": {"static_graph": True},
    "static_view_unused_found": {"static_graph": True, "gradient_as_bucket_view": True, "find_unused_parameters": True},
}


def lightning_options(options: dict[str, Any]) -> dict[str, Any]:
    """``options`` as Lightning's ``DDPStrategy`` takes them (a comm hook as a function; it registers it on CUDA
    only)."""
    if options.get("ddp_comm_hook") == "allreduce":
        options = {**options, "ddp_comm_hook": default_hooks.allreduce_hook}
    return options


def scenario_backward(out: Path) -> None:
    """Every fit of tests/sync/test_backward.py but ``"ddp"``'s per-rank branch: ``"ddp"``'s first (its failures
    leave the process group as it is), then ours; ours' failures last (they leave the group)."""
    for name, options in MANUAL_OPTIONS.items():
        fit(f"manual_{name}_ddp", out, DDPStrategy(**lightning_options(options)), AuxNet(manual=True))
    fit("accumulate_static_ddp", out, DDPStrategy(static_graph=True), AuxNet(), accumulate=2)
    fit("accumulate_late_aux_ddp", out, DDPStrategy(), AuxNet(aux_steps=(1, 3)), accumulate=2)
    fit("static_changed_ddp", out, DDPStrategy(static_graph=True), AuxNet(aux_steps=(0,)))
    for name, options in MANUAL_OPTIONS.items():
        fit(f"manual_{name}_ours", out, MyDDPStrategy(timeout=30, **options), AuxNet(manual=True))
    for name, options in ACCUMULATE_OPTIONS.items():
        fit(f"accumulate_{name}_ours", out, MyDDPStrategy(timeout=30, **options), AuxNet(), accumulate=2)
    fit("accumulate_late_aux_ours", out, MyDDPStrategy(timeout=30), AuxNet(aux_steps=(1, 3)), accumulate=2)
    fit("static_changed_ours", out, MyDDPStrategy(timeout=30, static_graph=True), AuxNet(aux_steps=(0,)))
    fit("rank_branch_ours", out, MyDDPStrategy(timeout=30), AuxNet(aux_ranks=(0,)))


def scenario_rank_branch_ddp(out: Path) -> None:
    """``aux`` used on rank 0 only, ``find_unused_parameters=False``, under ``"ddp"`` (a 10 s collective timeout)."""
    fit("rank_branch_ddp", out, DDPStrategy(timeout=timedelta(seconds=10)), AuxNet(aux_ranks=(0,)))
