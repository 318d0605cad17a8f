"""Bad input gets a clear error before the first step (the checks are deterministic, so every rank raises)."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ddp_strategy import DigitsClassifier, DigitsDataModule
from ddp_strategy.checkpoint.io import unwritable_reason
from ddp_strategy.sampling.injection import warn_if_not_shardable
from ddp_strategy.sync.wrapping import check_trainable


def test_a_loader_that_is_not_a_dataloader_is_accepted_with_a_warning(recwarn):
    """A list of batches (Lightning accepts any iterable) is not refused: with 2 ranks a warning says every rank
    reads all of it; with 1 rank, for an empty list (Lightning's "no loader") and for a DataLoader, no warning."""
    batches = [torch.zeros(2, 64)]
    with pytest.warns(UserWarning, match="MyDDPStrategy got a list as a loader.*each of the 2 ranks iterates all"):
        warn_if_not_shardable(batches, world_size=2)
    recwarn.clear()
    warn_if_not_shardable(batches, world_size=1)
    warn_if_not_shardable([], world_size=2)
    warn_if_not_shardable(DataLoader(TensorDataset(torch.zeros(2))), world_size=2)
    assert not recwarn.list


def test_a_module_with_nothing_to_train_is_refused():
    """No parameter requires a gradient: refused before DDP's own, less helpful, error."""
    frozen = nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(ValueError, match="Linear has no parameters that require a gradient"):
        check_trainable(frozen)
    check_trainable(nn.Linear(2, 2))


def test_an_unwritable_checkpoint_folder_is_named(tmp_path):
    """A folder that cannot be created is reported with its path; a writable one is fine, and a missing one
    (with missing parents) is not left behind: the check leaves no trace."""
    (tmp_path / "ok").mkdir()
    assert unwritable_reason([tmp_path / "ok"]) is None and list((tmp_path / "ok").iterdir()) == []
    assert unwritable_reason([tmp_path / "new" / "checkpoints"]) is None
    assert list(tmp_path.iterdir()) == [tmp_path / "ok"]
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    reason = unwritable_reason([blocker / "ckpts"])
    assert reason is not None and f"Checkpoint folder {blocker / 'ckpts'} is not writable" in reason


def test_batch_size_zero_is_refused_where_the_loader_is_made():
    """batch_size=0 fails in the DataLoader (PyTorch) and in the reference data module (ours), at once."""
    with pytest.raises(ValueError, match="batch_size should be a positive integer"):
        DataLoader(TensorDataset(torch.zeros(4)), batch_size=0)
    with pytest.raises(ValueError, match="per-device batch size and must be >= 1"):
        DigitsDataModule(batch_size=0)


def test_a_missing_checkpoint_path_fails_before_training(tmp_path):
    """fit(ckpt_path=...) with a missing file raises FileNotFoundError naming it, before any step."""
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=str(tmp_path))
    missing = tmp_path / "nope.ckpt"
    with pytest.raises(FileNotFoundError, match="nope.ckpt"):
        trainer.fit(DigitsClassifier(), DigitsDataModule(), ckpt_path=str(missing))
    assert trainer.global_step == 0


def test_an_unwritable_checkpoint_folder_warns_and_a_fit_that_never_saves_there_succeeds(tmp_path):
    """A ModelCheckpoint folder that cannot be written is named in a warning before the first step, and the fit
    runs (Lightning's ddp runs it too, and fails only if it saves there): no refusal of what Lightning accepts."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from ddp_strategy import MyDDPStrategy

    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    never_saves = ModelCheckpoint(dirpath=str(blocker / "ckpts"), every_n_epochs=5)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=1, limit_train_batches=2, limit_val_batches=0,
                         logger=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[never_saves], strategy=MyDDPStrategy(timeout=30),
                         default_root_dir=str(tmp_path))
    with pytest.warns(UserWarning, match=f"Checkpoint folder {blocker / 'ckpts'} is not writable"):
        trainer.fit(DigitsClassifier(), DigitsDataModule())
    assert trainer.global_step == 2 and blocker.read_text() == "not a folder"
