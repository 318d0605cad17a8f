"""Helpers shared by the test folders: test doubles (in a module, so spawned ranks can import them), one-process fits
of a tiny model, subprocess and socket helpers, and the scenario launcher (several Trainer runs in one set of
ranks, each rank recording what it saw in ``out/<name>.rank<R>.pt``)."""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import signal
import socket
import subprocess
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ddp_strategy import DigitsClassifier, DigitsDataModule, DigitsNet, MyDDPStrategy
from ddp_strategy.testing import RankError, run_on_ranks

if TYPE_CHECKING:
    import pytest

try:
    import lightning.pytorch as pl
except ImportError:  # .ci/run's single-namespace compat venv (pytorch-lightning only) imports this module too
    import pytorch_lightning as pl

#: The state-dict keys of a DigitsClassifier checkpoint: DigitsNet's, under ``model.``, no ``module.``.
LIGHTNING_KEYS = {f"model.{k}" for k in DigitsNet().state_dict()}


def probe_input() -> torch.Tensor:
    """A fixed batch of 16 random 'images', shape (16, 64)."""
    return torch.rand(16, 64, generator=torch.Generator().manual_seed(7))


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class IndexedDigits(DigitsDataModule):
    """Digits whose training samples also carry their index in the training set: (x, y, idx)."""

    def setup(self, stage: str | None = None) -> None:
        super().setup(stage)
        x, y = self.train_set.tensors
        self.train_set = TensorDataset(x, y, torch.arange(len(y)))


class RecordingClassifier(DigitsClassifier):
    """Records, per rank: indices seen per epoch, first batch, initial weights, first gradients, final weights."""

    def __init__(self, out_dir: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.out_dir = out_dir
        self.seen: dict[int, list[int]] = {}
        self.record: dict[str, Any] = {}

    def on_train_start(self) -> None:
        self.record["initial"] = state_copy(self.model)

    def training_step(self, batch, batch_idx):
        x, y, idx = batch
        self.seen.setdefault(self.current_epoch, []).extend(idx.tolist())
        if "first_batch" not in self.record:
            self.record["first_batch"] = idx.tolist()
        return super().training_step((x, y), batch_idx)

    def on_after_backward(self) -> None:
        if "first_grads" not in self.record:
            self.record["first_grads"] = {n: p.grad.detach().clone() for n, p in self.model.named_parameters()}

    def on_train_end(self) -> None:
        self.record["seen"] = self.seen
        self.record["final"] = state_copy(self.model)
        self.record["world_size"] = self.trainer.world_size
        torch.save(self.record, Path(self.out_dir) / f"rank{self.global_rank}.pt")


def state_copy(module: nn.Module) -> dict[str, torch.Tensor]:
    """A copy of ``module``'s state dict that later training does not change (detached, cloned tensors)."""
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def load_ranks(folder: Path, world_size: int) -> list[dict[str, Any]]:
    """Every rank's record saved as ``folder/rank{R}.pt`` (by :class:`RecordingClassifier`, or a script's ranks)."""
    return [torch.load(folder / f"rank{r}.pt", weights_only=True) for r in range(world_size)]


def start_session(cmd: list[str], **kwargs: Any) -> subprocess.Popen:
    """Start ``cmd`` in a session of its own (so :func:`finish` can kill all it starts), its stdout and stderr
    merged into one text pipe; ``kwargs`` (``cwd``, ``env``) go to ``subprocess.Popen``."""
    return subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True, **kwargs
    )


def run_cli(args: list[str], cwd: Path, timeout: float = 240.0) -> subprocess.CompletedProcess:
    """Run ``python -m ddp_strategy ARGS`` in its own session; kill the whole group if it overruns."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = start_session([sys.executable, "-m", "ddp_strategy", *args], cwd=cwd, env=env)
    code, out = finish(proc, timeout)
    return subprocess.CompletedProcess(proc.args, code, out, None)


def finish(proc: subprocess.Popen, timeout: float) -> tuple[int, str]:
    """Wait for ``proc`` (started with ``start_new_session=True``); on overrun kill its whole group and fail."""
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"{proc.args} did not finish in {timeout} s; output:\n{out[-4000:]}") from None
    return proc.returncode, out


def session_members(sid: int) -> list[int]:
    """Live (non-zombie) processes whose session id is ``sid`` (everything a job started in its own session)."""
    members = []
    for proc in psutil.process_iter(["status"]):
        with contextlib.suppress(OSError):  # gone meanwhile
            if proc.info["status"] not in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD) and os.getsid(proc.pid) == sid:
                members.append(proc.pid)
    return members


def listening_sockets(pid: int) -> list[tuple[str, int]]:
    """The TCP sockets process ``pid`` listens on, as ``(address, port)``: ``0.0.0.0`` or ``::`` is every interface."""
    connections = psutil.Process(pid).net_connections(kind="tcp")
    return sorted((c.laddr.ip, c.laddr.port) for c in connections if c.status == psutil.CONN_LISTEN)


def is_loopback(address: str) -> bool:
    """Whether ``address`` (as :func:`listening_sockets` gives it) is 127.0.0.0/8, ::1 or IPv4-mapped loopback."""
    import ipaddress

    ip = ipaddress.ip_address(address)
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback


# ------------------------------------------------------------------------- one-process fits of a tiny model
class Regressor(pl.LightningModule):
    """``a`` is trained; ``b`` (with ``unused=True``) never takes part in the loss."""

    def __init__(self, unused: bool = False) -> None:
        super().__init__()
        self.a = nn.Linear(2, 1)
        self.b = nn.Linear(2, 1) if unused else None

    def training_step(self, batch, batch_idx):
        return self.a(batch[0]).pow(2).mean()

    def validation_step(self, batch, batch_idx):
        self.log("val", self.a(batch[0]).pow(2).mean())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def loader(n: int = 8, batch_size: int = 2, drop_last: bool = False) -> DataLoader:
    """``n`` seeded rows of 2 features (a 1-tuple per batch), in order."""
    return DataLoader(
        TensorDataset(torch.randn(n, 2, generator=torch.Generator().manual_seed(n))),
        batch_size=batch_size,
        drop_last=drop_last,
    )


def quiet_trainer(devices: int, strategy: Any, **kwargs: Any) -> pl.Trainer:
    """A ``Trainer`` on ``devices`` CPU processes under ``strategy`` (ours, or Lightning's, e.g. ``"ddp"`` or
    ``"auto"``) with no logger, checkpointing, progress bar or model summary; ``kwargs`` go to the Trainer as they
    are and override those (``enable_checkpointing=True``, ``enable_progress_bar=True``)."""
    quiet = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    return pl.Trainer(accelerator="cpu", devices=devices, strategy=strategy, **{**quiet, **kwargs})


def one_rank_trainer(root: Path, strategy: MyDDPStrategy | None = None, **kwargs: Any) -> pl.Trainer:
    """A :func:`quiet_trainer` on 1 device in this process, rooted at ``root``, under ``strategy`` (default
    ``MyDDPStrategy(timeout=30)``)."""
    return quiet_trainer(1, strategy or MyDDPStrategy(timeout=30), default_root_dir=root, **kwargs)


def fit_steps(root: Path, model: pl.LightningModule, strategy: MyDDPStrategy | None = None, **kwargs: Any) -> int:
    """Fit 3 steps on 8 samples; return the steps taken, after checking that ``model.a`` was trained."""
    before = model.a.weight.detach().clone()
    run = one_rank_trainer(root, strategy, max_steps=3, **kwargs)
    run.fit(model, loader())
    assert not torch.equal(before, model.a.weight.detach())
    return run.global_step


def error_of(run: Callable[[], Any], caplog: pytest.LogCaptureFixture) -> str:
    """``run()``'s error as ``"Type: message"``, with the exception and the captured log records dropped.

    A user who reruns after an error no longer holds its traceback; pytest.raises and the log capture (the
    strategy logs the failure with its traceback) would, and with it the failed fit's rendezvous store, which
    keeps MASTER_PORT busy for the next fit in this process.
    """
    # the log record would hold the traceback (and with it the old store)
    with caplog.at_level(logging.CRITICAL + 1, logger="ddp_strategy.process.failures"):
        try:
            run()
        except Exception as e:
            message = f"{type(e).__name__}: {e}"
        else:
            raise AssertionError("no error was raised")
    return message


# ------------------------------------------------------ scenarios: several Trainer runs in one set of ranks
def _scenario(scenario: str | Callable[[Path], None]) -> Callable[[Path], None]:
    """A scenario: a module-level function, or any module's ``"module:function"``."""
    if not isinstance(scenario, str):
        return scenario
    module, function = scenario.split(":")
    return getattr(importlib.import_module(module), function)


def _entry(rank: int, world_size: int, scenario: str | Callable[[Path], None], out: str) -> None:
    torch.set_num_threads(1)
    run = _scenario(scenario)
    try:
        run(Path(out))
    except BaseException:
        (Path(out) / f"error.{run.__name__}.rank{rank}.txt").write_text(traceback.format_exc())
        raise


def launch(scenario: str | Callable[[Path], None], world_size: int, out: Path, timeout_s: float = 270.0) -> None:
    """Run ``scenario`` (a module-level function of the output folder, or ``"module:function"``) on ``world_size``
    ranks started by the testing kit (:func:`ddp_strategy.testing.run_on_ranks`: forked from a warm forkserver,
    with the launch environment set, so each scenario's Trainer joins the ranks instead of launching processes).

    Raises:
        AssertionError: with the ranks' tracebacks (or stacks, past ``timeout_s`` seconds), when a rank fails.
    """
    name = _scenario(scenario).__name__
    try:
        run_on_ranks(_entry, world_size, args=(scenario, str(out)), init_process_group=False, timeout_s=timeout_s)
    except RankError as error:
        raise AssertionError(f"scenario {name!r} failed:\n{error}") from error


def rank() -> int:
    """This rank's index in a scenario's ranks (``LOCAL_RANK``: one node)."""
    return int(os.environ["LOCAL_RANK"])


def save(out: Path, name: str, record: dict[str, Any]) -> None:
    """Write one rank's record of run ``name``."""
    torch.save(record, out / f"{name}.rank{rank()}.pt")


def load(out: Path, name: str, world_size: int) -> list[dict[str, Any]]:
    """Every rank's record of run ``name``."""
    return [torch.load(out / f"{name}.rank{r}.pt", weights_only=True) for r in range(world_size)]
