"""Bad strategy arguments, launch variables and CLI values: a clear error naming the input, raised early.

Input Lightning's own DDPStrategy accepts stays accepted (checked alongside each refusal). Hypothesis runs
derandomized (fixed seed) with a bounded number of examples; benchmarks/fuzz_inputs.py sweeps more.
"""

from __future__ import annotations

import os
import warnings
from datetime import timedelta

import lightning.pytorch as pl
import pytest
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lightning.fabric.plugins.environments import LightningEnvironment, TorchElasticEnvironment

from ddp_strategy import MyDDPStrategy
from ddp_strategy.process.launching import check_launch_env

FUZZ = settings(max_examples=40, derandomize=True, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.parametrize(("kwargs", "error", "named"), [
    ({"timeout": "5"}, TypeError, "timeout"),
    ({"timeout": -1}, ValueError, "timeout must be positive"),
    ({"timeout": float("nan")}, ValueError, "timeout must be a finite number"),
    ({"timeout": float("inf")}, ValueError, "timeout must be a finite number"),
    ({"monitored_barrier_timeout": 0}, ValueError, "timeout must be positive"),
    ({"start_method": 3}, TypeError, "start_method"),
    ({"start_method": "thread"}, ValueError, "start_method"),
    ({"process_group_backend": ["gloo"]}, TypeError, "process_group_backend"),
    ({"process_group_backend": "glooo"}, ValueError, "process_group_backend"),
    ({"seed": "1"}, TypeError, "seed"),
    ({"seed": 2**70}, ValueError, "seed must be between 0 and"),
    ({"seed": -1}, ValueError, "seed must be between 0 and"),
    ({"init_method": 5}, TypeError, "init_method"),
    ({"init_method": "http://x"}, ValueError, "init_method"),
    ({"store": "localhost:1234"}, TypeError, "store"),
    ({"allow_cpu_oversubscription": "yes"}, TypeError, "allow_cpu_oversubscription"),
    ({"checkpoint_on_sigterm": 3}, TypeError, "checkpoint_on_sigterm"),
    ({"checkpoint_on_sigterm": ""}, ValueError, "checkpoint_on_sigterm"),
    ({"verify_sync_every_n_steps": 0}, ValueError, "verify_sync_every_n_steps"),
    ({"verify_sync_every_n_steps": 2.5}, TypeError, "verify_sync_every_n_steps"),
    ({"bucket_cap_mb": "25"}, TypeError, "bucket_cap_mb"),
    ({"bucket_size": 25}, TypeError, "unknown DistributedDataParallel option"),
    ({"ddp_comm_hook": "zip"}, ValueError, "ddp_comm_hook"),
])
def test_bad_strategy_arguments_are_refused_in_init_naming_the_argument(kwargs, error, named):
    """Each mistyped or out-of-range argument raises TypeError/ValueError in MyDDPStrategy(...) naming it."""
    with pytest.raises(error, match=named):
        MyDDPStrategy(**kwargs)


def test_what_lightning_accepts_is_still_accepted():
    """Lightning-compatible values construct fine: timedelta or seconds, numpy-like ints, truthy DDP flags (warned)."""
    strategy = MyDDPStrategy(timeout=timedelta(seconds=30), monitored_barrier_timeout=2.5, seed=7, bucket_cap_mb=1,
                             start_method="spawn", process_group_backend="gloo", init_method="tcp://127.0.0.1:1",
                             store=None, checkpoint_on_sigterm=True, verify_sync_every_n_steps=3)
    assert strategy._options.barrier_timeout == timedelta(seconds=2.5)
    assert strategy._options.timeout == timedelta(seconds=30)
    MyDDPStrategy(store=dist.HashStore(), start_method="fork")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        MyDDPStrategy(find_unused_parameters=1, static_graph=0)  # ints: what DDP reads as bools, silently
        assert not [w for w in caught if "not True or False" in str(w.message)]
        MyDDPStrategy(find_unused_parameters="false")  # Lightning passes it on; DDP reads it as True
    assert any("find_unused_parameters='false') is not True or False" in str(w.message) for w in caught)


# ------------------------------------------------------------------------------- launch variables
LAUNCH_VARIABLES = ("MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK")
_values = st.one_of(st.just(""), st.text(max_size=6), st.integers(-(2**40), 2**40).map(str),
                    st.sampled_from([" 1", "+1", "1_0", "0x10", "1.0", "１", "65536", "-1", "0"]))


def _accepted_by_lightning(env, environ: dict[str, str]) -> bool:
    """Whether Lightning's own environment parses every variable it reads from ``environ`` (its int())."""
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(environ)
    try:
        env.local_rank(), env.node_rank(), env.world_size(), env.global_rank()
        if "MASTER_PORT" in environ:
            env.main_port  # noqa: B018 (a property that parses MASTER_PORT)
        return True
    except (ValueError, KeyError):
        return False
    finally:
        os.environ.clear()
        os.environ.update(saved)


@FUZZ
@given(environ=st.dictionaries(st.sampled_from(LAUNCH_VARIABLES), _values, max_size=5),
       elastic=st.booleans())
def test_launch_variables_fuzz(environ, elastic):
    """Any values: accepted, or ValueError naming the variable and value; never another error type.

    What Lightning's int() cannot parse is always refused; what it parses and is in range is accepted.
    """
    env = TorchElasticEnvironment() if elastic else LightningEnvironment()
    if elastic:
        environ = {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", **environ}
    try:
        check_launch_env(env, num_nodes=1, num_processes=2, environ=environ)
        accepted = True
    except ValueError as e:
        accepted = False
        message = str(e)
        assert any(f"{name}={environ.get(name)!r}" in message for name in environ) or "GROUP_RANK" in message, message
    if not _accepted_by_lightning(env, environ):
        assert not accepted, environ


@pytest.mark.parametrize(("variable", "value", "words"), [
    ("MASTER_PORT", "", "MASTER_PORT='' is empty"),
    ("MASTER_PORT", "http", "MASTER_PORT='http' is not a whole number"),
    ("MASTER_PORT", "70000", "MASTER_PORT='70000' is out of range"),
    ("LOCAL_RANK", "-1", "LOCAL_RANK='-1' is out of range"),
    ("NODE_RANK", "abc", "NODE_RANK='abc' is not a whole number"),
])
def test_a_bad_launch_variable_fails_in_trainer_construction(monkeypatch, variable, value, words):
    """Trainer(strategy=MyDDPStrategy()) raises the named ValueError before launching; unsetting it (the fix) works."""
    def build() -> pl.Trainer:
        return pl.Trainer(accelerator="cpu", devices=2, strategy=MyDDPStrategy(allow_cpu_oversubscription=True),
                          logger=False, enable_progress_bar=False, enable_model_summary=False)

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
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=MyDDPStrategy(allow_cpu_oversubscription=True),
                         logger=False, enable_progress_bar=False, enable_model_summary=False)
    assert trainer.strategy.cluster_environment.main_port == 29500
