"""The reference data and model, in one process."""

from __future__ import annotations

import pytest
import torch

from ddp_strategy import DigitsClassifier, DigitsDataModule, DigitsNet
from ddp_strategy.reference.data import load_digits_tensors


def test_digits_split_is_fixed_disjoint_and_complete():
    """1,797 real digits split into 1,438 train / 359 validation, the same on every call."""
    dm, again = DigitsDataModule(), DigitsDataModule()
    dm.setup("fit")
    again.setup("fit")
    assert len(dm.train_set) == 1438 and len(dm.val_set) == 359
    assert all(
        torch.equal(a, b)
        for a, b in zip(
            dm.val_set.tensors + dm.train_set.tensors, again.val_set.tensors + again.train_set.tensors, strict=True
        )
    )
    rows = lambda *xs: sorted(map(tuple, torch.cat(xs).tolist()))  # noqa: E731
    assert rows(dm.train_set.tensors[0], dm.val_set.tensors[0]) == rows(load_digits_tensors()[0])
    x, y = dm.train_set.tensors
    assert x.shape == (1438, 64) and 0.0 <= x.min() and x.max() <= 1.0 and set(y.tolist()) == set(range(10))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"batch_size": 0}, "per-device batch size"),
        ({"num_workers": -1}, "num_workers"),
        ({"val_fraction": 1.0}, "val_fraction"),
    ],
)
def test_bad_data_arguments(kwargs, message):
    """Bad sizes are refused with a ValueError that says which argument."""
    with pytest.raises(ValueError, match=message):
        dm = DigitsDataModule(**kwargs)
        dm.setup("fit")


def test_lightning_module_keys_are_the_plain_model_keys_under_model():
    """DigitsClassifier's state dict is DigitsNet's under ``model.``, and the outputs have shape (B, 10)."""
    lm, net = DigitsClassifier(), DigitsNet()
    assert set(lm.state_dict()) == {f"model.{k}" for k in net.state_dict()}
    assert lm(torch.rand(5, 64)).shape == (5, 10)


def test_main_returns_none_so_the_console_script_exits_0(tmp_path, monkeypatch):
    """``ddp-strategy`` does ``sys.exit(main())``: main must return None after a successful (1-device) run."""
    from ddp_strategy.__main__ import main

    monkeypatch.chdir(tmp_path)
    assert (
        main(["fit", "--trainer.devices=1", "--trainer.fast_dev_run=2", "--trainer.enable_progress_bar=false"]) is None
    )


def test_cli_classes_live_in_an_importable_module():
    """Spawned ranks must find the CLI class again by its module, which ``python -m`` would hide in __main__."""
    from ddp_strategy.cli import DigitsCLI

    assert DigitsCLI.__module__ == "ddp_strategy.cli"


def test_ddp_options_can_be_set_from_the_cli(capsys):
    """The common DDP options are named arguments, so LightningCLI exposes them as flags and YAML keys."""
    from ddp_strategy.__main__ import main

    with pytest.raises(SystemExit) as exit_info:
        main(
            [
                "fit",
                "--trainer.strategy=ddp_strategy.MyDDPStrategy",
                "--trainer.strategy.find_unused_parameters=true",
                "--trainer.strategy.bucket_cap_mb=5",
                "--print_config",
            ]
        )
    assert exit_info.value.code in (0, None)
    config = capsys.readouterr().out
    assert "find_unused_parameters: true" in config and "bucket_cap_mb: 5" in config


def test_named_ddp_options_reach_ddp_and_defaults_stay_short():
    """Named options that differ from DDP's defaults are passed on; the defaults add none (as Lightning's ddp)."""
    from ddp_strategy import MyDDPStrategy

    assert MyDDPStrategy()._options.ddp_kwargs == {}
    s = MyDDPStrategy(find_unused_parameters=True, bucket_cap_mb=5, broadcast_buffers=False)
    assert s._options.ddp_kwargs == {"find_unused_parameters": True, "bucket_cap_mb": 5, "broadcast_buffers": False}
