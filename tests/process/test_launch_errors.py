"""Launch errors and warnings (ddp_strategy/process/): the launch variables, the rendezvous port, the CPU count, fork
with CUDA and the backend; each is raised before any rank trains, names its input, and each fix it suggests works.

Hypothesis runs derandomized (fixed seed) with a bounded number of examples; benchmarks/fuzz_inputs.py runs the
same test with many more (``DDP_FUZZ_EXAMPLES``).
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from ddp_testing import Regressor, finish, fit_steps, free_port, load_ranks, quiet_trainer, start_session
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lightning.fabric.plugins.environments import LightningEnvironment, TorchElasticEnvironment

from ddp_strategy import MyDDPStrategy
from ddp_strategy.process import group as process_group
from ddp_strategy.process import launching
from ddp_strategy.process.launching import check_launch_env

pytestmark = pytest.mark.timeout(120)

SCRIPTS = Path(__file__).parent.parent / "scripts"
FUZZ = settings(
    max_examples=int(os.environ.get("DDP_FUZZ_EXAMPLES", "40")),
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)


# ------------------------------------------------------------------------------- launch variables
LAUNCH_VARIABLES = ("MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK")
_values = st.one_of(
    st.just(""),
    st.text(max_size=6),
    st.integers(-(2**40), 2**40).map(str),
    st.sampled_from([" 1", "+1", "1_0", "0x10", "1.0", "１", "65536", "-1", "0"]),
)


@contextlib.contextmanager
def _environment(environ: dict[str, str]) -> Iterator[None]:
    """``os.environ`` is exactly ``environ`` inside the block, and as it was after it."""
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(environ)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _accepted_by_lightning(env, environ: dict[str, str]) -> bool:
    """Whether Lightning's own environment parses every variable it reads from ``environ`` (its int())."""
    with _environment(environ):
        try:
            env.local_rank(), env.node_rank(), env.world_size(), env.global_rank()
            if "MASTER_PORT" in environ:
                env.main_port  # noqa: B018 (a property that parses MASTER_PORT)
            return True
        except (ValueError, KeyError):
            return False


@FUZZ
@given(environ=st.dictionaries(st.sampled_from(LAUNCH_VARIABLES), _values, max_size=5), elastic=st.booleans())
def test_launch_variables_fuzz(environ, elastic):
    """Any values: accepted, or ValueError naming the variable and value; never another error type.

    What Lightning's int() cannot parse is always refused; what it parses and is in range is accepted.
    """
    env = TorchElasticEnvironment() if elastic else LightningEnvironment()
    if elastic:
        environ = {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", **environ}
    try:
        with _environment(environ):
            check_launch_env(env, num_nodes=1, num_processes=2)
        accepted = True
    except ValueError as e:
        accepted = False
        message = str(e)
        assert any(f"{name}={environ.get(name)!r}" in message for name in environ) or "GROUP_RANK" in message, message
    if not _accepted_by_lightning(env, environ):
        assert not accepted, environ


@pytest.mark.parametrize(
    ("variable", "value", "words"),
    [
        ("MASTER_PORT", "", "MASTER_PORT='' is empty"),
        ("MASTER_PORT", "http", "MASTER_PORT='http' is not a whole number"),
        ("MASTER_PORT", "70000", "MASTER_PORT='70000' is out of range"),
        ("LOCAL_RANK", "-1", "LOCAL_RANK='-1' is out of range"),
        ("NODE_RANK", "abc", "NODE_RANK='abc' is not a whole number"),
    ],
)
def test_a_bad_launch_variable_fails_in_trainer_construction(monkeypatch, variable, value, words):
    """Trainer(strategy=MyDDPStrategy()) raises the named ValueError before launching; unsetting it (the fix) works."""

    def build() -> pl.Trainer:
        return quiet_trainer(2, MyDDPStrategy(allow_cpu_oversubscription=True), enable_checkpointing=True)

    monkeypatch.setenv(variable, value)
    with pytest.raises(ValueError, match=words):
        build()
    monkeypatch.delenv(variable)
    assert build().strategy.num_processes == 2


def test_variables_lightning_ignores_are_not_checked(monkeypatch):
    """WORLD_SIZE/RANK are not read by LightningEnvironment: junk there is Lightning's to ignore, and ours."""
    monkeypatch.setenv("WORLD_SIZE", "")
    monkeypatch.setenv("RANK", "junk")
    monkeypatch.setenv("MASTER_PORT", " 29500 ")  # int() accepts the spaces, as Lightning does
    trainer = quiet_trainer(2, MyDDPStrategy(allow_cpu_oversubscription=True), enable_checkpointing=True)
    assert trainer.strategy.cluster_environment.main_port == 29500


# ------------------------------------------------------------------ the rendezvous, CPUs, fork, backend
def test_port_in_use_error_suggestions_work(tmp_path, monkeypatch):
    """MASTER_PORT taken by another process: the rendezvous fails at once (no hang) naming the address and that the
    port is in use; another port, or none, fits."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        monkeypatch.setenv("MASTER_PORT", str(port))
        with pytest.raises(
            RuntimeError,
            match=f"127.0.0.1:{port}: the port is already in use by another process."
            " Choose another MASTER_PORT, or unset it",
        ):
            fit_steps(tmp_path, Regressor())
        monkeypatch.setenv("MASTER_PORT", str(free_port()))
        assert fit_steps(tmp_path, Regressor()) == 3
        monkeypatch.delenv("MASTER_PORT")
        assert fit_steps(tmp_path, Regressor()) == 3


def test_cpu_oversubscription_warning_suggestions_silence_it(monkeypatch):
    """More CPU processes than cores warns; devices=<cores> or allow_cpu_oversubscription=True does not."""
    monkeypatch.setattr(launching.os, "sched_getaffinity", lambda pid: {0, 1})
    with pytest.warns(UserWarning, match=r"Pass devices=2 or fewer .*MyDDPStrategy\(allow_cpu_oversubscription=True\)"):
        launching.check_cpu_processes(3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        launching.check_cpu_processes(2)
        launching.check_cpu_processes(
            3, allow_oversubscription=MyDDPStrategy(allow_cpu_oversubscription=True)._options.allow_cpu_oversubscription
        )


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_more_cpu_processes_than_cores_run_with_one_warning(tmp_path):
    """devices=3 pinned to 2 cores (popen launcher): the fit runs on 3 ranks with identical final weights, and
    rank 0 alone warns once about the oversubscription."""
    proc = start_session(
        [sys.executable, str(SCRIPTS / "fit_once.py"), str(tmp_path), "cpu3"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    code, out = finish(proc, 240)
    assert code == 0, out[-3000:]
    assert out.count("Trainer(devices=3) on CPU starts 3 processes, but only 2 CPU cores") == 1, out[-3000:]
    ranks = load_ranks(tmp_path, 3)
    assert [r["world_size"] for r in ranks] == [3, 3, 3]
    for rec in ranks[1:]:
        assert all(torch.equal(v, rec["final"][k]) for k, v in ranks[0]["final"].items())


def test_fork_with_cuda_is_refused_before_forking_and_the_suggestions_pass_the_check(monkeypatch):
    """Forking CUDA ranks from a parent that initialised CUDA is refused before forking; the suggested
    start_method='spawn' or 'popen' (a fresh interpreter) passes the check, and CPU ranks may fork."""
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(
        RuntimeError,
        match="start_method='fork' cannot start CUDA ranks: CUDA is already initialised"
        ".*use start_method='spawn' or 'popen'",
    ):
        launching.check_fork_safe("fork", "cuda")
    for method in ("spawn", "popen"):
        launching.check_fork_safe(method, "cuda")
        MyDDPStrategy(start_method=method)
    launching.check_fork_safe("fork", "cpu")  # CPU ranks never touch CUDA
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=MyDDPStrategy(start_method="fork"), logger=False)
    calls = []
    monkeypatch.setattr(launching, "check_fork_safe", lambda *a: calls.append(a) or 1 / 0)
    with pytest.raises(ZeroDivisionError):
        trainer.strategy.launcher.launch(lambda: None, trainer=trainer)
    assert calls == [("fork", "cpu")]  # the launcher asks before it forks


def test_backend_errors_and_their_suggestions_resolve_to_gloo_on_cpu():
    """nccl on CPU (at Trainer(...)) and an unknown name (at the join) are refused with what to do instead; the
    suggested 'gloo' and None give gloo."""
    cpu = torch.device("cpu")
    with pytest.raises(
        ValueError,
        match=r"process_group_backend='nccl' needs CUDA devices.* Use"
        r" process_group_backend='gloo' \(or None\)",
    ):
        pl.Trainer(accelerator="cpu", devices=1, strategy=MyDDPStrategy(process_group_backend="nccl"), logger=False)
    with pytest.raises(ValueError, match="Unknown process_group_backend='glooo'.* or leave it as None"):
        process_group.resolve_backend(cpu, "glooo")
    assert process_group.resolve_backend(cpu, "gloo") == process_group.resolve_backend(cpu, None) == "gloo"
