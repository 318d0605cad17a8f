"""Workers for tests/sampling/test_sampling_integration.py: several Trainer runs inside one set of real gloo processes.

Each launch starts W ranks once with the testing kit (``ddp_strategy.testing.run_on_ranks``: forked from a
forkserver that imported torch and Lightning once) with the torchrun-style variables Lightning reads
(``LOCAL_RANK``, ``NODE_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``); Lightning then sees
externally created processes, and every ``Trainer`` in the worker joins a fresh process group on the same
port. That shares the cost of starting Python and importing Lightning between many fits.
Every run records what it saw in ``out_dir/<name>.rank<R>.pt`` (plain lists and tensors).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
import torchmetrics
from ddp_testing import quiet_trainer, save, state_copy
from lightning.pytorch.callbacks import BasePredictionWriter, ModelCheckpoint
from torch.utils.data import DataLoader, Dataset, WeightedRandomSampler

from ddp_strategy import MyDDPStrategy

SEED = 7
N_TRAIN, N_VAL, N_TEST = 26, 23, 9
BATCH, VAL_BATCH = 3, 4
EPOCHS = 3
CKPT_STEP = 7


class Indexed(Dataset):
    """``n`` samples ``(x, y, v, index)``: fixed random features, labels and a value to average."""

    def __init__(self, n: int, salt: int) -> None:
        g = torch.Generator().manual_seed(1000 + salt)
        self.x = torch.randn(n, 4, generator=g)
        self.y = torch.randint(0, 2, (n,), generator=g)
        self.v = torch.rand(n, generator=g) * 10

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        return self.x[i], self.y[i], self.v[i], i


def fixed_prediction(x: torch.Tensor) -> torch.Tensor:
    """Evaluation predictions that do not depend on training, so any world size must give the same metric."""
    return (x[:, 0] + x[:, 1] > 0).long()


class Recorder(pl.LightningModule):
    """A linear model that records training/validation/test indices per epoch and its final weights."""

    def __init__(self, train_loader: Any = None, val: bool = True, step_sync: bool = False) -> None:
        super().__init__()
        torch.manual_seed(SEED)
        self.layer = torch.nn.Linear(4, 2)
        self.train_loader, self.val, self.step_sync = train_loader, val, step_sync
        self.acc = torchmetrics.classification.BinaryAccuracy()
        self.rec: dict[str, Any] = {"train": {}, "val": {}, "test": [], "val_metrics": []}

    def train_dataloader(self) -> Any:
        if self.train_loader is not None:
            return self.train_loader
        return DataLoader(Indexed(N_TRAIN, 0), batch_size=BATCH, shuffle=True)

    def val_dataloader(self) -> Any:
        return DataLoader(Indexed(N_VAL, 1), batch_size=VAL_BATCH) if self.val else []

    def test_dataloader(self) -> Any:
        return DataLoader(Indexed(N_TEST, 2), batch_size=VAL_BATCH)

    def predict_dataloader(self) -> Any:
        return DataLoader(Indexed(N_TEST, 2), batch_size=VAL_BATCH)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, _, idx = batch
        self.rec["train"].setdefault(self.current_epoch, []).extend(idx.tolist())
        return F.cross_entropy(self.layer(x), y)

    def _evaluate(self, batch: Any, prefix: str) -> None:
        x, y, v, idx = batch
        self.acc(fixed_prediction(x), y)
        self.log(f"{prefix}_acc", self.acc, on_epoch=True)
        self.log(f"{prefix}_value", v.mean(), sync_dist=True, on_step=self.step_sync, on_epoch=True)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.rec["val"].setdefault(self.current_epoch, []).extend(batch[3].tolist())
        self._evaluate(batch, "val")

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.rec["test"].extend(batch[3].tolist())
        self._evaluate(batch, "test")

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.step_sync:
            self.trainer.strategy.barrier()  # predict shards stay uneven (Lightning's sampler): the join shadows it
        return batch[3]

    def on_validation_end(self) -> None:
        metrics = self.trainer.callback_metrics
        self.rec["val_metrics"].append({k: float(metrics[k]) for k in ("val_acc", "val_value") if k in metrics})

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class IndexWriter(BasePredictionWriter):
    """Records Lightning's prediction batch indices next to the predicted values."""

    def __init__(self) -> None:
        super().__init__(write_interval="batch")
        self.pairs: list[tuple[list[int], list[int]]] = []

    def write_on_batch_end(self, trainer, pl_module, prediction, batch_indices, batch, batch_idx, dataloader_idx):
        self.pairs.append((list(batch_indices), prediction.tolist()))


def trainer(world_size: int, root: Path, strategy: Any = None, **kwargs: Any) -> pl.Trainer:
    """A quiet CPU trainer on ``world_size`` externally launched processes."""
    defaults: dict[str, Any] = dict(max_epochs=EPOCHS, num_sanity_val_steps=0, default_root_dir=str(root))
    strategy = strategy or MyDDPStrategy(start_method="popen", timeout=60)
    return quiet_trainer(world_size, strategy, **{**defaults, **kwargs})


def fit(
    name: str,
    out: Path,
    world_size: int,
    ckpt_path: str | None = None,
    save_every: int | None = None,
    model: Recorder | None = None,
    **trainer_kwargs: Any,
) -> Recorder:
    """Fit ``model`` (default: shuffled training, validation each epoch) and record it as ``name``."""
    model = model or Recorder()
    callbacks = []
    if save_every:
        callbacks.append(
            ModelCheckpoint(
                dirpath=str(out / f"{name}_ckpt"), every_n_train_steps=save_every, save_top_k=-1, filename="{step}"
            )
        )
    t = trainer(world_size, out, callbacks=callbacks, enable_checkpointing=bool(save_every), **trainer_kwargs)
    t.fit(model, ckpt_path=ckpt_path)
    save(
        out,
        name,
        {
            **model.rec,
            "weights": state_copy(model),
            "global_step": t.global_step,
        },
    )
    return model


# -------------------------------------------------------------------------------------------- scenarios
def scenario_two(out: Path) -> None:
    """W=2: uninterrupted fit with a mid-epoch checkpoint, its resume, custom samplers, test, predict, per-step sync."""
    pl.seed_everything(SEED)
    fit("full2", out, 2, save_every=CKPT_STEP)
    fit("resume2to2", out, 2, ckpt_path=str(out / "full2_ckpt" / f"step={CKPT_STEP}.ckpt"))
    # A weighted sampler: injected exactly once (Lightning's own injection is off while we inject).
    weighted = DataLoader(
        Indexed(N_TRAIN, 0),
        batch_size=BATCH,
        sampler=WeightedRandomSampler(torch.linspace(1, 3, N_TRAIN), num_samples=20),
    )
    fit("weighted", out, 2, model=Recorder(train_loader=weighted, val=False), max_epochs=2)
    ordered = DataLoader(Indexed(N_TRAIN, 0), batch_size=BATCH, shuffle=False)
    fit("ordered", out, 2, model=Recorder(train_loader=ordered, val=False), max_epochs=1)
    model, writer = Recorder(), IndexWriter()
    t = trainer(2, out, callbacks=[writer])
    t.test(model)
    test_metrics = {k: float(v) for k, v in t.callback_metrics.items()}
    predictions = t.predict(model, return_predictions=True)
    save(
        out,
        "eval",
        {
            "test": model.rec["test"],
            "test_metrics": test_metrics,
            "pairs": writer.pairs,
            "predictions": [p.tolist() for p in predictions],
        },
    )
    # Per-step sync_dist in test_step: test shards hold equal batch counts (2 and 2), so it meets; exact epoch value.
    model, t = Recorder(step_sync=True), trainer(2, out)
    t.test(model)
    save(
        out,
        "step_sync",
        {"test": model.rec["test"], "test_metrics": {k: float(v) for k, v in t.callback_metrics.items()}},
    )
    predictions = trainer(2, out).predict(Recorder(step_sync=True))
    save(out, "step_barrier", {"predicted": [i for p in predictions for i in p.tolist()]})


def scenario_one(out: Path) -> None:
    """W=1: uninterrupted fit (for 1 -> 2) and the 2 -> 1 resume."""
    pl.seed_everything(SEED)
    fit("full1", out, 1, save_every=CKPT_STEP)
    fit("resume2to1", out, 1, ckpt_path=str(out / "full2_ckpt" / f"step={CKPT_STEP}.ckpt"))


def scenario_three(out: Path) -> None:
    """W=3: the 2 -> 3 resume (its validation also gives the 3-process metrics)."""
    pl.seed_everything(SEED)
    fit("resume2to3", out, 3, ckpt_path=str(out / "full2_ckpt" / f"step={CKPT_STEP}.ckpt"))


def scenario_one_to_two(out: Path) -> None:
    """W=2: the 1 -> 2 resume."""
    pl.seed_everything(SEED)
    fit("resume1to2", out, 2, ckpt_path=str(out / "full1_ckpt" / f"step={CKPT_STEP}.ckpt"))
