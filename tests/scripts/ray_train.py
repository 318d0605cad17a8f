"""Ray Train's documented Lightning recipe (docs.ray.io, "Train a PyTorch Lightning model") on a local 2-worker
Ray cluster (CPU), run as a user runs it: ``python ray_train.py OUT_DIR``.

The same ``train_func`` runs under ``MyDDPStrategy()`` (without Ray's ``prepare_trainer``, which accepts only Ray's
strategy classes: what it says is recorded) and under Ray's ``RayDDPStrategy()`` (with ``prepare_trainer``, as Ray's
docs write it), then under each with rank 1 raising in its third training step. Each worker records what it saw in
``OUT_DIR/<run>/rank<R>.pt``; the driver records what ``TorchTrainer.fit`` returned (the checkpoint
``RayTrainReportCallback`` reported, the metrics, or the error) in ``OUT_DIR/<run>.result.pt``.
"""

import sys
import time
from pathlib import Path

import lightning.pytorch as pl
import ray
import ray.cloudpickle
import torch
from ray.train import RunConfig, ScalingConfig
from ray.train.lightning import RayDDPStrategy, RayLightningEnvironment, RayTrainReportCallback, prepare_trainer
from ray.train.torch import TorchTrainer
from torch.utils.data import TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import ddp_testing  # noqa: E402
from ddp_testing import IndexedDigits, RecordingClassifier  # noqa: E402

from ddp_strategy import MyDDPStrategy  # noqa: E402

ray.cloudpickle.register_pickle_by_value(ddp_testing)  # Ray's workers do not have tests/ on their path


class IndexedValDigits(IndexedDigits):
    """IndexedDigits whose validation samples carry their index too: (x, y, idx)."""

    def setup(self, stage=None):
        super().setup(stage)
        x, y = self.val_set.tensors
        self.val_set = TensorDataset(x, y, torch.arange(len(y)))


class RayRecorder(RecordingClassifier):
    """Records the validation indices each rank evaluated; with ``fail``, rank 1 raises in its third step."""

    def __init__(self, out_dir, fail=False):
        super().__init__(out_dir)
        self.fail, self.val_seen = fail, []

    def training_step(self, batch, batch_idx):
        if self.fail and self.global_rank == 1 and batch_idx == 2:
            torch.save(time.time(), Path(self.out_dir) / "raised_at.pt")
            raise ZeroDivisionError("rank 1 fails on purpose")
        return super().training_step(batch, batch_idx)

    def on_validation_epoch_start(self):
        self.val_seen = []  # the last validation's only

    def validation_step(self, batch, batch_idx):
        x, y, idx = batch
        self.val_seen.extend(idx.tolist())
        return super().validation_step((x, y), batch_idx)

    def on_train_end(self):
        self.record["val_seen"] = self.val_seen
        self.record["strategy"] = type(self.trainer.strategy).__name__
        self.record["sampler_kwargs"] = self.trainer.strategy.distributed_sampler_kwargs
        super().on_train_end()


class ErrorRecorder(pl.Callback):
    """Records this rank's error, and when, in OUT/<run>/error.rank<R>.pt (Lightning calls it before the strategy's
    on_exception, which names a failed peer in the log: Ray may stop this worker at any moment after that)."""

    def __init__(self, out):
        self.out = out

    def on_exception(self, trainer, pl_module, exception):
        torch.save({"error": str(exception), "at": time.time()}, self.out / f"error.rank{trainer.global_rank}.pt")


def train_func(config):
    """Ray's recipe: a Trainer with devices="auto", RayLightningEnvironment and RayTrainReportCallback."""
    out = Path(config["out"])
    pl.seed_everything(7)
    model = RayRecorder(str(out), fail=config["fail"])
    trainer = pl.Trainer(
        accelerator="cpu",
        devices="auto",
        strategy=MyDDPStrategy(timeout=60) if config["ours"] else RayDDPStrategy(),
        plugins=[RayLightningEnvironment()],
        callbacks=[RayTrainReportCallback(), ErrorRecorder(out)],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        max_epochs=2,
    )
    if config["ours"]:  # prepare_trainer only checks the classes, and refuses any strategy but Ray's: left out
        try:
            prepare_trainer(trainer)
        except RuntimeError as refusal:  # recorded, to show what it says
            torch.save(str(refusal), out / f"refused.rank{trainer.global_rank}.pt")
    else:
        trainer = prepare_trainer(trainer)
    trainer.fit(model, datamodule=IndexedValDigits(batch_size=32))


def fit(out: Path, name: str, ours: bool, fail: bool = False) -> None:
    """One TorchTrainer.fit of train_func on 2 workers; its result (or error) goes to OUT/<name>.result.pt."""
    (out / name).mkdir()
    trainer = TorchTrainer(
        train_func,
        train_loop_config={"out": str(out / name), "ours": ours, "fail": fail},
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
        run_config=RunConfig(storage_path=str(out / "ray_results"), name=name),
    )
    start = time.time()
    try:
        result = trainer.fit()
    except Exception as error:
        torch.save({"error": str(error), "at": time.time(), "seconds": time.time() - start}, out / f"{name}.result.pt")
        return
    with result.checkpoint.as_directory() as folder:
        checkpoint = torch.load(Path(folder) / RayTrainReportCallback.CHECKPOINT_NAME, weights_only=False)
    record = {"state_dict": checkpoint["state_dict"], "metrics": dict(result.metrics)}
    torch.save({**record, "seconds": time.time() - start}, out / f"{name}.result.pt")


if __name__ == "__main__":
    out = Path(sys.argv[1])
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=True)
    fit(out, "ours", ours=True)
    fit(out, "ray", ours=False)
    fit(out, "failing", ours=True, fail=True)
    fit(out, "failing_ray", ours=False, fail=True)
    ray.shutdown()
