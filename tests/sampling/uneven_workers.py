"""Workers for tests/sampling/test_uneven.py: fits whose ranks hold different numbers of training batches.

Each scenario runs in 2 real gloo processes started by :func:`ddp_testing.launch` (several Trainer runs per
launch) and records what every rank saw in ``out/<name>.rank<R>.pt``. Every sample is identifiable: sample ``i``
of rank ``r`` has index ``100 * r + i``; its features come from :func:`samples`, which the test uses for its
single-process reference.
"""

from __future__ import annotations

import logging
import os
import sys
import time
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import lightning_utilities.core.rank_zero as rank_zero
import torch
import torch.distributed as dist
import torchmetrics
from ddp_testing import quiet_trainer, rank, save, state_copy
from lightning.pytorch.callbacks import BasePredictionWriter, EMAWeightAveraging, ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset

from ddp_strategy import MyDDPStrategy

SEED = 11
LR, MOMENTUM = 0.1, 0.9
TRAIN_SALT, VAL_SALT = 0, 1
#: Samples per rank: training (IterableDataset, batch 2: 5 and 4 batches; map-style, batch 4: 4 and 3 batches),
#: validation (batch 2: 3 and 2 batches, the last one of rank 1 has 1 sample).
ITERABLE, MAP, VAL = (10, 8), (13, 11), (6, 3)
ITERABLE_BATCH, MAP_BATCH, VAL_BATCH = 2, 4, 2
EPOCHS = 2
BN_COUNTS, BN_MOMENTUM = (2, 6), 0.5  # rank 0: 1 batch of 2, rank 1: 3
#: Evaluation streams (issue 38 item 1): 10 and 8 samples, batch 2: 5 and 4 batches per rank.
EVAL, EVAL_BATCH, EVAL_SALT = (10, 8), 2, 2

#: ``Zero``'s gradient clipping (by norm, Lightning's ``gradient_clip_val``) and its per-step learning-rate decay.
CLIP, GAMMA = 0.5, 0.9
#: ``EMAWeightAveraging``'s decay (an update after each optimizer step).
EMA_DECAY = 0.5
#: The collectives a training step makes (``Probed(probes=...)``): shadowed ones, then each refused one.
SHADOWED = ("log", "reduce", "decision", "barrier", "broadcast")


def samples(r: int, n: int, salt: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rank ``r``'s ``n`` samples: features (n, 3), targets (n, 1), indices ``100 * r + i``."""
    g = torch.Generator().manual_seed(1000 * salt + r)
    return torch.randn(n, 3, generator=g), torch.randn(n, 1, generator=g), torch.arange(n) + 100 * r


class Stream(IterableDataset):
    """An IterableDataset yielding this rank's ``counts[rank]`` samples (what a user streaming own shards has)."""

    def __init__(self, counts: tuple[int, ...], salt: int) -> None:
        self.counts, self.salt = counts, salt

    def __iter__(self) -> Any:
        x, y, idx = samples(rank(), self.counts[rank()], self.salt)
        return iter(zip(x, y, idx, strict=True))


class Hinted(Stream):
    """A :class:`Stream` whose ``__len__`` gives the longest rank's count on every rank: a length that is a hint."""

    def __len__(self) -> int:
        return max(self.counts)


class RankSized(Dataset):
    """This rank's samples, map-style, whose ``__len__`` reads ``torch.distributed.get_rank()`` (as WebDataset-style
    ``split_by_node`` code does): it works only while the process group exists."""

    def __init__(self, counts: tuple[int, ...], salt: int) -> None:
        self.counts, self.salt = counts, salt

    def __len__(self) -> int:
        return self.counts[dist.get_rank()]

    def __getitem__(self, i: int) -> tuple[torch.Tensor, ...]:
        return tuple(t[i] for t in samples(dist.get_rank(), len(self), self.salt))


def stream(counts: tuple[int, ...], batch_size: int, salt: int = TRAIN_SALT) -> DataLoader:
    return DataLoader(Stream(counts, salt), batch_size=batch_size)


def own_shard(counts: tuple[int, ...], batch_size: int, salt: int = TRAIN_SALT) -> DataLoader:
    """A map-style loader over this rank's own samples (pre-sharded: ``use_distributed_sampler=False``)."""
    return DataLoader(TensorDataset(*samples(rank(), counts[rank()], salt)), batch_size=batch_size)


def loss_of(layer: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The batch's mean squared error (the reference computes the same)."""
    return ((layer(x) - y) ** 2).mean()


def make_layer() -> nn.Linear:
    """The model's seeded initial layer (the reference starts from the same)."""
    torch.manual_seed(SEED)
    return nn.Linear(3, 1)


class Probed(pl.LightningModule):
    """A linear regression trained with SGD and momentum that records, per epoch, the indices of each training batch,
    and runs the collectives named in ``probes`` in every training step, recording what each returned."""

    def __init__(self, probes: tuple[str, ...] = (), metric: bool = False) -> None:
        super().__init__()
        self.layer = make_layer()
        self.probes = probes
        self.metric = torchmetrics.MeanMetric(dist_sync_on_step=True) if metric else None
        self.seen: dict[int, list[list[int]]] = {}
        self.results: list[dict[str, Any]] = []  # per training step on this rank
        self.val: list[float] = []  # the epoch-level validation loss, per epoch

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, idx = batch
        self.seen.setdefault(self.current_epoch, []).append(idx.tolist())
        loss = loss_of(self.layer, x, y)
        if self.metric is not None:
            self.metric(loss.detach())
        v = float(10 * (self.global_rank + 1) + batch_idx)  # rank 0: 10 + i, rank 1: 20 + i
        strategy, got = self.trainer.strategy, {"epoch": self.current_epoch, "batch": batch_idx, "v": v}
        if "log" in self.probes:
            self.log("x", v, on_step=True, sync_dist=True)
            self.log("x_epoch", v, on_step=False, on_epoch=True, sync_dist=True, prog_bar=True)
        if "reduce" in self.probes:
            got["sum"] = strategy.reduce(torch.tensor([v]), reduce_op="sum").item()
            got["max"] = strategy.reduce(torch.tensor([-v]), reduce_op="max").item()  # a joined 0 would win
            got["min"] = strategy.reduce(torch.tensor([v]), reduce_op="min").item()  # a joined 0 would win
            got["mean"] = strategy.reduce(torch.tensor([v])).item()
        if "decision" in self.probes:
            got["all"] = strategy.reduce_boolean_decision(self.global_rank == 0, all=True)
            got["any"] = strategy.reduce_boolean_decision(self.global_rank == 1, all=False)
        if "barrier" in self.probes:
            strategy.barrier()
            got["barrier"] = True
        if "broadcast" in self.probes:
            got["broadcast"] = strategy.broadcast(f"from rank {self.global_rank}", src=0)
        if "broadcast_from_1" in self.probes:
            got["broadcast_from_1"] = strategy.broadcast(f"from rank {self.global_rank}", src=1)
        if "reduce_band" in self.probes:  # a reduction a step with fewer ranks cannot shadow
            got["reduce_band"] = strategy.reduce(torch.tensor([int(v)]), reduce_op=dist.ReduceOp.BAND).item()
        if "all_gather" in self.probes:
            got["all_gather"] = self.all_gather(torch.tensor([v])).tolist()
        if "torch_distributed" in self.probes:  # the user's own collective, not through the strategy
            dist.all_reduce(value := torch.tensor([v]))
            got["torch_distributed"] = value.item()
        self.results.append(got)
        return loss

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if "log" in self.probes:
            self.results[-1]["log"] = float(self.trainer.callback_metrics["x"])

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y, _ = batch
        self.log("val", loss_of(self.layer, x, y), sync_dist=True, batch_size=len(x))
        if "val_step_log" in self.probes:  # a per-step collective in every validation run: each under the join
            self.log("val_step", loss_of(self.layer, x, y), on_step=True, sync_dist=True, batch_size=len(x))

    def on_validation_end(self) -> None:
        if not self.trainer.sanity_checking:
            self.val.append(float(self.trainer.callback_metrics["val"]))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR, momentum=MOMENTUM)


class Normed(Probed):
    """:class:`Probed` with a BatchNorm on the inputs, whose running mean DDP broadcasts before each forward."""

    def __init__(self, metric: bool = False) -> None:
        super().__init__(metric=metric)
        self.norm = nn.BatchNorm1d(3, momentum=BN_MOMENTUM, affine=False)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, idx = batch
        return super().training_step((self.norm(x), y, idx), batch_idx)


class Evaluated(pl.LightningModule):
    """The same user code for ``strategy="ddp"`` and MyDDPStrategy: each validation and test step logs ``x``, ``v =
    10 * (rank + 1) + batch_idx``, with ``on_step=True, sync_dist=True``, feeds a torchmetrics ``SumMetric`` with
    ``dist_sync_on_step=True`` its batch's target sum (its forward: the step's sum over the ranks), and logs the loss
    per epoch (``sync_dist=True``); each predict step feeds the metric and returns the batch's indices. Records, per
    step, the logged ``x`` and the metric's value, and, per stage, the metric's ``compute()``. ``gather``: also
    ``self.all_gather`` in each step."""

    def __init__(self, gather: bool = False) -> None:
        super().__init__()
        self.layer, self.gather = make_layer(), gather
        self.metric = torchmetrics.SumMetric(dist_sync_on_step=True)
        self.steps: list[dict[str, Any]] = []
        self.computed: float | None = None

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y, _ = batch
        self.log("x", float(10 * (self.global_rank + 1) + batch_idx), on_step=True, on_epoch=False, sync_dist=True)
        self.log("loss", loss_of(self.layer, x, y), sync_dist=True, batch_size=len(x))
        self.steps.append({"batch": batch_idx, "metric": float(self.metric(y.sum()))})
        if self.gather:
            self.all_gather(y)

    test_step = validation_step

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.steps.append({"batch": batch_idx, "metric": float(self.metric(batch[1].sum()))})
        return batch[2]

    def on_validation_batch_end(self, *args: Any) -> None:
        self.steps[-1]["x"] = float(self.trainer.logged_metrics["x"])

    on_test_batch_end = on_validation_batch_end

    def on_validation_epoch_end(self) -> None:
        self.computed = float(self.metric.compute())
        self.metric.reset()

    on_test_epoch_end = on_predict_epoch_end = on_validation_epoch_end


class Written(BasePredictionWriter):
    """A prediction writer that keeps, on each rank, the indices of every batch it is given to write."""

    def __init__(self) -> None:
        super().__init__("batch")
        self.indices: list[int] = []

    def write_on_batch_end(self, trainer: Any, pl_module: Any, prediction: Any, *args: Any) -> None:
        self.indices += prediction.tolist()


def evaluate(out: Path, name: str, strategy: Any, stages: tuple[str, ...]) -> None:
    """Run ``stages``, each under a new ``strategy()``, of an :class:`Evaluated` on ``EVAL``'s streams (test: one
    whose ``__len__`` is a wrong hint, 5 batches on both ranks; ``"refuse"``: validate with ``self.all_gather`` in
    each step) and record
    ``<name>_<stage>``: the steps, the epoch's loss and metric, the written indices, and the error (type, message,
    seconds) if the stage raised."""
    for stage in stages:
        model, writer, start = Evaluated(gather=stage == "refuse"), Written(), time.monotonic()
        loader = DataLoader((Hinted if stage == "test" else Stream)(EVAL, EVAL_SALT), batch_size=EVAL_BATCH)
        record: dict[str, Any] = {"error": None}
        try:
            getattr(trainer(out, strategy(), callbacks=[writer]), "validate" if stage.startswith("refuse") else stage)(
                model, loader, **({"return_predictions": False} if stage == "predict" else {"verbose": False})
            )
        except Exception as error:  # noqa: BLE001 - recorded for the test
            record["error"] = (type(error).__name__, str(error), time.monotonic() - start)
        metrics = model.trainer.callback_metrics
        save(
            out,
            f"{name}_{stage}",
            {
                **record,
                "steps": model.steps,
                "loss": float(metrics["loss"]) if "loss" in metrics else None,
                "computed": model.computed,
                "written": writer.indices,
            },
        )


class Observed(pl.Callback, logging.Handler):
    """While a fit runs: the messages of Lightning's rank-zero logger (the fit summary, the uneven-inputs line), and
    each ``torch.distributed.all_reduce`` called from a ``ddp_strategy`` module, as ``(step, module, async_op,
    world)`` (a round: ``boundaries.py:<what sent it>``): ``step`` the training steps ended before it (a step lasts
    from one step's end to the next's)."""

    def __init__(self) -> None:
        pl.Callback.__init__(self)
        logging.Handler.__init__(self, logging.INFO)
        self.messages: list[str] = []
        self.calls: list[tuple[int, str, bool, bool]] = []
        self.steps, self._all_reduce = 0, dist.all_reduce

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())

    def _counted(self, tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        group = kwargs.get("group", args[1] if len(args) > 1 else None)
        self._note(sys._getframe(1), bool(kwargs.get("async_op")), group is None)
        return self._all_reduce(tensor, *args, **kwargs)

    def _counted_by_group(self, group: Any, *args: Any, **kwargs: Any) -> Any:
        """A group's own ``allreduce`` (a round: asynchronous, with a timeout), not through torch.distributed's."""
        self._note(sys._getframe(2), True, group is dist.group.WORLD)  # (called by the lambda of __enter__)
        return self._allreduce(group, *args, **kwargs)  # (the class's entry, called with the group first)

    def _note(self, caller: Any, async_op: bool, world: bool) -> None:
        if f"{os.sep}ddp_strategy{os.sep}" in caller.f_code.co_filename:
            where = Path(caller.f_code.co_filename).name
            if caller.f_code.co_name == "send":  # a round: a step's (start), a barrier's, an epoch start's
                where += f":{caller.f_back.f_code.co_name}"
            self.calls.append((self.steps, where, async_op, world))

    def __enter__(self) -> Observed:
        rank_zero.log.addHandler(self)
        # the class's own entry (a method descriptor), put back as it was at the exit: the attribute read is a plain
        # function, which would not bind the group
        self._allreduce, dist.all_reduce = vars(dist.ProcessGroup)["allreduce"], self._counted
        dist.ProcessGroup.allreduce = lambda group, *args, **kwargs: self._counted_by_group(group, *args, **kwargs)
        return self

    def __exit__(self, *exc: Any) -> None:
        dist.all_reduce, dist.ProcessGroup.allreduce = self._all_reduce, self._allreduce
        rank_zero.log.removeHandler(self)

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.steps += 1


class Zero(Probed):
    """:class:`Probed` trained by ``ZeroRedundancyOptimizer`` (SGD with momentum, one parameter's state per rank)
    with a learning rate decayed by ``GAMMA`` after each step (``StepLR``, ``interval="step"``)."""

    def configure_optimizers(self) -> Any:
        zero = ZeroRedundancyOptimizer(self.parameters(), torch.optim.SGD, lr=LR, momentum=MOMENTUM)
        scheduler = torch.optim.lr_scheduler.StepLR(zero, step_size=1, gamma=GAMMA)
        return {"optimizer": zero, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def trainer(out: Path, strategy: Any = None, **kwargs: Any) -> pl.Trainer:
    """A quiet 2-process CPU trainer (externally launched) for ``EPOCHS`` epochs."""
    defaults: dict[str, Any] = dict(max_epochs=EPOCHS, num_sanity_val_steps=0, default_root_dir=str(out))
    strategy = strategy or MyDDPStrategy(start_method="popen", timeout=60)
    return quiet_trainer(2, strategy, **{**defaults, **kwargs})


def fit(out: Path, name: str, train: Any, val: Any = None, model: Probed | None = None, **kwargs: Any) -> None:
    """Fit and record ``name``: batches seen, step results, validation values, weights, global step, the counts
    per uneven epoch, what :class:`Observed` saw, and the error (type, message, seconds from the fit's start) if the
    fit raised."""
    model, observed = model or Probed(), Observed()
    kwargs["callbacks"] = [*kwargs.get("callbacks", []), observed]
    t = trainer(out, **kwargs)
    record: dict[str, Any] = {"error": None}
    start = time.monotonic()
    try:
        with observed, warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            t.fit(model, train, val)
    except Exception as error:  # noqa: BLE001 - recorded for the test
        record["error"] = (type(error).__name__, str(error), time.monotonic() - start)
    record["warnings"] = [str(w.message) for w in caught]
    save(
        out,
        name,
        {
            **record,
            "seen": model.seen,
            "results": model.results,
            "val": model.val,
            "weights": state_copy(model),
            "initial": state_copy(make_layer()),
            "steps": t.global_step,
            "epochs": dict(t.strategy._uneven.epochs) if isinstance(t.strategy, MyDDPStrategy) else None,
            "messages": observed.messages,
            "all_reduces": observed.calls,
            "metrics": {k: float(v) for k, v in t.callback_metrics.items()},
        },
    )


def every_step_checkpoint(folder: Path) -> ModelCheckpoint:
    return ModelCheckpoint(dirpath=str(folder), every_n_train_steps=1, save_top_k=-1, filename="{step}")


def strategy(**kwargs: Any) -> MyDDPStrategy:
    return MyDDPStrategy(start_method="popen", timeout=60, **kwargs)


# -------------------------------------------------------------------------------------------- scenarios
def scenario_join(out: Path) -> None:
    """The default policy: an IterableDataset (5 and 4 batches) with uneven validation, the shadowed collectives
    and a checkpoint each step (rank 0 has more); pre-sharded map-style data (4 and 3 batches) with uneven
    validation, and with the other gradient divisor; a checkpoint each step while rank 0 has fewer; each refused
    collective (an all_gather, a broadcast from the joined rank); what is refused at the epoch's start (torchmetrics'
    per-step sync, SyncBatchNorm, a ZeroRedundancyOptimizer with gradient clipping and a per-step scheduler) and
    the same under uneven_inputs="stop"; then
    the cases a probe found hanging: accumulate_grad_batches (refused, and one that trains), validation inside
    the epoch (val_check_interval), and an IterableDataset with limit_train_batches or a __len__ (both hints); an
    EMAWeightAveraging callback with gradient clipping (by norm) of a plain optimizer."""
    fit(
        out,
        "join_iterable",
        stream(ITERABLE, ITERABLE_BATCH),
        stream(VAL, VAL_BATCH, VAL_SALT),
        Probed(SHADOWED),
        callbacks=[every_step_checkpoint(out / "ckpt_more")],
        enable_checkpointing=True,
        enable_progress_bar=True,  # rank 0's bar syncs the epoch-level "x_epoch" alone at the epoch's end
    )
    fit(out, "join_map", own_shard(MAP, MAP_BATCH), own_shard(VAL, VAL_BATCH, VAL_SALT), use_distributed_sampler=False)
    fit(
        out,
        "join_map_val_steps",
        own_shard(MAP, MAP_BATCH),
        own_shard(VAL, VAL_BATCH, VAL_SALT),
        Probed(("val_step_log",)),
        use_distributed_sampler=False,
    )
    fit(
        out,
        "join_map_active",
        own_shard(MAP, MAP_BATCH),
        use_distributed_sampler=False,
        strategy=strategy(divide_by_initial_world_size=False),
    )
    fewer = tuple(reversed(ITERABLE))  # rank 0: 4 batches, rank 1: 5
    fit(
        out,
        "ckpt_fewer",
        stream(fewer, ITERABLE_BATCH),
        callbacks=[every_step_checkpoint(out / "ckpt_fewer")],
        enable_checkpointing=True,
    )
    fit(
        out,
        "ema",
        stream(ITERABLE, ITERABLE_BATCH),
        gradient_clip_val=CLIP,
        callbacks=[EMAWeightAveraging(decay=EMA_DECAY)],
    )
    fit(out, "refuse_all_gather", stream(ITERABLE, ITERABLE_BATCH), model=Probed(("all_gather",)))
    fit(out, "refuse_broadcast", stream(ITERABLE, ITERABLE_BATCH), model=Probed(("broadcast_from_1",)))
    fit(out, "refuse_reduce_op", stream(ITERABLE, ITERABLE_BATCH), model=Probed(("reduce_band",)))
    fit(out, "buffers", stream(BN_COUNTS, ITERABLE_BATCH), model=Normed(), max_epochs=1)
    uneven = dict(use_distributed_sampler=False)  # pre-sharded, known unequal counts (5 and 4 batches)
    fit(out, "refuse_metric", own_shard(ITERABLE, ITERABLE_BATCH), model=Probed(metric=True), **uneven)
    fit(
        out, "refuse_sync_batchnorm", own_shard(ITERABLE, ITERABLE_BATCH), model=Normed(), sync_batchnorm=True, **uneven
    )
    fit(out, "refuse_zero", own_shard(ITERABLE, ITERABLE_BATCH), model=Zero(), gradient_clip_val=CLIP, **uneven)
    for name, model, options in (  # what the refusals suggest, on the same data
        ("stop_syncs", Normed(metric=True), {"sync_batchnorm": True}),
        ("stop_zero", Zero(), {"gradient_clip_val": CLIP}),
    ):
        stop = strategy(uneven_inputs="stop")
        fit(out, name, own_shard(ITERABLE, ITERABLE_BATCH), model=model, strategy=stop, **options, **uneven)
    fit(out, "accumulate_3", stream(ITERABLE, ITERABLE_BATCH), accumulate_grad_batches=3)
    fit(out, "accumulate_map", own_shard(MAP, MAP_BATCH), use_distributed_sampler=False, accumulate_grad_batches=2)
    fit(out, "accumulate_2", stream(ITERABLE, ITERABLE_BATCH), accumulate_grad_batches=2)
    val = stream(VAL, VAL_BATCH, VAL_SALT)
    fit(out, "val_every_2", stream(ITERABLE, ITERABLE_BATCH), val, val_check_interval=2, check_val_every_n_epoch=None)
    fit(out, "val_every_2_per_epoch", stream(ITERABLE, ITERABLE_BATCH), val, val_check_interval=2)  # flags async
    fit(
        out,
        "val_half_map",
        own_shard(MAP, MAP_BATCH),
        own_shard(VAL, VAL_BATCH, VAL_SALT),
        use_distributed_sampler=False,
        val_check_interval=0.5,
    )
    fit(out, "limit_5", stream(ITERABLE, ITERABLE_BATCH), limit_train_batches=5)
    fit(out, "length_hint", DataLoader(Hinted(ITERABLE, TRAIN_SALT), batch_size=ITERABLE_BATCH))


def scenario_policies(out: Path) -> None:
    """uneven_inputs="stop" and "error" on both loader kinds, on a rank without any batch and on a data set whose
    ``__len__`` reads the rank; validation, test and predict on uneven streams; even inputs under MyDDPStrategy, a
    loader the strategy shards, then the even inputs under Lightning's ddp (last: its teardown keeps the process
    group); a ZeroRedundancyOptimizer on even inputs under both (ours: equal pre-sharded counts, and a stream under
    "stop")."""
    fit(out, "stop_iterable", stream(ITERABLE, ITERABLE_BATCH), strategy=strategy(uneven_inputs="stop"))
    fit(
        out,
        "stop_map",
        own_shard(MAP, MAP_BATCH),
        use_distributed_sampler=False,
        strategy=strategy(uneven_inputs="stop"),
    )
    fit(
        out,
        "error_map",
        own_shard(MAP, MAP_BATCH),
        use_distributed_sampler=False,
        strategy=strategy(uneven_inputs="error"),
    )
    fit(out, "error_iterable", stream(ITERABLE, ITERABLE_BATCH), strategy=strategy(uneven_inputs="error"))
    none = (ITERABLE[0], 0)  # rank 1 has no batch at all
    fit(out, "stop_none", stream(none, ITERABLE_BATCH), strategy=strategy(uneven_inputs="stop"))
    fit(out, "error_none", stream(none, ITERABLE_BATCH), strategy=strategy(uneven_inputs="error"))
    fit(
        out,
        "rank_sized",
        DataLoader(RankSized(MAP, TRAIN_SALT), batch_size=MAP_BATCH),
        use_distributed_sampler=False,
        strategy=strategy(uneven_inputs="error"),
    )
    evaluate(out, "eval", strategy, ("validate", "test", "predict", "refuse"))
    even, val = (ITERABLE[0], ITERABLE[0]), stream((VAL[0], VAL[0]), VAL_BATCH, VAL_SALT)
    fit(out, "even_ours", stream(even, ITERABLE_BATCH), val, Probed(("log",)))
    fit(out, "stop_even", stream(even, ITERABLE_BATCH), strategy=strategy(uneven_inputs="stop"))
    whole = DataLoader(TensorDataset(*samples(0, 20, TRAIN_SALT)), batch_size=2, shuffle=True)
    fit(out, "sharded", whole, max_epochs=1)
    known = dict(use_distributed_sampler=False)  # pre-sharded, equal known counts: nothing uneven, nothing refused
    fit(out, "zero_even_ours", own_shard(even, ITERABLE_BATCH), model=Zero(), gradient_clip_val=CLIP, **known)
    # an even stream: its counts unknown, "join" (the default) warns and trains as "ddp" does
    fit(out, "zero_even_join", stream(even, ITERABLE_BATCH), model=Zero(), gradient_clip_val=CLIP)
    fit(out, "even_ddp", stream(even, ITERABLE_BATCH), val, Probed(("log",)), strategy="ddp")
    fit(out, "zero_even_ddp", stream(even, ITERABLE_BATCH), model=Zero(), gradient_clip_val=CLIP, strategy="ddp")
    for name, ddp in (("ema_even_ours", None), ("ema_even_ddp", "ddp")):
        averaged = EMAWeightAveraging(decay=EMA_DECAY)
        fit(out, name, stream(even, ITERABLE_BATCH), gradient_clip_val=CLIP, callbacks=[averaged], strategy=ddp)


def scenario_direct_collective(out: Path) -> None:
    """A training step's own torch.distributed.all_reduce on 5 and 4 batches (rank 0 does not come back)."""
    fit(out, "direct", stream(ITERABLE, ITERABLE_BATCH), model=Probed(("torch_distributed",)))


def scenario_evaluation_ddp(out: Path) -> None:
    """:class:`Evaluated`'s validation on ``EVAL``'s streams under Lightning's ddp (a 10 s collective timeout)."""
    evaluate(out, "eval_ddp", lambda: DDPStrategy(timeout=timedelta(seconds=10)), ("validate",))


#: Lightning's CPU precisions besides the default "32-true" (``"16-mixed"`` falls back to ``"bf16-mixed"`` on CPU,
#: with a warning); :func:`scenario_precisions` fits each on 5 and 3 batches (streams of 10 and 6 samples).
PRECISIONS, PRECISION_COUNTS = ("64-true", "bf16-true", "16-true", "bf16-mixed", "16-mixed"), (10, 6)


def scenario_precisions(out: Path) -> None:
    """Each of :data:`PRECISIONS` under the default "join" on 5 and 3 batches, every shadowed collective in each
    step (a tail step's shadow of DDP's forward runs where the active rank's default dtype is its precision's); then
    "64-true" on even streams under MyDDPStrategy and Lightning's ddp (uneven ones hang there)."""
    for precision in PRECISIONS:
        fit(
            out,
            f"precision_{precision}",
            stream(PRECISION_COUNTS, ITERABLE_BATCH),
            model=Probed(SHADOWED),
            precision=precision,
            max_epochs=1,
        )
    even = (PRECISION_COUNTS[0],) * 2
    for name, ddp in (("precision_even_ours", None), ("precision_even_ddp", "ddp")):
        fit(
            out,
            name,
            stream(even, ITERABLE_BATCH),
            model=Probed(SHADOWED),
            precision="64-true",
            max_epochs=1,
            strategy=ddp,
        )
