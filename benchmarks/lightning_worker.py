"""The Lightning side of one benchmark run: built-in ``DDPStrategy`` or ``MyDDPStrategy``.

Imported by ``ddp_worker.py`` only for ``--impl lightning`` and ``--impl ours``.
Both use the popen launcher: this process is rank 0 and Lightning starts the
other ranks by re-running ``ddp_worker.py`` with the same arguments. Imports
only the shared ``bench_workloads.py`` / ``bench_recorder.py``, never
``ddp_worker.py`` or the hand-written worker. Imports ``ddp_strategy`` only
through its top-level names.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from bench_recorder import StepRecorder, register_counting_hook
from bench_workloads import (
    WORKLOADS,
    RankShard,
    RankStream,
    RunConfig,
    Workload,
    build_dataset,
    build_model,
    make_optimizer,
    short_batches,
)
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader


class BenchModule(L.LightningModule):
    """The workload's network, trained with cross-entropy; no ``self.log`` (the hand-written loop logs nothing)."""

    def __init__(self, w: Workload, seed: int) -> None:
        super().__init__()
        self.w = w
        torch.manual_seed(seed)  # same weights as the hand-written loop
        self.net = build_model(w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return make_optimizer(self.parameters(), self.w)


class BenchCallback(Callback):
    """Feeds a :class:`StepRecorder` from Lightning's batch hooks and registers the counting comm hook."""

    def __init__(self, recorder: StepRecorder, total_steps: int) -> None:
        self.recorder = recorder
        self.total_steps = total_steps

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # trainer.strategy.model is the DDP wrapper by now, and no backward has run yet.
        register_counting_hook(trainer.strategy.model, self.recorder.comm)
        self.recorder.mark("train_start")

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        # After launch and process-group init, before the DDP wrap.
        self.recorder.mark("process_group")

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self.recorder.step_start()

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.recorder.step_end(loss, last=len(self.recorder.ends) + 1 == self.total_steps)


def _make_strategy(cfg: RunConfig) -> Any:
    timeout = timedelta(seconds=cfg.pg_timeout_s)
    if cfg.impl == "lightning":
        from lightning.pytorch.strategies import DDPStrategy

        return DDPStrategy(timeout=timeout)  # what strategy="ddp" builds, plus a shorter timeout
    from ddp_strategy import MyDDPStrategy

    return MyDDPStrategy(timeout=timeout)


def run(cfg: RunConfig) -> None:
    """Train ``cfg.steps`` steps with Lightning; every rank writes ``rank<N>.json``."""
    w = WORKLOADS[cfg.workload]
    use_cuda = cfg.device == "cuda"
    recorder = StepRecorder(torch.device("cpu"))
    recorder.comm.install()
    L.seed_everything(cfg.seed, verbose=False)  # also seeds Lightning's DistributedSampler
    model = BenchModule(w, cfg.seed)
    data = build_dataset(w, cfg.seed)
    if cfg.data == "even":
        loader = DataLoader(data, batch_size=w.batch, shuffle=True)
    elif cfg.data == "map":
        loader = DataLoader(RankShard(data, cfg.world_size), batch_size=w.batch)
    else:
        short = short_batches(w, cfg.world_size)[1] if cfg.data == "uneven" else 0
        loader = DataLoader(RankStream(data, w.batch, short), batch_size=w.batch)
    trainer = L.Trainer(
        accelerator="gpu" if use_cuda else "cpu",
        devices=cfg.world_size,
        strategy=_make_strategy(cfg),
        max_steps=cfg.steps,
        max_epochs=-1,
        enable_progress_bar=False,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        use_distributed_sampler=cfg.data != "map",  # map: each rank reads its own shard, as the stream does
        callbacks=[BenchCallback(recorder, cfg.steps)],
    )
    recorder.mark("trainer")
    if use_cuda:
        recorder.device = trainer.strategy.root_device
    trainer.fit(model, train_dataloaders=loader)
    recorder.finish(
        trainer.global_rank,
        trainer.world_size,
        cfg.out_dir,
        {
            "impl": cfg.impl,
            "strategy": type(trainer.strategy).__qualname__,
            "epochs": trainer.current_epoch,
            "data": cfg.data,
        },
    )
