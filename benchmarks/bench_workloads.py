"""What every implementation trains, identically: the workloads, their model, data and optimizer, and a run's settings.

Shared by both workers (``handwritten_worker.py``, ``lightning_worker.py``), by the
entry point ``ddp_worker.py`` and by the driver ``bench_ddp.py``. Imports only
PyTorch, never a worker or Lightning, so the hand-written loop stays Lightning-free
and no benchmark module imports another in a cycle.
"""

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import Dataset, IterableDataset, TensorDataset

#: Implementation names, in table order: the PyTorch tutorial loop, Lightning's ``ddp``, ``MyDDPStrategy``.
IMPLS = ("handwritten", "lightning", "ours")
#: Training data of the Lightning runs (``bench_uneven.py``): a shuffled ``DataLoader`` the strategy shards
#: (``even``), a map-style :class:`RankShard` of the stream's batches (``map``, ``use_distributed_sampler=False``),
#: or a :class:`RankStream` with equal (``iterable``) or uneven (``uneven``) batch counts per rank.
DATA = ("even", "map", "iterable", "uneven")


@dataclass(frozen=True)
class Workload:
    """One model + data set + optimizer configuration, identical for every implementation.

    Attributes:
        name: short name used on the command line and in the table.
        kind: ``"mlp"`` (input (B, features)) or ``"cnn"`` (input (B, 3, image, image)).
        features: MLP input width, or CNN image side in pixels.
        hidden: MLP hidden width, or CNN channel count of the widest layer.
        classes: number of target classes.
        batch: per-device batch size B, samples.
        samples: data set size, samples (a multiple of 2 * batch so every rank
            gets only full batches at world size 1 and 2).
        steps: default number of timed-plus-warm-up optimizer steps.
        lr: SGD learning rate (momentum 0.9).
    """

    name: str
    kind: str
    features: int
    hidden: int
    classes: int
    batch: int
    samples: int
    steps: int
    lr: float = 0.01


WORKLOADS: dict[str, Workload] = {
    # ~51k parameters (~201 KiB of fp32 gradients): a step is a few milliseconds,
    # so framework overhead and the all-reduce latency dominate.
    "small": Workload("small", "mlp", features=64, hidden=192, classes=10, batch=32, samples=2048, steps=300),
    # small CNN on 32x32 images, ~57k parameters (~222 KiB) but tens of times the compute per step.
    "heavy": Workload("heavy", "cnn", features=32, hidden=64, classes=10, batch=32, samples=1024, steps=30),
    # For one GPU (benchmarks/gpu_check.py): the heavy CNN 8 times wider, ~3.5M parameters (~13.5 MiB of fp32
    # gradients, 2 buckets), ~11 GFLOP per sample forward and backward: a step of several milliseconds on an H100
    # (not yet measured), so per-step framework overhead is a few percent of it. Far too slow for a CPU.
    "gpu": Workload("gpu", "cnn", features=32, hidden=512, classes=10, batch=32, samples=4096, steps=300),
}


def build_model(w: Workload) -> nn.Module:
    """Build the workload's network; call after ``torch.manual_seed`` for identical weights."""
    if w.kind == "mlp":
        return nn.Sequential(
            nn.Linear(w.features, w.hidden),
            nn.ReLU(),
            nn.Linear(w.hidden, w.hidden),
            nn.ReLU(),
            nn.Linear(w.hidden, w.classes),
        )
    if w.kind == "cnn":
        c = w.hidden
        return nn.Sequential(
            nn.Conv2d(3, c // 2, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(c // 2, c, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(c, c, 3, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(c, w.classes),
        )
    raise ValueError(f"unknown workload kind {w.kind!r}; expected 'mlp' or 'cnn'")


def build_dataset(w: Workload, seed: int) -> TensorDataset:
    """Synthetic data from a fixed seed: inputs float32 (N, ...) on CPU, int64 labels (N,)."""
    g = torch.Generator().manual_seed(seed)
    if w.kind == "mlp":
        x = torch.randn(w.samples, w.features, generator=g)
    else:
        x = torch.randn(w.samples, 3, w.features, w.features, generator=g)
    y = torch.randint(0, w.classes, (w.samples,), generator=g)
    return TensorDataset(x, y)


class RankStream(IterableDataset):
    """An ``IterableDataset`` without ``__len__`` that streams rank r's shard ``data[r::W]`` (read at iteration
    time), so the strategy cannot know the ranks' batch counts. ``short_batches`` whole batches of ``batch``
    samples are left off the last rank's shard (uneven inputs)."""

    def __init__(self, data: TensorDataset, batch: int, short_batches: int = 0) -> None:
        self.data, self.batch, self.short_batches = data, batch, short_batches

    def __iter__(self) -> Any:
        rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        indices = list(range(rank, len(self.data), world))
        if rank == world - 1 and self.short_batches:
            indices = indices[: len(indices) - self.short_batches * self.batch]
        return (self.data[i] for i in indices)


class RankShard(Dataset):
    """Map-style: rank r's shard ``data[r::W]`` in order (rank read when indexed), the same batches as an even
    :class:`RankStream`, with a ``__len__`` (equal counts, known)."""

    def __init__(self, data: TensorDataset, world_size: int) -> None:
        self.data, self.world_size = data, world_size

    def __len__(self) -> int:
        return len(self.data) // self.world_size

    def __getitem__(self, i: int) -> Any:
        return self.data[(dist.get_rank() if dist.is_initialized() else 0) + i * self.world_size]


def short_batches(w: Workload, world_size: int) -> tuple[int, int]:
    """``(batches per rank, batches the last rank's stream leaves off)`` for ``--data uneven``: 5%, at least 1."""
    per_rank = w.samples // (world_size * w.batch)
    return per_rank, max(1, round(0.05 * per_rank))


def make_optimizer(params: Any, w: Workload) -> torch.optim.Optimizer:
    """SGD with momentum 0.9, the same for every implementation."""
    return torch.optim.SGD(params, lr=w.lr, momentum=0.9)


@dataclass(frozen=True)
class RunConfig:
    """Everything a rank needs; plain data so it pickles for ``mp.spawn``."""

    impl: str
    workload: str
    world_size: int
    steps: int
    seed: int
    device: str  # "cpu" or "cuda"
    out_dir: str
    pg_timeout_s: float
    data: str = "even"  # one of DATA (Lightning workers only)
