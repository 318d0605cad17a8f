"""Real two-process fits on CPU with gloo. Each fit is shared by several tests to keep the suite fast."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from ddp_testing import IndexedDigits, RecordingClassifier, run_cli

from ddp_strategy import DigitsDataModule, DigitsNet, MyDDPStrategy, load_plain_state_dict
from ddp_strategy.checkpoint.io import load_file
from ddp_strategy.testing import run_on_ranks

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

SEED = 123
EPOCHS = 2


def _recorded_fit(out_dir: str, strategy: MyDDPStrategy) -> None:
    """Fit the recording model on 2 ranks; each rank saves its record as ``out_dir/rank{r}.pt``."""
    pl.seed_everything(SEED)
    model = RecordingClassifier(out_dir=out_dir)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=strategy,
        max_epochs=EPOCHS, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=out_dir,
    )
    trainer.fit(model, IndexedDigits(batch_size=32))


def _kit_rank(rank: int, world_size: int, out_dir: str) -> None:
    """One rank of the kit-started fit: the Trainer finds the kit's launch environment and joins, as under torchrun."""
    _recorded_fit(out_dir, MyDDPStrategy(timeout=60))


def _records(out_dir: Path) -> dict[int, dict]:
    return {r: torch.load(out_dir / f"rank{r}.pt", weights_only=True) for r in range(2)}


@pytest.fixture(scope="module")
def fits(tmp_path_factory) -> tuple[dict[int, dict], dict[int, dict]]:
    """Two 2-rank fits with the same seed: one started by the strategy's spawn launcher from this process, one
    by the testing kit (ranks forked from a warm parent, ``Trainer`` joining their environment). Determinism is
    checked across the two ways of starting the ranks; shards, gradients and weights on the spawned one."""
    spawned, kit = tmp_path_factory.mktemp("spawned"), tmp_path_factory.mktemp("kit")
    _recorded_fit(str(spawned), MyDDPStrategy(start_method="spawn", timeout=60))
    run_on_ranks(_kit_rank, 2, args=(str(kit),), init_process_group=False, timeout_s=240)
    return _records(spawned), _records(kit)


def test_ranks_see_disjoint_shards_covering_the_training_set(fits):
    """In every epoch the two ranks' indices are disjoint and together cover all 1,438 training samples."""
    run, _ = fits
    n = 1438
    for epoch in range(EPOCHS):
        r0, r1 = run[0]["seen"][epoch], run[1]["seen"][epoch]
        assert len(r0) == len(r1) == n // 2
        assert set(r0).isdisjoint(r1)
        assert set(r0) | set(r1) == set(range(n))


def test_order_changes_between_epochs_and_repeats_with_the_same_seed(fits):
    """set_epoch is called for the user: epoch 1's order differs from epoch 0's, and a rerun started another way
    (the testing kit instead of spawn) repeats both, and ends with the same weights."""
    run_a, run_b = fits
    for rank in range(2):
        assert run_a[rank]["seen"][0] != run_a[rank]["seen"][1]
        assert set(run_a[rank]["seen"][0]) != set(run_a[rank]["seen"][1])  # reshuffled across ranks, too
        assert run_a[rank]["seen"] == run_b[rank]["seen"]
        for name, value in run_a[rank]["final"].items():
            torch.testing.assert_close(run_b[rank]["final"][name], value, rtol=0, atol=1e-6)


def test_ddp_gradient_equals_single_process_gradient_on_the_union_of_batches(fits):
    """After the first backward, each rank's gradient equals one process's gradient on both ranks' batches."""
    run, _ = fits
    for name in run[0]["initial"]:
        torch.testing.assert_close(run[0]["initial"][name], run[1]["initial"][name], rtol=0, atol=0)
    dm = IndexedDigits(batch_size=32)
    dm.setup("fit")
    x, y, _ = dm.train_set.tensors
    union = torch.tensor(run[0]["first_batch"] + run[1]["first_batch"])
    assert len(union) == 64
    net = DigitsNet()
    net.load_state_dict(run[0]["initial"])
    F.cross_entropy(net(x[union]), y[union]).backward()
    for name, param in net.named_parameters():
        for rank in range(2):
            torch.testing.assert_close(run[rank]["first_grads"][name], param.grad, rtol=0, atol=1e-6)


def test_ranks_end_with_identical_weights(fits):
    """Every rank applied the same updates: the final weights are bit-identical and differ from the start."""
    run, _ = fits
    for name, value in run[0]["final"].items():
        assert torch.equal(value, run[1]["final"][name])
    assert not torch.equal(run[0]["final"]["layers.0.weight"], run[0]["initial"]["layers.0.weight"])


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory):
    """The README's main job, ``python -m ddp_strategy fit``, with its defaults (2 CPU processes, popen)."""
    cwd = tmp_path_factory.mktemp("cli")
    result = run_cli(["fit", "--trainer.enable_progress_bar=false"], cwd=cwd)
    assert result.returncode == 0, result.stdout[-4000:]
    return cwd, result.stdout


def test_main_job_reaches_095_validation_accuracy(cli_run):
    """The default main job trains on 2 processes (global batch 64) to >= 0.95 validation accuracy."""
    _, out = cli_run
    assert "2 processes, backend=gloo" in out
    assert "global batch size 64" in out
    metrics = ast.literal_eval(re.search(r"Final metrics: (\{.*\})", out).group(1))
    assert metrics["val_acc"] >= 0.95


def test_main_job_checkpoint_loads_into_plain_module_and_predicts(cli_run):
    """The checkpoint has no ``module.`` keys, loads with weights_only into DigitsNet, and matches val_acc."""
    cwd, out = cli_run
    ckpt_path = cwd / re.search(r"Checkpoint: (\S+\.ckpt)", out).group(1)
    checkpoint = load_file(ckpt_path, weights_only=True)
    assert not any(k.startswith("module.") for k in checkpoint["state_dict"])
    assert set(checkpoint["state_dict"]) == {f"model.{k}" for k in DigitsNet().state_dict()}
    net = DigitsNet()
    net.load_state_dict(load_plain_state_dict(ckpt_path), strict=True)
    dm = DigitsDataModule()
    dm.setup("fit")
    x, y = dm.val_set.tensors
    with torch.no_grad():
        accuracy = (net(x).argmax(dim=1) == y).float().mean().item()
    metrics = ast.literal_eval(re.search(r"Final metrics: (\{.*\})", out).group(1))
    assert accuracy >= 0.95
    assert accuracy == pytest.approx(metrics["val_acc"], abs=1e-4)
