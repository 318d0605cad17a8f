"""The hand-written reference: the PyTorch DDP tutorial's loop, launched with ``mp.spawn``.

``ddp_worker.py`` calls :func:`run` for ``--impl handwritten``. Imports only
PyTorch and the shared ``bench_workloads.py`` / ``bench_recorder.py``, never
Lightning, so this loop's start-up and memory are those of plain PyTorch.

Environment read here (set by ``bench_ddp.py``):
    MASTER_ADDR, MASTER_PORT: the rendezvous address (127.0.0.1 and a free port).
"""

from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from bench_recorder import StepRecorder, register_counting_hook
from bench_workloads import WORKLOADS, RunConfig, build_dataset, build_model, make_optimizer
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler


def _handwritten_rank(rank: int, cfg: RunConfig) -> None:
    """One rank of the tutorial-style loop (PyTorch "Getting started with DDP").

    init_process_group -> DDP -> DistributedSampler + set_epoch -> plain loop.
    Must run on every rank; each writes ``rank<rank>.json``.
    """
    w = WORKLOADS[cfg.workload]
    use_cuda = cfg.device == "cuda"
    device = torch.device("cuda", rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    recorder = StepRecorder(device)
    recorder.comm.install()
    dist.init_process_group(
        "nccl" if use_cuda else "gloo",
        rank=rank,
        world_size=cfg.world_size,
        timeout=timedelta(seconds=cfg.pg_timeout_s),
    )
    recorder.mark("process_group")
    try:
        torch.manual_seed(cfg.seed)
        model = build_model(w).to(device)
        ddp_model = DistributedDataParallel(model, device_ids=[rank] if use_cuda else None)
        register_counting_hook(ddp_model, recorder.comm)
        dataset = build_dataset(w, cfg.seed)
        sampler = DistributedSampler(dataset, num_replicas=cfg.world_size, rank=rank, shuffle=True, seed=cfg.seed)
        loader = DataLoader(dataset, batch_size=w.batch, sampler=sampler)
        optimizer = make_optimizer(ddp_model.parameters(), w)
        ddp_model.train()
        recorder.mark("train_start")

        step, epoch = 0, 0
        while step < cfg.steps:
            sampler.set_epoch(epoch)
            for x, y in loader:
                recorder.step_start()
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                optimizer.zero_grad(set_to_none=True)
                loss = F.cross_entropy(ddp_model(x), y)
                loss.backward()
                optimizer.step()
                step += 1
                recorder.step_end(loss, last=step == cfg.steps)
                if step == cfg.steps:
                    break
            epoch += 1
        recorder.finish(rank, cfg.world_size, cfg.out_dir, {"impl": cfg.impl, "epochs": epoch})
    finally:
        dist.destroy_process_group()


def run(cfg: RunConfig) -> None:
    """Launch ``cfg.world_size`` ranks with ``mp.spawn``, as the PyTorch DDP tutorial does."""
    mp.spawn(_handwritten_rank, args=(cfg,), nprocs=cfg.world_size, join=True)
