"""Checkpoints of real 2-process fits: plain loading, compiled keys, resuming, read-after-write, weights_only;
and a rank-0 write that fails, raised on every rank."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from ddp_testing import LIGHTNING_KEYS, load_ranks, probe_input, quiet_trainer, state_copy
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy

from ddp_strategy import (
    DDPCheckpointIO,
    DigitsClassifier,
    DigitsDataModule,
    DigitsNet,
    MyDDPStrategy,
    load_plain_state_dict,
)
from ddp_strategy.checkpoint.io import load_file
from ddp_strategy.testing import run_on_ranks

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

SEED = 321


class CompiledDigitsClassifier(DigitsClassifier):
    """DigitsClassifier whose plain model is compiled (eager backend, so it runs on CPU without a compiler)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.model = torch.compile(self.model, backend="eager")


class Probe(pl.Callback):
    """At the end of fit: record predictions and weights, save a checkpoint and read it back on every rank."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir

    def on_train_end(self, trainer, pl_module) -> None:
        rank = trainer.global_rank
        with torch.no_grad():
            predictions = pl_module(probe_input())
        weights = state_copy(pl_module)
        explicit = Path(self.out_dir) / "explicit.ckpt"
        trainer.save_checkpoint(explicit)  # every rank calls it; only rank 0 writes
        read_back = load_file(explicit)["state_dict"]  # every rank reads it at once
        own = trainer.strategy.lightning_module_state_dict()
        same = read_back.keys() == own.keys() and all(torch.equal(read_back[k], v) for k, v in own.items())
        torch.save(
            {
                "predictions": predictions,
                "weights": weights,
                "read_back_matches": same,
                "epoch": trainer.current_epoch,
                "step": trainer.global_step,
            },
            Path(self.out_dir) / f"rank{rank}.pt",
        )


def _fit(
    out_dir: Path, model: DigitsClassifier, max_epochs: int, strategy: MyDDPStrategy, ckpt_path: Path | None = None
) -> None:
    """A 2-rank fit (gloo) saving a checkpoint every epoch into ``out_dir/ckpts``; each rank records its end."""
    trainer = quiet_trainer(
        2,
        strategy,
        enable_checkpointing=True,
        max_epochs=max_epochs,
        default_root_dir=str(out_dir),
        limit_train_batches=10,
        limit_val_batches=2,
        callbacks=[ModelCheckpoint(dirpath=out_dir / "ckpts", filename="{epoch}", save_top_k=-1), Probe(str(out_dir))],
    )
    trainer.fit(model, DigitsDataModule(batch_size=32), ckpt_path=ckpt_path)


def _resume_compiled_on_kit_rank(rank: int, world_size: int, out_dir: str, ckpt_path: str) -> None:
    """One rank of the resumed run, started by the testing kit: the ``Trainer`` joins the kit's ranks."""
    pl.seed_everything(SEED)
    _fit(Path(out_dir), CompiledDigitsClassifier(), 2, MyDDPStrategy(timeout=60), ckpt_path=Path(ckpt_path))


def _records(out_dir: Path) -> dict:
    return {"dir": out_dir / "ckpts", **dict(enumerate(load_ranks(out_dir, 2)))}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[dict, dict]:
    """An uninterrupted 2-epoch run (spawned from this process), and a compiled model resumed from its epoch-0
    checkpoint for epoch 1 (ranks started by the testing kit: resuming must not depend on how ranks start)."""
    full, resumed = tmp_path_factory.mktemp("full"), tmp_path_factory.mktemp("resumed")
    pl.seed_everything(SEED)
    _fit(full, DigitsClassifier(), 2, MyDDPStrategy(start_method="spawn", timeout=60))
    run_on_ranks(
        _resume_compiled_on_kit_rank,
        2,
        args=(str(resumed), str(full / "ckpts" / "epoch=0.ckpt")),
        init_process_group=False,
        timeout_s=240,
    )
    return _records(full), _records(resumed)


def test_checkpoint_loads_strictly_into_the_plain_module_and_predicts_like_rank_0(runs):
    """Here (one process, no process group) the last checkpoint loads strictly into DigitsNet; outputs match."""
    full, _ = runs
    net = DigitsNet()
    net.load_state_dict(load_plain_state_dict(full["dir"] / "epoch=1.ckpt"), strict=True)
    with torch.no_grad():
        torch.testing.assert_close(net(probe_input()), full[0]["predictions"], rtol=0, atol=0)


def test_compiled_and_uncompiled_runs_write_identical_keys(runs):
    """The compiled run's checkpoints have exactly the uncompiled run's keys: no module., no _orig_mod."""
    full, resumed = runs
    assert any("_orig_mod" in k for k in resumed[0]["weights"])  # the model really was compiled
    for path in (full["dir"] / "epoch=1.ckpt", resumed["dir"] / "epoch=1.ckpt"):
        assert set(load_file(path)["state_dict"]) == LIGHTNING_KEYS


def test_resuming_continues_identically(runs):
    """1 epoch + resume for 1 more ends with the uninterrupted 2-epoch run's weights and outputs, on every rank."""
    full, resumed = runs
    for rank in range(2):
        assert resumed[rank]["epoch"] == full[rank]["epoch"] == 2 and resumed[rank]["step"] == full[rank]["step"]
        for key, value in full[rank]["weights"].items():
            torch.testing.assert_close(
                resumed[rank]["weights"][key.replace("model.", "model._orig_mod.", 1)], value, rtol=0, atol=0
            )
        torch.testing.assert_close(resumed[rank]["predictions"], full[0]["predictions"], rtol=0, atol=0)


def test_every_rank_reads_the_checkpoint_right_after_saving(runs):
    """Ranks return from save_checkpoint only once rank 0's file is complete; no temporary file is left."""
    full, resumed = runs
    for run, names in ((full, ["epoch=0.ckpt", "epoch=1.ckpt"]), (resumed, ["epoch=1.ckpt"])):
        assert run[0]["read_back_matches"] and run[1]["read_back_matches"]
        assert sorted(p.name for p in run["dir"].iterdir()) == names


def test_our_checkpoints_load_with_weights_only(runs):
    """Hyper-parameters, ModelCheckpoint state and loop state all load with torch.load(weights_only=True)."""
    full, _ = runs
    path = full["dir"] / "epoch=1.ckpt"
    checkpoint = torch.load(path, weights_only=True)
    assert checkpoint["hyper_parameters"]["learning_rate"] == 1e-3 and checkpoint["epoch"] == 1
    (state,) = [v for k, v in checkpoint["callbacks"].items() if k.startswith("ModelCheckpoint")]
    assert Path(state["dirpath"]) == full["dir"]
    model = DigitsClassifier.load_from_checkpoint(path, weights_only=True)
    with torch.no_grad():
        torch.testing.assert_close(model(probe_input()), full[0]["predictions"], rtol=0, atol=0)


class _FailingIO(DDPCheckpointIO):
    """A checkpoint plugin whose writes and removals fail, as on a full or read-only disk."""

    def save_checkpoint(self, checkpoint, path, storage_options=None) -> None:
        raise OSError(f"disk full while writing {path}")

    def remove_checkpoint(self, path) -> None:
        raise PermissionError(f"read-only: {path}")


def _save_and_remove_on_kit_rank(rank: int, world_size: int, folder: str, strategy_cls: type) -> dict:
    """Through a failing plugin: rank 0 alone saves and removes, as a callback under ``if trainer.is_global_zero:``
    does; record what each raised, then that the group still works. (A failed ``Trainer.save_checkpoint`` in a fit:
    tests/process/test_failures.py's save_raise job.)"""
    env = LightningEnvironment()
    env.set_global_rank(rank)
    strategy = strategy_cls(
        parallel_devices=[torch.device("cpu")] * world_size, cluster_environment=env, checkpoint_io=_FailingIO()
    )
    strategy.connect(torch.nn.Linear(2, 1))
    path, raised = f"{folder}/x.ckpt", {}
    calls = {"save": lambda: strategy.save_checkpoint({}, path), "remove": lambda: strategy.remove_checkpoint(path)}
    for what, call in calls.items():
        try:
            if strategy.is_global_zero:
                call()
            raised[what] = None
        except Exception as e:
            raised[what] = f"{type(e).__name__}: {e}"
    raised["after"] = float(strategy.reduce(torch.tensor(1.0), reduce_op="sum"))  # nobody is left waiting
    return raised


@pytest.mark.parametrize("strategy_cls", [MyDDPStrategy, DDPStrategy])
def test_rank_zero_save_and_remove_are_no_collective(tmp_path, strategy_cls):
    """save_checkpoint and remove_checkpoint called on rank 0 alone raise there and wait for nobody, as under ddp."""
    rank0, rank1 = run_on_ranks(_save_and_remove_on_kit_rank, 2, args=(str(tmp_path), strategy_cls), timeout_s=60)
    assert rank0["save"] == f"OSError: disk full while writing {tmp_path}/x.ckpt" and rank1["save"] is None
    assert rank0["remove"] == f"PermissionError: read-only: {tmp_path}/x.ckpt" and rank1["remove"] is None
    assert rank0["after"] == rank1["after"] == 2.0
