"""Workers for tests/sampling/test_evaluation_compat.py: evaluation collectives under MyDDPStrategy.

Launched with :func:`sampling_workers.launch` (``"evaluation_workers:scenario"``): each scenario runs several
Trainers inside one pair of gloo processes and records, per rank, what the user's module saw in
``out_dir/<name>.rank<R>.pt``. The same module also runs under Lightning's own ``strategy="ddp"`` for
comparison.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torchmetrics
from ddp_testing import save
from sampling_workers import trainer
from torch.utils.data import BatchSampler, DataLoader, Dataset, DistributedSampler, SequentialSampler

from ddp_strategy import MyDDPStrategy, all_gather_rows


class Samples(Dataset):
    """``n`` samples ``(x, index)`` with fixed random features."""

    def __init__(self, n: int) -> None:
        self.x = torch.randn(n, 4, generator=torch.Generator().manual_seed(5))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return self.x[i], i


def score(x: torch.Tensor) -> torch.Tensor:
    """A per-sample output that does not depend on the batch it is computed in: ``sum(x) * 0.5``."""
    return x.sum(dim=1) * 0.5


class Collectives(pl.LightningModule):
    """Every evaluation-collective pattern of the issue, recorded per rank (validation of ``n`` samples)."""

    def __init__(self, n: int, batch_size: int) -> None:
        super().__init__()
        self.n, self.batch_size = n, batch_size
        self.layer = torch.nn.Linear(4, 1)
        self.step_mean = torchmetrics.MeanMetric(dist_sync_on_step=True)
        self.epoch_mean = torchmetrics.MeanMetric()
        self.rec: dict[str, Any] = {
            "batches": [],
            "step_gathers": [],
            "step_metric": [],
            "reduced": [],
            "broadcast": [],
        }
        self.outputs: list[torch.Tensor] = []

    def val_dataloader(self) -> Any:
        return DataLoader(Samples(self.n), batch_size=self.batch_size)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, idx = batch
        s = score(x)
        self.rec["batches"].append(idx.tolist())
        self.rec["step_gathers"].append(self.all_gather({"idx": idx, "score": [s]}))  # a nested collection
        self.rec["step_metric"].append(float(self.step_mean(s)))  # torchmetrics syncs this step's batches
        self.epoch_mean.update(s)
        self.log("mean_epoch", s.mean(), sync_dist=True)
        self.log("mean_step", s.mean(), on_step=True, on_epoch=False, sync_dist=True)
        self.rec["reduced"].append(float(self.trainer.strategy.reduce(torch.tensor(float(len(idx))), reduce_op="sum")))
        self.rec["broadcast"].append(self.trainer.strategy.broadcast(idx.tolist()))
        self.trainer.strategy.barrier()
        self.outputs.append(s)

    def on_validation_epoch_end(self) -> None:
        scores = torch.cat(self.outputs)
        self.rec["epoch_gather"] = self.all_gather(scores)
        self.rec["epoch_rows"] = all_gather_rows(scores)
        self.rec["step_metric_epoch"] = float(self.step_mean.compute())
        self.rec["epoch_metric"] = float(self.epoch_mean.compute())
        self.outputs.clear()
        if isinstance(self.trainer.strategy, MyDDPStrategy):  # under Lightning's ddp these two kill gloo
            with torch.inference_mode(False), torch.enable_grad():
                ones = torch.ones(len(scores), requires_grad=True)
                self.all_gather(ones, sync_grads=True).sum().backward()
                self.rec["gather_grad"] = ones.grad.tolist()
            try:
                self.all_gather(torch.zeros(2, self.global_rank + 1))
                self.rec["bad_shape"] = None
            except ValueError as error:
                self.rec["bad_shape"] = str(error)


def _validate(name: str, out: Path, strategy: Any, n: int, batch_size: int) -> None:
    """Validate a fresh :class:`Collectives` on ``n`` samples; record the module's and Lightning's values."""
    model = Collectives(n, batch_size)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t = trainer(2, out, strategy=strategy, max_epochs=1)
        t.validate(model, verbose=False)
    save(
        out,
        name,
        {
            **model.rec,
            "metrics": {k: float(v) for k, v in t.callback_metrics.items()},
            "warnings": [str(w.message) for w in caught],
        },
    )


def scenario_collectives(out: Path) -> None:
    """The issue's inputs (3, 21, 17 samples, batch 4), a padded one (5, batch 1), exact_evaluation=False; ddp."""
    for n, b in ((3, 4), (21, 4), (17, 4), (5, 1)):
        _validate(f"mine_{n}_{b}", out, MyDDPStrategy(start_method="popen", timeout=60), n, b)
    _validate(
        "mine_lightning_layout_17_4",
        out,
        MyDDPStrategy(start_method="popen", timeout=60, exact_evaluation=False),
        17,
        4,
    )
    one_rank = OneRankProcessing()
    trainer(2, out, strategy=MyDDPStrategy(start_method="popen", timeout=10), max_epochs=1).validate(one_rank)
    save(out, "one_rank_process_dataloader", one_rank.rec)
    for n, b in ((17, 4), (5, 1)):
        _validate(f"lightning_{n}_{b}", out, "ddp", n, b)
        dist.destroy_process_group()  # Lightning's ddp leaves it for the next Trainer; ours makes a fresh one


class Mine(BatchSampler):
    """The user's own batch sampler class."""


class OneRankProcessing(pl.LightningModule):
    """At validation's end rank 1 alone hands three evaluation loaders of 11 samples, batch 4, to process_dataloader:
    a plain one, one with the user's BatchSampler class and one with the user's own DistributedSampler."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.rec: dict[str, Any] = {}

    def val_dataloader(self) -> Any:
        return DataLoader(Samples(2), batch_size=1)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        pass

    def on_validation_epoch_end(self) -> None:
        if self.global_rank == 1:  # a collective here would wait for rank 0, which never calls it
            data = Samples(11)
            loaders = (
                DataLoader(data, batch_size=4),
                DataLoader(data, batch_sampler=Mine(SequentialSampler(data), 4, drop_last=False)),
                DataLoader(data, batch_size=4, sampler=DistributedSampler(data, 2, 1, shuffle=False)),
            )
            got = [self.trainer.strategy.process_dataloader(loader) for loader in loaders]
            self.rec = {
                "batches": [len(g) for g in got],
                "kept": [type(g.batch_sampler).__name__ for g in got],
                "own_unchanged": got[2] is loaders[2],
            }


class PredictMetric(pl.LightningModule):
    """Predict on 9 samples, batch 4 (Lightning's unpadded predict shards: 2 and 1 batches), syncing every step."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.metric = torchmetrics.SumMetric(dist_sync_on_step=True)

    def predict_dataloader(self) -> Any:
        return DataLoader(Samples(9), batch_size=4)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.metric(score(batch[0]))


def scenario_predict_metric(out: Path) -> None:
    """A per-step torch.distributed collective (torchmetrics) on uneven predict shards: what each step returns."""
    predictions = trainer(2, out, strategy=MyDDPStrategy(start_method="popen", timeout=10)).predict(PredictMetric())
    save(out, "predict_metric", {"predictions": [float(p) for p in predictions]})
