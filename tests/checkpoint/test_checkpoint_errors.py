"""Checkpoint errors and warnings (ddp_strategy/checkpoint/): an unwritable checkpoint folder, the plain-module
helpers' refusals, a missing optional dependency and a checkpoint ``weights_only`` cannot read; each names the
file or argument, and each fix it suggests works where it was raised. One process; the 2-process suggestions of
UnsafeCheckpointError are in tests/sampling/test_data_compat.py.
"""

from __future__ import annotations

import importlib.metadata
import itertools
import sys
import warnings
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
from ddp_testing import Regressor, error_of, loader, one_rank_trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

from ddp_strategy import (
    DigitsClassifier,
    DigitsDataModule,
    MyDDPStrategy,
    StateDictMismatchError,
    UnsafeCheckpointError,
    export_weights,
    import_plain_checkpoint,
    load_plain_state_dict,
)
from ddp_strategy.checkpoint.convert import plain_state_dict
from ddp_strategy.checkpoint.io import prepare_folders

pytestmark = pytest.mark.timeout(120)


# ------------------------------------------------------------------------------------ checkpoint folder
def test_an_unwritable_checkpoint_folder_is_named(tmp_path):
    """A folder that cannot be created is reported with its path; a writable one is fine, and a missing one
    (with missing parents) is not left behind: the check leaves no trace."""
    (tmp_path / "ok").mkdir()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning for a writable or a missing folder
        prepare_folders([SimpleNamespace(dirpath=tmp_path / "ok"), SimpleNamespace(dirpath=tmp_path / "new" / "c")])
    assert list(tmp_path.iterdir()) == [tmp_path / "ok"] and list((tmp_path / "ok").iterdir()) == []
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.warns(UserWarning, match=f"Checkpoint folder {blocker / 'ckpts'} is not writable") as caught:
        prepare_folders([SimpleNamespace(dirpath=blocker / "ckpts"), SimpleNamespace(dirpath=blocker / "other")])
    assert len(caught) == 1  # the first unwritable folder is named once


def test_an_unwritable_checkpoint_folder_warns_and_a_fit_that_never_saves_there_succeeds(tmp_path):
    """A ModelCheckpoint folder that cannot be written is named in a warning before the first step, and the fit
    runs (Lightning's ddp runs it too, and fails only if it saves there): no refusal of what Lightning accepts."""
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    never_saves = ModelCheckpoint(dirpath=str(blocker / "ckpts"), every_n_epochs=5)
    trainer = one_rank_trainer(
        tmp_path,
        MyDDPStrategy(timeout=30),
        enable_checkpointing=True,
        max_epochs=1,
        limit_train_batches=2,
        limit_val_batches=0,
        callbacks=[never_saves],
    )
    with pytest.warns(UserWarning, match=f"Checkpoint folder {blocker / 'ckpts'} is not writable"):
        trainer.fit(DigitsClassifier(), DigitsDataModule())
    assert trainer.global_step == 2 and blocker.read_text() == "not a folder"


def test_unwritable_checkpoint_folder_warning_suggestions_work(tmp_path, caplog):
    """A checkpoint folder below a file warns at fit start (and the first save fails, as it says); a writable
    ModelCheckpoint(dirpath=...) or Trainer(default_root_dir=...) fits without the warning and saves there."""
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.warns(UserWarning, match=r"Choose a writable ModelCheckpoint\(dirpath=...\) or Trainer\(default_root"):
        message = error_of(
            lambda: one_rank_trainer(blocker / "root", max_steps=1, enable_checkpointing=True).fit(
                Regressor(), loader()
            ),
            caplog,
        )
    assert message.startswith("NotADirectoryError")
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*not writable")
        run = one_rank_trainer(
            blocker / "root",
            max_steps=1,
            callbacks=[ModelCheckpoint(dirpath=tmp_path / "ckpts")],
            enable_checkpointing=True,
        )
        run.fit(Regressor(), loader())
        assert [p.name for p in (tmp_path / "ckpts").iterdir()] == ["epoch=0-step=1.ckpt"]
        one_rank_trainer(tmp_path / "root", max_steps=1, enable_checkpointing=True).fit(Regressor(), loader())
        assert [p.name for p in (tmp_path / "root" / "checkpoints").iterdir()] == ["epoch=0-step=1.ckpt"]


# --------------------------------------------------------------------------------- checkpoint helpers
class Holder(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Linear(2, 1)


def test_import_plain_checkpoint_error_suggestions_work(tmp_path):
    """A plain module with output_path, or a file without optimizer state, is refused; output_path=None loads
    the weights, and a LightningModule with optimizer state writes a checkpoint that fits."""
    plain = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    plain(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    torch.save({"model": plain.state_dict(), "optimizer": optimizer.state_dict()}, tmp_path / "full.pt")
    torch.save({"model": plain.state_dict()}, tmp_path / "weights.pt")
    target = nn.Linear(2, 1)
    with pytest.raises(TypeError, match="Pass the LightningModule, or output_path=None"):
        import_plain_checkpoint(tmp_path / "full.pt", target, tmp_path / "out.ckpt")
    import_plain_checkpoint(tmp_path / "full.pt", target, output_path=None)
    assert torch.equal(target.weight, plain.weight)
    holder = Holder()
    with pytest.raises(ValueError, match="load the weights with output_path=None instead"):
        import_plain_checkpoint(tmp_path / "weights.pt", holder, tmp_path / "out.ckpt")
    import_plain_checkpoint(tmp_path / "weights.pt", holder, output_path=None)
    assert torch.equal(holder.model.weight, plain.weight)
    import_plain_checkpoint(tmp_path / "full.pt", Holder(), tmp_path / "out.ckpt")
    assert torch.equal(torch.load(tmp_path / "out.ckpt")["state_dict"]["model.weight"], plain.weight)


def test_plain_state_dict_submodule_error_suggestions_work(tmp_path):
    """submodule='model' on a checkpoint of another attribute is refused; submodule='' or the attribute works."""
    checkpoint = {"state_dict": {"net.weight": torch.ones(1, 2), "net.bias": torch.zeros(1)}}
    with pytest.raises(KeyError, match="Pass submodule='' for the whole state dict, or the attribute name"):
        plain_state_dict(checkpoint, tmp_path / "c.ckpt")
    assert set(plain_state_dict(checkpoint, tmp_path / "c.ckpt", submodule="")) == {"net.weight", "net.bias"}
    assert set(plain_state_dict(checkpoint, tmp_path / "c.ckpt", submodule="net")) == {"weight", "bias"}


def test_safetensors_missing_error_suggestions_work(tmp_path, monkeypatch):
    """Without safetensors, a .safetensors export is refused; a .pt path writes a PyTorch file that torch.load
    reads, and the suggested extra 'ddp_strategy[safetensors]' exists and brings safetensors."""
    holder = Holder()
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)  # what `import` finds when it is not installed
    with pytest.raises(ImportError, match=r"pip install 'ddp_strategy\[safetensors\]', or export a PyTorch file"):
        export_weights(holder, tmp_path / "w.safetensors")
    export_weights(holder, tmp_path / "w.pt")
    assert torch.equal(torch.load(tmp_path / "w.pt")["weight"], holder.model.weight)
    requires = importlib.metadata.requires("ddp_strategy") or []
    assert any(r.startswith("safetensors") and 'extra == "safetensors"' in r for r in requires), requires


def test_unsafe_checkpoint_suggestions_name_the_function_that_raised(tmp_path):
    """load_plain_state_dict, export_weights and import_plain_checkpoint refuse a checkpoint holding an nn.MSELoss
    with a message naming their own weights_only=False and the exact add_safe_globals call; both then work."""
    path = tmp_path / "lossy.ckpt"
    net = nn.Linear(3, 1)
    holder = nn.Module()
    holder.model = nn.Linear(3, 1)
    torch.save(
        {
            "state_dict": {f"model.{k}": v for k, v in net.state_dict().items()},
            "hyper_parameters": {"loss_fn": nn.MSELoss()},
        },
        path,
    )
    calls = {
        "load_plain_state_dict": lambda **kw: load_plain_state_dict(path, **kw),
        "export_weights": lambda **kw: export_weights(path, tmp_path / "w.pt", **kw),
        "import_plain_checkpoint": lambda **kw: import_plain_checkpoint(path, holder, **kw),
    }
    for name, call in calls.items():
        with pytest.raises(UnsafeCheckpointError) as raised:
            call()
        message = str(raised.value)
        assert f"{name}(..., weights_only=False)" in message
        assert "torch.serialization.add_safe_globals([torch.nn.modules.loss.MSELoss])" in message
        call(weights_only=False)  # the first suggestion, where the error was raised
    assert torch.equal(load_plain_state_dict(path, weights_only=False)["weight"], net.weight)
    with torch.serialization.safe_globals([torch.nn.modules.loss.MSELoss]):  # the second
        assert torch.equal(load_plain_state_dict(path)["weight"], net.weight)


class Wider(Regressor):
    """Regressor plus a layer the checkpoint does not have."""

    def __init__(self) -> None:
        super().__init__()
        self.extra = nn.Linear(1, 1)

    def training_step(self, batch, batch_idx):
        return super().training_step(batch, batch_idx) + self.extra(self.a(batch[0])).square().mean()


def test_state_dict_mismatch_suggestions_work_where_raised(tmp_path):
    """A checkpoint into a model with an extra layer: validate(ckpt_path=...) raises StateDictMismatchError
    suggesting model.strict_loading = False, which then loads the matching weights; fit(ckpt_path=...) raises with
    the fit's own suggestion (import_plain_checkpoint(..., strict=False), then fit without ckpt_path), which fits."""

    def trainer(max_steps: int = 1) -> pl.Trainer:
        return one_rank_trainer(
            tmp_path,
            max_steps=max_steps,
            num_sanity_val_steps=0,
            enable_checkpointing=True,
            callbacks=[ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), filename="last")],
        )

    source = Regressor()
    trainer().fit(source, loader(), loader())
    ckpt = str(tmp_path / "ckpt" / "last.ckpt")
    wider = Wider()
    with pytest.raises(StateDictMismatchError, match=r"model.strict_loading = False") as raised:
        trainer().validate(wider, loader(), ckpt_path=ckpt)
    assert "'extra.weight'" in str(raised.value) and "trainer.fit" not in str(raised.value)
    wider.strict_loading = False
    trainer().validate(wider, loader(), ckpt_path=ckpt)
    assert torch.equal(wider.a.weight, source.a.weight)

    wider = Wider()
    with pytest.raises(StateDictMismatchError, match=r"import_plain_checkpoint\(ckpt_path, model, strict=False\)"):
        trainer(2).fit(wider, loader(), ckpt_path=ckpt)
    import_plain_checkpoint(ckpt, wider, strict=False)
    assert torch.equal(wider.a.weight, source.a.weight)
    fitted = trainer(2)
    fitted.fit(wider, loader())
    assert fitted.global_step == 2 and not torch.equal(wider.a.weight, source.a.weight)


class Headed(Regressor):
    """Regressor with a ``head`` of ``outputs`` outputs after ``a``."""

    def __init__(self, outputs: int = 1) -> None:
        super().__init__()
        self.head = nn.Linear(1, outputs)

    def training_step(self, batch, batch_idx):
        return self.head(self.a(batch[0])).square().mean()

    def test_step(self, batch, batch_idx):
        self.log("test", self.head(self.a(batch[0])).square().mean())


def test_a_tensor_of_another_shape_raises_with_strict_loading_off_as_under_ddp(tmp_path):
    """A checkpoint whose head.weight has another shape, loaded by test(ckpt_path=...) with model.strict_loading
    False (and True): a RuntimeError "size mismatch for head.weight" under strategy="ddp" and MyDDPStrategy(), the
    model left as it was; import_plain_checkpoint(strict=False) raises it too (strict=False skips keys, not shapes)."""
    trainer = one_rank_trainer(tmp_path, max_steps=1)
    trainer.fit(Headed(), loader())
    ckpt = str(tmp_path / "headed.ckpt")
    trainer.save_checkpoint(ckpt)
    for strategy, strict in itertools.product(("ddp", "ours"), (False, True)):
        wider = Headed(outputs=2)
        wider.strict_loading = strict
        before = wider.head.weight.detach().clone()
        with pytest.raises(RuntimeError, match="size mismatch for head.weight"):
            one_rank_trainer(tmp_path, None if strategy == "ours" else strategy).test(wider, loader(), ckpt_path=ckpt)
        assert torch.equal(wider.head.weight, before), (strategy, strict)
    with pytest.raises(RuntimeError, match="size mismatch for head.weight"):
        import_plain_checkpoint(ckpt, Headed(outputs=2), strict=False)
