"""Two ranks that run many short Lightning fits in sequence (one process start for all scenarios).

The testing kit starts the ranks with the torchrun-style environment (``LOCAL_RANK``, ``MASTER_ADDR``...) so
Lightning treats the processes as launched externally; every scenario is then a plain ``Trainer.fit`` in the same
two processes, on its own port (``MASTER_PORT``, set here). Each rank writes ``<scenario>_rank<r>.pt``; the tests
compare them with single-process references. Used by tests/sync/test_ddp_equivalence.py. ``scenario_batchnorm``
instead runs under the shared scenario launcher (``ddp_testing.launch``), for tests/sync/test_broadcast_buffers.py.
"""

from __future__ import annotations

import os
import time
import traceback
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.nn.functional as F
from ddp_testing import IndexedDigits, quiet_trainer, save, state_copy
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState
from torch.utils.data import DataLoader

from ddp_strategy import DigitsClassifier, DigitsDataModule, MyDDPStrategy
from ddp_strategy.sync.comm_hooks import count_collective_bytes

B = 16  # per-device batch size of the equivalence scenarios
STEPS = 4  # optimizer steps per equivalence scenario
LR = {"sgd": 0.2, "adam": 1e-2}
CLIP = 0.1
HOOK_EPOCHS = 12
HOOK_LR = 4e-3


class CountingState:
    """State of :func:`counting_allreduce_hook`: how many buckets were all-reduced so far."""

    def __init__(self) -> None:
        self.calls = 0


def counting_allreduce_hook(state, bucket):
    """DDP's own all-reduce, counting each bucket reduction (no annotations: DDP rejects string ones)."""
    state.calls += 1
    return default_hooks.allreduce_hook(None, bucket)


def _grads(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in module.named_parameters() if p.grad is not None}


class EquivClassifier(DigitsClassifier):
    """Digits classifier that records batches, per-micro-batch gradients, hook calls and weights."""

    def __init__(
        self,
        optimizer: str = "sgd",
        manual: bool = False,
        net: nn.Module | None = None,
        counting: CountingState | None = None,
        corrupt_rank1_after_batch: int | None = None,
    ) -> None:
        super().__init__(hidden_size=32)
        if net is not None:
            self.model = net
        self.optimizer_name = optimizer
        self.automatic_optimization = not manual
        self.counting = counting
        self.corrupt_after = corrupt_rank1_after_batch
        self.record: dict[str, Any] = {
            "batches": [],
            "grads": [],
            "hook_calls": [],
            "grad_norms": [],
            "buffers_in_step": [],
            "bn_classes": [],
        }

    def on_train_start(self) -> None:
        self.record["initial"] = state_copy(self.model)
        self.record["bn_classes"] = sorted(
            {type(m).__name__ for m in self.model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)}
        )

    def training_step(self, batch, batch_idx):
        x, y, idx = batch
        self.record["batches"].append(idx.tolist())
        self.record["buffers_in_step"].append({k: v.clone() for k, v in self.model.named_buffers()})
        loss = F.cross_entropy(self.model(x), y)
        if self.automatic_optimization:
            return loss
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        return None

    def on_after_backward(self) -> None:
        self.record["grads"].append(_grads(self.model))
        self.record["hook_calls"].append(self.counting.calls if self.counting is not None else None)

    def on_before_optimizer_step(self, optimizer) -> None:
        norms = [p.grad.norm() for p in self.model.parameters() if p.grad is not None]
        self.record["grad_norms"].append(torch.stack(norms).norm().item())

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        if self.corrupt_after is not None and batch_idx == self.corrupt_after and self.global_rank == 1:
            with torch.no_grad():
                self.model.layers[0].bias.add_(1.0)

    def on_train_end(self) -> None:
        self.record["final"] = state_copy(self.model)

    def configure_optimizers(self):
        if self.optimizer_name == "adam":
            return torch.optim.Adam(self.parameters(), lr=LR["adam"])
        return torch.optim.SGD(self.parameters(), lr=LR["sgd"])


def bn_net() -> nn.Module:
    """64 -> 32 -> BatchNorm1d -> ReLU -> 10: a net whose BatchNorm statistics depend on the batch."""
    net = nn.Sequential(nn.Linear(64, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 10))
    return _Wrapped(net)


class _Wrapped(nn.Module):
    def __init__(self, layers: nn.Sequential) -> None:
        super().__init__()
        self.layers = layers

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


class UnusedParamNet(nn.Module):
    """DigitsNet-like net with a head that never takes part in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
        self.unused_head = nn.Linear(32, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


class HookClassifier(DigitsClassifier):
    """The reference classifier (Adam, cosine schedule), recording bytes sent per training step."""

    def __init__(self) -> None:
        super().__init__(learning_rate=HOOK_LR)
        self.step_bytes: list[int] = []
        self.step_dtypes: dict[str, int] = {}
        self._counter = None

    def configure_optimizers(self):
        opt = torch.optim.Adam(self.parameters(), lr=HOOK_LR)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.CosineAnnealingLR(opt, HOOK_EPOCHS)}

    def on_train_batch_start(self, batch, batch_idx) -> None:
        self._counter = count_collective_bytes()
        self._counts = self._counter.__enter__()

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        self._counter.__exit__(None, None, None)
        self.step_bytes.append(self._counts.bytes_sent)
        for k, v in self._counts.by_dtype.items():
            self.step_dtypes[k] = self.step_dtypes.get(k, 0) + v


def _trainer(**kwargs: Any) -> pl.Trainer:
    strategy = MyDDPStrategy(start_method="popen", timeout=60, **kwargs.pop("strategy_kwargs", {}))
    defaults = dict(max_epochs=1, limit_train_batches=STEPS, limit_val_batches=0, num_sanity_val_steps=0)
    return quiet_trainer(2, strategy, **{**defaults, **kwargs})


def _save(out: Path, name: str, rank: int, record: dict[str, Any]) -> None:
    torch.save(record, out / f"{name}_rank{rank}.pt")


def _equivalence(
    name: str,
    rank: int,
    out: Path,
    optimizer: str = "sgd",
    manual: bool = False,
    accumulate: int = 1,
    clip: float | None = None,
    net: nn.Module | None = None,
    **trainer_kwargs: Any,
) -> None:
    torch.manual_seed(1000 + rank)  # different RNG per rank: DDP's broadcast must make the ranks agree
    counting = CountingState()
    model = EquivClassifier(optimizer, manual, net=net, counting=counting)
    pre_wrap = state_copy(model.model)
    strategy_kwargs = trainer_kwargs.pop("strategy_kwargs", {})
    strategy_kwargs.setdefault("ddp_comm_hook", counting_allreduce_hook)
    strategy_kwargs.setdefault("ddp_comm_state", counting)
    trainer = _trainer(
        limit_train_batches=STEPS * accumulate,
        accumulate_grad_batches=accumulate,
        gradient_clip_val=clip,
        strategy_kwargs=strategy_kwargs,
        **trainer_kwargs,
    )
    trainer.fit(model, IndexedDigits(batch_size=B))
    record = {
        **model.record,
        "pre_wrap": pre_wrap,
        "after_fit_bn_classes": sorted(
            {type(m).__name__ for m in model.model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)}
        ),
    }
    if trainer_kwargs.get("sync_batchnorm"):
        ckpt = out / "syncbn.ckpt"
        trainer.save_checkpoint(ckpt)
        if rank == 0:
            record["ckpt_keys"] = sorted(torch.load(ckpt, weights_only=False)["state_dict"])
    _save(out, name, rank, record)


def _expect_error(name: str, rank: int, out: Path, fit) -> None:
    try:
        fit()
        message = None
    except Exception as e:  # noqa: BLE001 - the message is the record
        message = f"{type(e).__name__}: {e}"
    _save(out, name, rank, {"error": message, "pg_destroyed": not dist.is_initialized()})


def _scenarios(rank: int, out: Path) -> list[tuple[str, Any]]:
    def user_group():
        return dist.new_group([0, 1])

    def hook_fit(hook: str):
        def run() -> None:
            pl.seed_everything(7)
            model = HookClassifier()
            strategy_kwargs: dict[str, Any] = {"ddp_comm_hook": hook}
            if hook == "powersgd":  # a user-made state: rank 2 instead of the default rank 1
                strategy_kwargs["ddp_comm_state"] = PowerSGDState(
                    process_group=None, matrix_approximation_rank=2, start_powerSGD_iter=10
                )
            trainer = _trainer(
                max_epochs=HOOK_EPOCHS,
                limit_train_batches=None,
                limit_val_batches=None,
                strategy_kwargs=strategy_kwargs,
            )
            trainer.fit(model, DigitsDataModule(batch_size=32))
            _save(
                out,
                f"hook_{hook}",
                rank,
                {
                    "val_acc": float(trainer.callback_metrics["val_acc"]),
                    "step_bytes": model.step_bytes,
                    "by_dtype": model.step_dtypes,
                    "final": state_copy(model.model),
                },
            )

        return run

    def unused(find: bool):
        def fit() -> None:
            torch.manual_seed(0)
            _trainer(limit_train_batches=2, strategy_kwargs={"find_unused_parameters": find}).fit(
                EquivClassifier(net=UnusedParamNet()), IndexedDigits(batch_size=B)
            )

        return fit

    def desync() -> None:
        torch.manual_seed(0)
        _trainer(limit_train_batches=6, strategy_kwargs={"verify_sync_every_n_steps": 2}).fit(
            EquivClassifier(corrupt_rank1_after_batch=2), IndexedDigits(batch_size=B)
        )

    return [
        ("sgd", lambda: _equivalence("sgd", rank, out, "sgd")),
        ("adam", lambda: _equivalence("adam", rank, out, "adam")),
        ("accumulate", lambda: _equivalence("accumulate", rank, out, "adam", accumulate=4)),
        ("manual", lambda: _equivalence("manual", rank, out, "adam", manual=True)),
        ("clip", lambda: _equivalence("clip", rank, out, "sgd", clip=CLIP)),
        (
            "user_group",
            lambda: _equivalence(
                "user_group",
                rank,
                out,
                "sgd",
                strategy_kwargs={"process_group": user_group, "bucket_cap_mb": 1, "static_graph": True},
            ),
        ),
        ("syncbn", lambda: _equivalence("syncbn", rank, out, "sgd", net=bn_net(), sync_batchnorm=True)),
        ("buffers_broadcast", lambda: _equivalence("buffers_broadcast", rank, out, "sgd", net=bn_net())),
        (
            "buffers_local",
            lambda: _equivalence(
                "buffers_local", rank, out, "sgd", net=bn_net(), strategy_kwargs={"broadcast_buffers": False}
            ),
        ),
        ("hooks_allreduce", hook_fit("allreduce")),
        ("hooks_fp16", hook_fit("fp16")),
        ("hooks_bf16", hook_fit("bf16")),
        ("hooks_powersgd", hook_fit("powersgd")),
        ("unused_found", lambda: _expect_error("unused_found", rank, out, unused(True))),
        ("unused_error", lambda: _expect_error("unused_error", rank, out, unused(False))),
        ("desync", lambda: _expect_error("desync", rank, out, desync)),
    ]


def run_rank(rank: int, ports: list[int], out_dir: str, only: list[str] | None = None) -> None:
    """Entry point of each rank: run every scenario (or ``only`` these), each on its own port."""
    out = Path(out_dir)
    torch.set_num_threads(1)
    os.chdir(out)  # Lightning may create lightning_logs/ etc.: keep them out of the test's cwd
    scenarios = _scenarios(rank, out)
    for port, (name, run) in zip(ports, scenarios, strict=False):
        if only is not None and name not in only:
            continue
        os.environ["MASTER_PORT"] = str(port)
        started = time.monotonic()
        try:
            run()
        except Exception:
            (out / f"{name}_rank{rank}.failed").write_text(traceback.format_exc())
            if dist.is_initialized():
                dist.destroy_process_group()
        with open(out / f"timing_rank{rank}.txt", "a") as f:
            f.write(f"{name} {time.monotonic() - started:.1f}\n")


def kit_entry(rank: int, world_size: int, ports: list[int], out_dir: str) -> None:
    """:func:`run_rank` as the testing kit calls it (``ddp_strategy.testing.run_on_ranks``)."""
    assert world_size == 2, "the scenarios are written for 2 ranks"
    run_rank(rank, ports, out_dir)


# ------------------------------------------ BatchNorm buffers in validation (tests/sync/test_broadcast_buffers.py)
class BatchNormNet(pl.LightningModule):
    """A BatchNorm1d model whose ranks see different training data, so their running means drift apart."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 1))
        self.rec: dict[str, list[torch.Tensor]] = {"before": [], "during": []}

    def train_dataloader(self) -> Any:
        x = torch.randn(32, 4, generator=torch.Generator().manual_seed(1))
        x[1::2] = x[1::2] * 3 + 2  # rank 1 reads the odd samples: its running statistics drift away from rank 0's
        return DataLoader(list(zip(x, torch.zeros(32), strict=True)), batch_size=4, shuffle=False)

    def val_dataloader(self) -> Any:
        return DataLoader(list(zip(torch.randn(8, 4), torch.zeros(8), strict=True)), batch_size=4)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.net(batch[0]).pow(2).mean()

    def on_validation_start(self) -> None:  # runs before the strategy's hook
        self.rec["before"].append(self.net[1].running_mean.clone())

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        if batch_idx == 0:
            self.rec["during"].append(self.net[1].running_mean.clone())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def scenario_batchnorm(out: Path) -> None:
    """Fit 2 epochs with validation, broadcast_buffers True and False; then Lightning's ddp."""
    for name, strategy in (
        ("bn_true", MyDDPStrategy(start_method="popen", timeout=60)),
        ("bn_false", MyDDPStrategy(start_method="popen", timeout=60, broadcast_buffers=False)),
        ("bn_lightning", "ddp"),
    ):
        model = BatchNormNet()
        quiet_trainer(2, strategy, max_epochs=2, num_sanity_val_steps=0, default_root_dir=str(out)).fit(model)
        save(out, name, model.rec)
    dist.destroy_process_group()
