"""The command line, ``python -m ddp_strategy``: bad flags and configs are usage errors, and the README's main job
trains on 2 real processes to the promised accuracy with a checkpoint that loads into the plain module."""

from __future__ import annotations

import ast
import re

import pytest
import torch
from ddp_testing import run_cli

from ddp_strategy import DigitsDataModule, DigitsNet, load_plain_state_dict
from ddp_strategy.checkpoint.io import load_file
from ddp_strategy.cli import build_cli


@pytest.mark.parametrize(("args", "words"), [
    (["fit", "--model.no_such_option=1"], "unrecognized arguments"),
    (["fit", "--trainer.max_epochs=abc"], "max_epochs"),
    (["fit", "--data.batch_size=0"], "per-device batch size and must be >= 1"),
    (["fit", "--trainer.strategy=ddp_strategy.MyDDPStrategy", "--trainer.strategy.timeout=-5"],
     "timeout must be positive"),
    (["fit", "--trainer.strategy=ddp_strategy.MyDDPStrategy", "--trainer.strategy.seed=abc"], "seed"),
])
def test_cli_bad_flags_give_a_usage_error_not_a_traceback(capsys, args, words):
    """A bad flag or value: usage + 'error:' naming it on stderr, exit status 2, no traceback."""
    with pytest.raises(SystemExit) as info:
        build_cli(args)
    err = capsys.readouterr().err
    assert info.value.code == 2 and "usage:" in err and "error:" in err and words in err
    assert "Traceback" not in err


def test_cli_bad_yaml_config_gives_a_usage_error(tmp_path, capsys):
    """Unknown keys and wrong types in --config YAML are usage errors too (exit 2)."""
    for text, words in (("trainer:\n  no_such_key: 1\n", "no_such_key"), ("data:\n  batch_size: many\n", "batch_size"),
                        ("model: [1, 2\n", "error:")):
        config = tmp_path / "c.yaml"
        config.write_text(text)
        with pytest.raises(SystemExit) as info:
            build_cli(["fit", f"--config={config}"])
        err = capsys.readouterr().err
        assert info.value.code == 2 and words in err and "Traceback" not in err, err[-2000:]


# ------------------------------------------------------------------------------------------ main job
@pytest.fixture(scope="module")
def cli_run(tmp_path_factory):
    """The README's main job, ``python -m ddp_strategy fit``, with its defaults (2 CPU processes, popen)."""
    cwd = tmp_path_factory.mktemp("cli")
    result = run_cli(["fit", "--trainer.enable_progress_bar=false"], cwd=cwd)
    assert result.returncode == 0, result.stdout[-4000:]
    return cwd, result.stdout


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_main_job_reaches_095_validation_accuracy(cli_run):
    """The default main job trains on 2 processes (global batch 64) to >= 0.95 validation accuracy."""
    _, out = cli_run
    assert "2 processes, backend=gloo" in out
    assert "global batch size 64" in out
    metrics = ast.literal_eval(re.search(r"Final metrics: (\{.*\})", out).group(1))
    assert metrics["val_acc"] >= 0.95


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
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
