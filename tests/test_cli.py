"""The command line, ``python -m ddp_strategy``: bad flags and configs are usage errors, and the README's main job
trains on 2 real processes to the promised accuracy with a checkpoint that loads into the plain module."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys

import pytest
import torch
from ddp_testing import finish

from ddp_strategy import DigitsDataModule, DigitsNet, load_plain_state_dict
from ddp_strategy.checkpoint.io import load_file
from ddp_strategy.cli import EpochLines, build_cli

#: EpochLines' line as the main job logs it: epoch, train_loss, val_acc, val_loss, seconds.
EPOCH_LINE = re.compile(
    r"^INFO ddp_strategy.cli: Epoch (\d+): train_loss ([\d.]+), val_acc ([\d.]+), "
    r"val_loss ([\d.]+) \(([\d.]+) s\)$",
    re.MULTILINE,
)


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["fit", "--model.no_such_option=1"], "unrecognized arguments"),
        (["fit", "--trainer.max_epochs=abc"], "max_epochs"),
        (["fit", "--data.batch_size=0"], "per-device batch size and must be >= 1"),
        (
            ["fit", "--trainer.strategy=ddp_strategy.MyDDPStrategy", "--trainer.strategy.timeout=-5"],
            "timeout must be positive",
        ),
        (["fit", "--trainer.strategy=ddp_strategy.MyDDPStrategy", "--trainer.strategy.seed=abc"], "seed"),
    ],
)
def test_cli_bad_flags_give_a_usage_error_not_a_traceback(capsys, args, words):
    """A bad flag or value: usage + 'error:' naming it on stderr, exit status 2, no traceback."""
    with pytest.raises(SystemExit) as info:
        build_cli(args)
    err = capsys.readouterr().err
    assert info.value.code == 2 and "usage:" in err and "error:" in err and words in err
    assert "Traceback" not in err


def test_cli_bad_yaml_config_gives_a_usage_error(tmp_path, capsys):
    """Unknown keys and wrong types in --config YAML are usage errors too (exit 2)."""
    for text, words in (
        ("trainer:\n  no_such_key: 1\n", "no_such_key"),
        ("data:\n  batch_size: many\n", "batch_size"),
        ("model: [1, 2\n", "error:"),
    ):
        config = tmp_path / "c.yaml"
        config.write_text(text)
        with pytest.raises(SystemExit) as info:
            build_cli(["fit", f"--config={config}"])
        err = capsys.readouterr().err
        assert info.value.code == 2 and words in err and "Traceback" not in err, err[-2000:]


@pytest.mark.parametrize(
    ("args", "terminal", "bar"),
    [
        ([], False, "EpochLines"),
        ([], True, "TQDMProgressBar"),
        (["--trainer.enable_progress_bar=true"], False, "TQDMProgressBar"),
        (["--trainer.enable_progress_bar=false"], False, "NoneType"),
        (["--trainer.callbacks+=ddp_strategy.cli.EpochLines"], True, "EpochLines"),
        (["--trainer.callbacks+=lightning.pytorch.callbacks.TQDMProgressBar"], False, "TQDMProgressBar"),
    ],
)
def test_progress_bar_follows_the_terminal_unless_the_flags_choose(monkeypatch, args, terminal, bar):
    """Unset: Lightning's bar on a terminal, EpochLines otherwise; enable_progress_bar or trainer.callbacks choose."""
    monkeypatch.setattr("sys.stdout.isatty", lambda: terminal)
    trainer = build_cli(args, run=False).trainer
    assert type(trainer.progress_bar_callback).__name__ == bar
    assert sum(isinstance(c, EpochLines) for c in trainer.callbacks) == (bar == "EpochLines")


# ------------------------------------------------------------------------------------------ main job
@pytest.fixture(scope="module")
def cli_run(tmp_path_factory):
    """The README's main job, ``python -m ddp_strategy fit``, with its defaults (2 CPU processes, popen), in a pipe."""
    cwd = tmp_path_factory.mktemp("cli")
    with open(cwd / "stderr.txt", "w+") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "ddp_strategy", "fit"],
            cwd=cwd,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            stdout=subprocess.PIPE,
            stderr=stderr,
            start_new_session=True,
        )
        code, out = finish(proc, timeout=240)
        stderr.seek(0)
        err = stderr.read()
    assert code == 0, (out + err)[-4000:]
    return cwd, out, err


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_main_job_reaches_095_validation_accuracy(cli_run):
    """The default main job trains on 2 processes (global batch 64) to >= 0.95 validation accuracy."""
    _, out, err = cli_run
    assert "MyDDPStrategy: world size 2, backend=gloo" in err
    assert "global batch size 64" in err
    metrics = ast.literal_eval(re.search(r"Final metrics: (\{.*\})", out).group(1))
    assert metrics["val_acc"] >= 0.95


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_main_job_in_a_pipe_logs_one_line_per_epoch_not_a_bar(cli_run):
    """Stdout a pipe: one line per epoch from rank 0 (epoch, losses, accuracy, seconds), then the final metrics."""
    _, out, err = cli_run
    assert "\r" not in out + err and "it/s" not in out + err
    lines = [tuple(map(float, m.groups())) for m in EPOCH_LINE.finditer(out)]
    assert [int(line[0]) for line in lines] == list(range(20)) and out.count("Epoch ") == 20
    assert all(0 < loss < 3 and 0 <= acc <= 1 and 0 < val < 3 and 0 < s < 60 for _, loss, acc, val, s in lines)
    final = ast.literal_eval(re.search(r"^INFO ddp_strategy.cli: Final metrics: (\{.*\})$", out, re.M).group(1))
    assert lines[-1][2:4] == pytest.approx((final["val_acc"], final["val_loss"]), abs=1e-4)
    assert out.rindex("Epoch 19:") < out.index("Final metrics:")
    assert [
        line
        for line in out.splitlines()
        if line.startswith("INFO ddp_strategy.") and not line.startswith("INFO ddp_strategy.cli: ")
    ] == []  # no per-rank details among the lines


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_main_job_checkpoint_loads_into_plain_module_and_predicts(cli_run):
    """The checkpoint has no ``module.`` keys, loads with weights_only into DigitsNet, and matches val_acc."""
    cwd, out, _ = cli_run
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
