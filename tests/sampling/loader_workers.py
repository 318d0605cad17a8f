"""Workers for tests/sampling/test_loader_compat.py: what the user asked of an evaluation loader survives.

One scenario, run on 1 and on 2 gloo processes (see :func:`ddp_testing.launch`): the same user code, a fit, then
validate, test and predict, under ``MyDDPStrategy()`` and then Lightning's ``strategy="ddp"``, with ``drop_last=True``
loaders and the user's own ``BatchSampler`` subclass. Each rank records the samples each step saw and what
``trainer.*_dataloaders`` hold, in ``out_dir/<strategy>.rank<R>.pt``.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from ddp_testing import save
from sampling_workers import SEED, Indexed, trainer
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, SequentialSampler
from torch.utils.data.distributed import DistributedSampler

from ddp_strategy import MyDDPStrategy

N, BATCH = 10, 4  # 10 samples, batch 4, drop_last=True: Lightning evaluates 8 of them
STAGES = ("train", "val", "test", "predict")
UNEVEN = (9, 11)  # on 2 ranks, Labelled makes 2 and 1 batches of the exact shards of 9, 2 and 2 of those of 11


class Labelled(BatchSampler):
    """The user's ``BatchSampler`` subclass: an ``__init__`` argument, an attribute and a method of its own."""

    def __init__(self, sampler: Any, batch_size: int, drop_last: bool, label: str = "none") -> None:
        super().__init__(sampler, batch_size, drop_last)
        self.label = label

    def describe(self) -> str:
        return f"{self.label}/{self.batch_size}/{self.drop_last}"


def loaders(stage: str, salt: int) -> list[DataLoader]:
    """A ``drop_last=True`` loader and one with a :class:`Labelled` batch sampler (also ``drop_last=True``)."""
    data = Indexed(N, salt)
    inner = RandomSampler(data) if stage == "train" else SequentialSampler(data)
    return [
        DataLoader(data, batch_size=BATCH, drop_last=True),
        DataLoader(data, batch_sampler=Labelled(inner, BATCH, drop_last=True, label=stage)),
    ]


def describe(loader: Any) -> dict[str, Any]:
    """What user code can read of a loader in ``trainer.*_dataloaders``: its batch sampler's class and attributes
    (under Lightning's ``_IndexBatchSamplerWrapper`` in predict, the one it wraps too)."""
    outer = loader.batch_sampler
    inner = getattr(outer, "_batch_sampler", outer)
    labelled = isinstance(inner, Labelled)
    return {
        "class": type(outer).__name__,
        "inner": type(inner).__name__,
        "labelled": labelled,
        "label": getattr(inner, "label", None),
        "describe": inner.describe() if labelled else None,
        "drop_last": getattr(inner, "drop_last", None),
        "batch_size": getattr(inner, "batch_size", None),
        "distributed": isinstance(getattr(inner, "sampler", None), DistributedSampler),
        "batches": len(loader),
    }


class Loaders(pl.LightningModule):
    """A linear model whose loaders are built in its hooks (as most users do); records every step's samples."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(SEED)
        self.layer = nn.Linear(4, 2)
        self.seen: dict[str, list[list[list[int]]]] = {stage: [[], []] for stage in STAGES}

    def train_dataloader(self) -> Any:
        return loaders("train", 0)[1]

    def val_dataloader(self) -> Any:
        return loaders("val", 1)

    def test_dataloader(self) -> Any:
        return loaders("test", 2)

    def predict_dataloader(self) -> Any:
        return loaders("predict", 3)

    def _record(self, stage: str, batch: Any, index: int) -> torch.Tensor:
        self.seen[stage][index].append(batch[3].tolist())
        return nn.functional.cross_entropy(self.layer(batch[0]), batch[1])

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self._record("train", batch, 0)

    def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self.log("val_loss", self._record("val", batch, dataloader_idx), on_step=True, sync_dist=True)

    def test_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self.log("test_loss", self._record("test", batch, dataloader_idx), on_step=True, sync_dist=True)

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Any:
        return self._record("predict", batch, dataloader_idx)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def run(out: Path, name: str, strategy: Any, world_size: int) -> None:
    """The user's code: seed, fit one epoch (with validation), validate, test, predict; record what each saw."""
    pl.seed_everything(SEED)
    model, record = Loaders(), {}
    t = trainer(world_size, out, strategy=strategy, max_epochs=1)
    t.fit(model)
    record["train_loader"] = describe(t.train_dataloader)
    record["fit_val_loaders"] = [describe(dl) for dl in t.val_dataloaders]
    record["fit_val"], model.seen["val"] = model.seen["val"], [[], []]
    t.validate(model, verbose=False)
    record["val_loaders"] = [describe(dl) for dl in t.val_dataloaders]
    t.test(model, verbose=False)
    record["test_loaders"] = [describe(dl) for dl in t.test_dataloaders]
    t.predict(model)
    record["predict_loaders"] = [describe(dl) for dl in t.predict_dataloaders]
    # Ready-made loaders (Lightning re-creates Labelled from its attributes) of 9 and 11 samples, drop_last=False.
    record["val"], model.seen["val"] = model.seen["val"], [[], []]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t.validate(
            model,
            [
                DataLoader(Indexed(n, 4), batch_sampler=Labelled(SequentialSampler(range(n)), BATCH, False))
                for n in UNEVEN
            ],
            verbose=False,
        )
    record["uneven_val"] = model.seen["val"]
    record["padded_warnings"] = [str(w.message) for w in caught if "are padded" in str(w.message)]
    save(
        out,
        name,
        {
            **record,
            "train": model.seen["train"],
            "test": model.seen["test"],
            "predict": model.seen["predict"],
            "steps": t.global_step,
        },
    )


def scenario(out: Path) -> None:
    """Ours first, then Lightning's ddp (whose teardown keeps the process group: destroyed at the end)."""
    world_size = int(os.environ["WORLD_SIZE"])
    run(out, "mine", MyDDPStrategy(start_method="popen", timeout=60), world_size)
    run(out, "lightning", "ddp", world_size)
    if dist.is_initialized():
        dist.destroy_process_group()
