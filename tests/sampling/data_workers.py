"""Workers for tests/sampling/test_data_compat.py: user data and settings that Lightning's ``ddp`` accepts.

Each scenario runs in 2 real gloo processes started by :func:`sampling_workers.launch` (externally launched,
several Trainer runs per launch) and records what every rank saw in ``out_dir/<name>.rank<R>.pt``.
"""

from __future__ import annotations

import os
import socket
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from ddp_testing import rank, save, state_copy
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.tuner import Tuner
from sampling_workers import SEED, Indexed, Recorder, trainer
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, Sampler, SequentialSampler, Subset
from torch.utils.data._utils.collate import default_collate

from ddp_strategy import DDPCheckpointIO, MyDDPStrategy, UnsafeCheckpointError
from ddp_strategy.process.failures import destroy_process_group
from ddp_strategy.sampling.loaders import ORDER_KEPT_WARNING

N = 24  # samples the user splits by rank: 12 each
BATCH = 4
N_ORDER, N_ORDER_VAL, ORDER_BATCH = 21, 22, 3  # the order fits: 11 training samples per rank (one padded)


def indices(batch: Any) -> list[int]:
    """The sample indices in a batch: ``(x, y, v, idx)`` from :class:`Indexed`, or a tensor row ``[idx, ...]``."""
    if isinstance(batch, torch.Tensor):
        return [int(batch[0])]
    return batch[3].tolist()


class Seen(pl.LightningModule):
    """A linear model whose loaders are given per stage; records the indices each stage's steps see."""

    def __init__(self, loaders: dict[str, Any] | None = None) -> None:
        super().__init__()
        torch.manual_seed(SEED)
        self.layer = nn.Linear(4, 2)
        self.loaders = loaders or {}
        self.seen: dict[str, list[list[int]]] = {"train": [], "val": [], "test": [], "predict": []}

    def train_dataloader(self) -> Any:
        return self.loaders["train"]()

    def val_dataloader(self) -> Any:
        return self.loaders["val"]() if "val" in self.loaders else []

    def test_dataloader(self) -> Any:
        return self.loaders["test"]()

    def predict_dataloader(self) -> Any:
        return self.loaders["predict"]()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.seen["train"].append(indices(batch))
        x, y = batch[0], batch[1]
        return F.cross_entropy(self.layer(x), y)

    def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self.seen["val"].append(indices(batch))

    def test_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self.seen["test"].append(indices(batch))

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Any:
        self.seen["predict"].append(indices(batch))
        return torch.tensor(indices(batch))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Dropped(Seen):
    """:class:`Seen` with dropout on the inputs: its masks come from each rank's global torch generator, so the
    weights also depend on every random number the strategy or Lightning's loops draw before and between steps."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.seen["train"].append(indices(batch))
        return F.cross_entropy(self.layer(F.dropout(batch[0], 0.5)), batch[1])


def order_fit(out: Path, name: str, strategy: Any, shuffle: bool) -> None:
    """What a user runs under either strategy: seed_everything, then a 2-epoch fit of :class:`Dropped` on
    ``N_ORDER`` samples in batches of 3 (``shuffle`` as given) with validation and Lightning's 2 sanity steps;
    records the indices per step, the step count, the weights and our training-order warnings."""
    pl.seed_everything(SEED)
    model = Dropped(
        {
            "train": lambda: DataLoader(Indexed(N_ORDER, 0), batch_size=ORDER_BATCH, shuffle=shuffle),
            "val": lambda: DataLoader(Indexed(N_ORDER_VAL, 1), batch_size=4),
        }
    )
    initial = state_copy(model)
    t = trainer(2, out, strategy=strategy, max_epochs=2, num_sanity_val_steps=2)
    caught = record_warnings(lambda: t.fit(model))
    save(
        out,
        name,
        {
            **model.seen,
            "steps": t.global_step,
            "initial": initial,
            "weights": state_copy(model),
            "warnings": [w for w in caught if ORDER_KEPT_WARNING in w],
        },
    )


def flat(batches: list[list[int]]) -> list[int]:
    return [i for b in batches for i in b]


# ------------------------------------------------------------------------ custom loaders and batch samplers
class TaggedLoader(DataLoader):
    """A DataLoader subclass with an ``__init__`` argument of its own."""

    def __init__(self, dataset: Any, tag: str, **kwargs: Any) -> None:
        super().__init__(dataset, **kwargs)
        self.tag = tag


class Buckets(Sampler):
    """A custom batch sampler (not a ``BatchSampler``) with its own arguments: consecutive chunks of ``sizes``."""

    def __init__(self, n: int, sizes: tuple[int, ...]) -> None:
        self.batches: list[list[int]] = []
        start, k = 0, 0
        while start < n:
            size = sizes[k % len(sizes)]
            self.batches.append(list(range(start, min(start + size, n))))
            start, k = start + size, k + 1

    def __iter__(self) -> Any:
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


class Reversed(BatchSampler):
    """A ``BatchSampler`` subclass with an extra required argument: its batches in reverse order."""

    def __init__(self, sampler: Any, batch_size: int, drop_last: bool, reverse: bool) -> None:
        super().__init__(sampler, batch_size, drop_last)
        self.reverse = reverse

    def __iter__(self) -> Any:
        batches = list(super().__iter__())
        return iter(batches[::-1] if self.reverse else batches)


N_BUCKETS, N_REVERSED = 20, 18


class Batches:
    """A custom iterable of ready batches (no ``DataLoader``), as Lightning accepts."""

    def __init__(self, n: int, size: int) -> None:
        data = Indexed(n, 3)
        self.batches = [default_collate([data[i] for i in range(s, min(s + size, n))]) for s in range(0, n, size)]

    def __iter__(self) -> Any:
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


class SplitByRank(IterableDataset):
    """A stream that splits itself by rank in ``__iter__``, reading ``torch.distributed`` as litdata's
    ``StreamingDataset``, WebDataset's ``split_by_node`` and Hugging Face's ``split_dataset_by_node`` do: rank r
    reads samples r, r + W, ... of ``N``."""

    def __iter__(self) -> Any:
        data = Indexed(N, 4)
        return (data[i] for i in range(torch.distributed.get_rank(), N, torch.distributed.get_world_size()))


def own_half(salt: int, shuffle: bool = False, n: int = N) -> Any:
    """A loader over this rank's own half of ``n`` samples: rank r holds r, r + 2, ... (the user split it)."""
    return lambda: DataLoader(Subset(Indexed(n, salt), range(rank(), n, 2)), batch_size=BATCH, shuffle=shuffle)


def _can_bind(port: int) -> bool:
    """Whether a new listener could bind ``port`` now, as rank 0's ``TCPStore`` does (SO_REUSEADDR)."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def record_warnings(run: Any) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run()
    return [str(w.message) for w in caught]


# -------------------------------------------------------------------------------------------- scenarios
def scenario_data(out: Path) -> None:
    """use_distributed_sampler=False in every stage; uneven user shards and their fixes; any iterable; DataLoader
    subclasses with custom batch samplers; fast_dev_run leaves default_root_dir untouched; the training order with
    and without shuffle; Lightning's ddp on the iterables and on the training-order fits."""
    pl.seed_everything(SEED)
    # 1. The user split the data by rank: every stage must see exactly this rank's half.
    model = Seen({"train": own_half(0, shuffle=True), "val": own_half(1), "test": own_half(2), "predict": own_half(3)})
    t = trainer(2, out, max_epochs=1, use_distributed_sampler=False)
    t.fit(model)
    # User code after fit may use torch.distributed, as under Lightning's ddp (the group outlives the run).
    after_fit = torch.tensor([t.global_rank + 1.0])
    torch.distributed.all_reduce(after_fit)
    user_code = {
        "rank": torch.distributed.get_rank(),
        "world": torch.distributed.get_world_size(),
        "sum": after_fit.item(),
    }
    t.test(model)
    predictions = t.predict(model)
    torch.distributed.barrier()  # the group of the last run is there too
    save(
        out,
        "user_split",
        {
            **model.seen,
            "predictions": [p.tolist() for p in predictions],
            "after_fit": user_code,
            "trainer_rank": t.global_rank,
        },
    )

    # Uneven user shards (12 and 8 samples: 3 and 2 batches): trained by default (uneven_inputs="join"); under
    # uneven_inputs="error" a clear error on every rank, not a hang; then each fix it suggests.
    def uneven_shards() -> DataLoader:
        return DataLoader(Subset(Indexed(N, 0), range(rank(), N - 8 * rank(), 2)), batch_size=BATCH)

    joined = Seen({"train": uneven_shards})
    trainer(2, out, max_epochs=1, use_distributed_sampler=False).fit(joined)
    uneven = Seen({"train": uneven_shards})
    record: dict[str, Any] = {"error": None, "joined": joined.seen["train"]}
    try:
        trainer(
            2,
            out,
            max_epochs=1,
            use_distributed_sampler=False,
            strategy=MyDDPStrategy(start_method="popen", timeout=60, uneven_inputs="error"),
        ).fit(uneven)
    except ValueError as error:
        record.update(error=str(error), steps=len(uneven.seen["train"]))
    # Fix 1: let the strategy shard the whole data set (use_distributed_sampler=True, the default).
    whole = Seen({"train": lambda: DataLoader(Indexed(N - 4, 0), batch_size=BATCH)})
    trainer(2, out, max_epochs=1).fit(whole)
    record["sharded"] = whole.seen["train"]
    # Fix 2: the user's own shards, made to hold the same number of batches.
    equal = Seen({"train": own_half(0)})
    trainer(2, out, max_epochs=1, use_distributed_sampler=False).fit(equal)
    record["equal"] = equal.seen["train"]
    save(out, "uneven", record)

    # 2. Any iterable: a list of rows (Lightning flattens the list and iterates each tensor) and ready batches.
    rows = torch.arange(6, dtype=torch.float32).unsqueeze(1).repeat(1, 5)
    iterable_model = Seen()
    t = trainer(2, out)
    caught = record_warnings(lambda: t.test(iterable_model, [rows]))
    caught += record_warnings(lambda: t.test(iterable_model, Batches(9, 4)))
    caught += record_warnings(lambda: trainer(2, out, max_epochs=1).fit(iterable_model, Batches(9, 4)))
    save(
        out,
        "iterables",
        {
            "test": iterable_model.seen["test"],
            "train": iterable_model.seen["train"],
            "weights": state_copy(iterable_model),
            "warnings": [w for w in caught if "MyDDPStrategy got a" in w],
        },
    )

    # A stream that splits itself by rank: each rank trains its own half; the warning must not say otherwise.
    split = Seen({"train": lambda: DataLoader(SplitByRank(), batch_size=BATCH)})
    caught = record_warnings(lambda: trainer(2, out, max_epochs=1).fit(split))
    save(out, "split_by_rank", {"train": split.seen["train"], "warnings": [w for w in caught if "Iterable" in w]})

    # 3. DataLoader subclasses with custom batch samplers, built in the hooks (Lightning captures the arguments)
    # for training, passed ready-made for validation (Lightning reads the attributes).
    val_loader = TaggedLoader(
        Indexed(N_REVERSED, 1),
        tag="val",
        batch_sampler=Reversed(SequentialSampler(range(N_REVERSED)), 4, False, reverse=True),
    )
    subclass_model = Seen(
        {"train": lambda: TaggedLoader(Indexed(N_BUCKETS, 0), tag="train", batch_sampler=Buckets(N_BUCKETS, (2, 3)))}
    )
    t = trainer(2, out, max_epochs=1)
    t.fit(subclass_model, val_dataloaders=val_loader)
    save(
        out,
        "subclass",
        {
            **subclass_model.seen,
            "loaders": [(type(dl).__name__, dl.tag) for dl in (t.train_dataloader, t.val_dataloaders)],
        },
    )

    # 5. A fit with nothing to save leaves default_root_dir as it found it.
    root = out / "fast_dev_run"
    root.mkdir(exist_ok=True)
    trainer(2, root, fast_dev_run=True, enable_checkpointing=True).fit(Seen({"train": own_half(0)}))
    save(out, "fast_dev_run", {"left": sorted(os.listdir(root))})

    # 6. Training order: shuffle=True is Lightning's training to the bit; shuffle=False keeps its order (a warning).
    order_fit(out, "order_shuffled", MyDDPStrategy(start_method="popen", timeout=60), shuffle=True)
    order_fit(out, "order_kept", MyDDPStrategy(start_method="popen", timeout=60), shuffle=False)

    # Reference: Lightning's own ddp on the same iterables (last: its teardown keeps the process group).
    reference = Seen()
    t = trainer(2, out, strategy="ddp")
    t.test(reference, [rows])
    t.test(reference, Batches(9, 4))
    save(out, "iterables_lightning", {"test": reference.seen["test"]})
    split = Seen({"train": lambda: DataLoader(SplitByRank(), batch_size=BATCH)})
    trainer(2, out, strategy="ddp", max_epochs=1).fit(split)
    save(out, "split_by_rank_lightning", {"train": split.seen["train"]})
    order_fit(out, "order_shuffled_lightning", "ddp", shuffle=True)
    order_fit(out, "order_kept_lightning", "ddp", shuffle=False)


class Lossy(pl.LightningModule):
    """A regression model whose hyper-parameters hold an ``nn.MSELoss`` (so ``weights_only=True`` refuses them)."""

    def __init__(self, loss_fn: nn.Module = nn.MSELoss(), lr: float = 0.01) -> None:  # noqa: B008 - the point
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(SEED)
        self.layer = nn.Linear(4, 1)
        self.loss_fn, self.lr = loss_fn, lr

    def train_dataloader(self) -> Any:
        return DataLoader(Indexed(200, 0), batch_size=4, shuffle=True)  # 25 steps per epoch on 2 ranks

    def test_dataloader(self) -> Any:
        return DataLoader(Indexed(10, 2), batch_size=4)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, _, v, _ = batch
        return self.loss_fn(self.layer(x).squeeze(1), v)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        x, _, v, _ = batch
        self.log("test_loss", self.loss_fn(self.layer(x).squeeze(1), v), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def scenario_models(out: Path) -> None:
    """A torch.compile'd model; Tuner.lr_find and ckpt_path="best" on our own checkpoints holding an nn.MSELoss;
    each suggestion of the UnsafeCheckpointError for a foreign checkpoint, tried where it is raised."""
    pl.seed_everything(SEED)
    # 4. A compiled whole model fits (backend "eager": dynamo traces, no inductor code generation) like the plain one.
    torch._dynamo.reset()
    plain, compiled = Recorder(val=False), Recorder(val=False)
    trainer(2, out, max_epochs=1).fit(plain)
    torch._dynamo.utils.counters.clear()
    trainer(2, out, max_epochs=1).fit(torch.compile(compiled, backend="eager"))
    kept = torch.distributed.is_initialized()  # for the user's code after fit, as under Lightning's ddp
    destroy_process_group()  # the group a successful fit leaves, with a compiled DDP wrapper in a reference cycle
    port_free = _can_bind(int(os.environ["MASTER_PORT"])) if rank() == 0 else True
    save(
        out,
        "compile",
        {
            "kept": kept,
            "port_free": port_free,
            "plain": state_copy(plain),
            "compiled": state_copy(compiled),
            "initial": state_copy(Recorder(val=False)),
            "train": compiled.rec["train"],
            "frames": sum(torch._dynamo.utils.counters["frames"].values()),
            "compiler_ctx": compiled._compiler_ctx is not None,
        },
    )

    # 7a. The LR finder's internal restore of its own temporary checkpoint (it holds the nn.MSELoss).
    model = Lossy()
    before = state_copy(model)
    t = trainer(2, out, max_epochs=1)
    finder = Tuner(t).lr_find(model, min_lr=1e-4, max_lr=1e-1, num_training=20, early_stop_threshold=None)
    save(
        out,
        "lr_find",
        {
            "before": before,
            "after": state_copy(model),
            "lrs": len(finder.results["lr"]),
            "suggestion": finder.suggestion(),
            "lr": model.lr,
            "left": sorted(p.name for p in out.iterdir() if p.name.startswith(".lr_find")),
        },
    )

    # 7b. ckpt_path="best" after a fit: our own checkpoint, restored; then the same file in a new run is foreign.
    ckpt_dir = out / "lossy_ckpt"
    model = Lossy()
    t = trainer(
        2,
        out,
        max_steps=2,
        enable_checkpointing=True,
        callbacks=[ModelCheckpoint(dirpath=str(ckpt_dir), filename="last")],
    )
    t.fit(model)
    best = t.test(model, ckpt_path="best")[0]["test_loss"]
    ckpt = str(ckpt_dir / "last.ckpt")
    record: dict[str, Any] = {"best_test_loss": best}
    try:
        trainer(2, out, max_steps=3).fit(Lossy(), ckpt_path=ckpt)
        record["error"] = None
    except UnsafeCheckpointError as error:
        record["error"] = str(error)
    # Each suggestion of the message, where it was raised: Trainer.fit(..., weights_only=False), ...
    resumed = trainer(2, out, max_steps=3)
    resumed.fit(Lossy(), ckpt_path=ckpt, weights_only=False)
    record["weights_only_false_step"] = resumed.global_step
    # ... MyDDPStrategy(checkpoint_io=DDPCheckpointIO(weights_only=False)) ...
    resumed = trainer(
        2, out, max_steps=3, strategy=MyDDPStrategy(timeout=60, checkpoint_io=DDPCheckpointIO(weights_only=False))
    )
    resumed.fit(Lossy(), ckpt_path=ckpt)
    record["checkpoint_io_step"] = resumed.global_step
    # ... and torch.serialization.add_safe_globals([<the named type>]) (last: it changes this process for good).
    torch.serialization.add_safe_globals([torch.nn.modules.loss.MSELoss])
    resumed = trainer(2, out, max_steps=3)
    resumed.fit(Lossy(), ckpt_path=ckpt)
    record["safe_globals_step"] = resumed.global_step
    save(out, "unsafe", record)
