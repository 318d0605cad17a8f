"""Small, real CPU demonstrations of synchronous data parallelism for ``notebooks/ddp_reference.ipynb``, on the
strategy's own sampler, with ranks started by the package's testing kit; nothing here is used by the strategy."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from functools import partial
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import Dataset, DistributedSampler

from ddp_strategy._compat import torch_private as _torch_private
from ddp_strategy.diagnostics import CommStats
from ddp_strategy.reference.data import load_digits_tensors
from ddp_strategy.reference.model import DigitsNet
from ddp_strategy.sampling import EpochSeededDistributedSampler
from ddp_strategy.testing import run_on_ranks


def epoch_shards(
    dataset_size: int, world_size: int = 2, epochs: int = 2, seed: int = 0, shuffle: bool = True
) -> list[list[list[int]]]:
    """The training indices each rank draws in each epoch, exactly as ``MyDDPStrategy`` shards them (its sampler).

    Args:
        dataset_size: N samples; world_size: W ranks; epochs: how many epochs (0, 1, ...).
        seed: the shuffle seed shared by all ranks; shuffle: as the training loader's ``shuffle``.

    Returns:
        ``shards[epoch][rank]``: the list of ``ceil(N / W)`` indices rank ``rank`` draws in ``epoch``.

    Example:
        >>> epoch_shards(5, 2, epochs=1, shuffle=False)
        [[[0, 2, 4], [1, 3, 0]]]
    """
    return [
        [
            list(
                EpochSeededDistributedSampler(
                    cast(Dataset[int], range(dataset_size)),  # sized: all a sampler reads
                    num_replicas=world_size,
                    rank=rank,
                    shuffle=shuffle,
                    seed=seed,
                    epoch_fn=partial(int, epoch),
                )
            )
            for rank in range(world_size)
        ]
        for epoch in range(epochs)
    ]


def forgotten_set_epoch(dataset_size: int, epochs: int = 3, seed: int = 0) -> dict[str, list[list[int]]]:
    """Rank 0's order per epoch: a plain ``DistributedSampler`` never told the epoch, versus the strategy's.

    Args:
        dataset_size: N samples; epochs: epochs to draw; seed: shuffle seed.

    Returns:
        ``{"DistributedSampler without set_epoch": orders, "EpochSeededDistributedSampler": orders}``, where
        ``orders[epoch]`` is rank 0's index list (world size 2). The first repeats the same list every epoch.
    """
    plain: DistributedSampler[int] = DistributedSampler(
        cast(Dataset[int], range(dataset_size)), num_replicas=2, rank=0, shuffle=True, seed=seed
    )
    return {
        "DistributedSampler without set_epoch": [list(plain) for _ in range(epochs)],
        "EpochSeededDistributedSampler": [shards[0] for shards in epoch_shards(dataset_size, 2, epochs, seed)],
    }


@dataclass
class AllReduceDemo:
    """What each rank of :func:`allreduce_demo` recorded; lists are indexed by rank.

    Attributes:
        batches: the indices (into all 1,797 digits) of each rank's batch (B each).
        initial: the weights every rank started from (rank 0's, broadcast).
        local_grads: each rank's gradients after its own backward, before any communication.
        averaged_grads: the same after ``all_reduce(SUM) / W`` of every gradient tensor.
        ddp_grads: the gradients ``DistributedDataParallel`` produced for the same batches.
        weights_after_step: the weights after one SGD step with the averaged gradients.
        ddp_state_dict: rank 0's ``DistributedDataParallel.state_dict()``; its keys start with ``module.``.
        comm_stats: DDP's own timings of a few more steps, averaged over ranks, or None if it timed none.
    """

    batches: list[list[int]]
    initial: dict[str, torch.Tensor]
    local_grads: list[dict[str, torch.Tensor]]
    averaged_grads: list[dict[str, torch.Tensor]]
    ddp_grads: list[dict[str, torch.Tensor]]
    weights_after_step: list[dict[str, torch.Tensor]]
    ddp_state_dict: dict[str, torch.Tensor]
    comm_stats: CommStats | None


def _grads(net: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.detach().clone() for name, p in net.named_parameters() if p.grad is not None}


def _demo_steps(rank: int, world_size: int, batch_size: int, lr: float) -> dict[str, Any]:
    """One rank of :func:`allreduce_demo`, in the testing kit's gloo group; its DDP wrapper is freed when it returns,
    before the kit destroys the group (destroying the group under a live gloo DDP wrapper was seen to hang a rank)."""
    torch.set_num_threads(1)
    x, y = load_digits_tensors()
    torch.manual_seed(rank)  # different initial weights per rank on purpose: the broadcast fixes that
    net = DigitsNet(hidden_size=32)
    for p in net.parameters():  # what DDP does when it wraps the module: rank 0's weights everywhere
        dist.broadcast(p.data, src=0)
    initial = {k: v.clone() for k, v in net.state_dict().items()}
    ddp = DistributedDataParallel(copy.deepcopy(net))
    shard = epoch_shards(len(y), world_size, epochs=1, seed=0)[0][rank]
    batch = shard[:batch_size]
    F.cross_entropy(net(x[batch]), y[batch]).backward()
    local = _grads(net)
    for p in net.parameters():  # the all-reduce: sum over ranks, then divide by W (a mean)
        dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
        cast(torch.Tensor, p.grad).div_(world_size)  # in place, as /= (every parameter has a gradient)
    averaged = _grads(net)
    torch.optim.SGD(net.parameters(), lr=lr).step()  # one plain SGD step: w -= lr * grad

    F.cross_entropy(ddp(x[batch]), y[batch]).backward()
    ddp_grads = _grads(ddp.module)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=lr)
    for step in range(11):  # DDP times iterations 1-10 itself
        idx = shard[(step % 10) * batch_size : (step % 10 + 1) * batch_size]
        optimizer.zero_grad()
        F.cross_entropy(ddp(x[idx]), y[idx]).backward()
        optimizer.step()
    return {
        "batches": batch,
        "initial": initial,
        "local_grads": local,
        "averaged_grads": averaged,
        "weights_after_step": {k: v.clone() for k, v in net.state_dict().items()},
        "ddp_grads": ddp_grads,
        "ddp_state_dict": {k: v.clone() for k, v in ddp.state_dict().items()},
        "comm_stats": CommStats.from_ddp_logging_data(_torch_private.ddp_logging_data(ddp)),
    }


def allreduce_demo(world_size: int = 2, batch_size: int = 16, lr: float = 0.1) -> AllReduceDemo:
    """Run forward, backward, gradient all-reduce and one SGD step on ``world_size`` real CPU processes.

    Every rank starts from rank 0's weights (a :class:`~ddp_strategy.reference.model.DigitsNet` with 32 hidden units),
    takes the first ``batch_size`` indices of its epoch-0 shard of the digits, computes its local gradients, averages
    them with ``torch.distributed.all_reduce`` and steps; then repeats the backward through ``DistributedDataParallel``
    (the same averaged gradients) and times 11 more DDP steps with DDP's own timers (it times iterations 1-10).
    A few seconds.

    Args:
        world_size: W processes, started by the testing kit (:func:`ddp_strategy.testing.run_on_ranks`: gloo,
            127.0.0.1, a free port, ``"forkserver"``, which forks each rank from a fresh parent, safe from a Jupyter
            kernel, whose I/O threads may hold a lock when it forks).
        batch_size: B, samples per rank; lr: SGD learning rate.

    Returns:
        What every rank recorded.

    Raises:
        ddp_strategy.testing.RankError: a rank failed (its traceback is in the message), or the ranks did not
            finish within 120 s.
    """
    records = run_on_ranks(_demo_steps, world_size, args=(batch_size, lr), timeout_s=120)
    timed = [r["comm_stats"].as_tensor() for r in records if r["comm_stats"] is not None]
    per_rank = ("batches", "local_grads", "averaged_grads", "ddp_grads", "weights_after_step")
    return AllReduceDemo(
        **{key: [r[key] for r in records] for key in per_rank},
        initial=records[0]["initial"],
        ddp_state_dict=records[0]["ddp_state_dict"],
        comm_stats=CommStats(*torch.stack(timed).mean(dim=0).tolist()) if timed else None,
    )
