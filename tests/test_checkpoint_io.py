"""Checkpoint keys without ``module.``, in one process."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ddp_strategy import DDPCheckpointIO, DigitsClassifier, DigitsNet, load_plain_state_dict, strip_ddp_prefix
from ddp_strategy.checkpoint_io import load_file


def _prefixed(state_dict):
    return {f"module.{k}": v for k, v in state_dict.items()}


def test_strip_removes_ddp_prefix_only_when_every_key_has_it():
    """A DDP state dict loses ``module.``; a model with a real sub-module named ``module`` keeps its names."""
    assert list(strip_ddp_prefix({"module.a.weight": 1, "module.b": 2})) == ["a.weight", "b"]
    mixed = {"module.weight": 1, "head.weight": 2}
    assert strip_ddp_prefix(mixed) == mixed
    assert strip_ddp_prefix({}) == {}


def test_save_writes_keys_without_prefix(tmp_path):
    """DDPCheckpointIO.save_checkpoint strips ``module.`` from a prefixed state_dict before writing."""
    model = DigitsClassifier()
    path = tmp_path / "c.ckpt"
    DDPCheckpointIO().save_checkpoint({"state_dict": _prefixed(model.state_dict()), "epoch": 3}, path)
    saved = torch.load(path, weights_only=True)
    assert set(saved["state_dict"]) == set(model.state_dict()) and saved["epoch"] == 3


def test_prefixed_checkpoint_loads_into_lightning_and_plain_models(tmp_path):
    """A checkpoint whose keys carry ``module.`` loads strictly into DigitsClassifier and into DigitsNet."""
    source = DigitsClassifier()
    path = tmp_path / "prefixed.ckpt"
    torch.save({"state_dict": _prefixed(source.state_dict())}, path)
    loaded = DDPCheckpointIO().load_checkpoint(path)
    target = DigitsClassifier()
    target.load_state_dict(loaded["state_dict"], strict=True)
    plain = DigitsNet()
    plain.load_state_dict(load_plain_state_dict(path), strict=True)
    x = torch.rand(4, 64)
    torch.testing.assert_close(target(x), source(x), rtol=0, atol=0)
    torch.testing.assert_close(plain(x), source(x), rtol=0, atol=0)


def test_real_ddp_state_dict_round_trips(tmp_path):
    """The keys a real DistributedDataParallel wrapper produces (world size 1, gloo) load into the plain model."""
    import torch.distributed as dist

    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    net = DigitsNet()
    wrapped = DistributedDataParallel(net)
    assert all(k.startswith("module.") for k in wrapped.state_dict())
    torch.save({"model_state_dict": wrapped.state_dict(), "epoch": 1}, tmp_path / "hand.pt")
    dist.destroy_process_group()
    plain = DigitsNet()
    plain.load_state_dict(load_plain_state_dict(tmp_path / "hand.pt", submodule=""), strict=True)
    torch.testing.assert_close(plain.layers[0].weight, net.layers[0].weight, rtol=0, atol=0)


def test_missing_and_damaged_files_give_clear_errors(tmp_path):
    """A missing file names its path; a truncated one is reported as damaged, not as a pickle trace."""
    with pytest.raises(FileNotFoundError, match="nope.ckpt"):
        load_file(tmp_path / "nope.ckpt")
    good = tmp_path / "good.ckpt"
    torch.save({"state_dict": nn.Linear(64, 64).state_dict()}, good)
    bad = tmp_path / "bad.ckpt"
    bad.write_bytes(good.read_bytes()[:200])
    with pytest.raises(ValueError, match=r"bad.ckpt is damaged"):
        load_plain_state_dict(bad)


def test_unknown_submodule_lists_the_keys_found(tmp_path):
    """Asking for a sub-module that is not there raises KeyError naming the keys that are."""
    path = tmp_path / "c.ckpt"
    torch.save({"state_dict": DigitsClassifier().state_dict()}, path)
    with pytest.raises(KeyError, match="model.layers.0.weight"):
        load_plain_state_dict(path, submodule="encoder")
