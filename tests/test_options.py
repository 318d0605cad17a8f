"""MyDDPStrategy's arguments (ddp_strategy/options.py): a bad one is refused in ``MyDDPStrategy(...)`` with an
error naming it, and each fix the error suggests is accepted (and, where it changes how a fit runs, fits).

Input Lightning's own DDPStrategy accepts stays accepted. Launch variables are checked in
tests/process/test_launch_errors.py, CLI values in tests/test_cli.py.
"""

from __future__ import annotations

import importlib
import inspect
import warnings
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from ddp_testing import Regressor, fit_steps, free_port
from torch.nn.parallel import DistributedDataParallel

from ddp_strategy import MyDDPStrategy
from ddp_strategy.sync.comm_hooks import HOOKS_BY_NAME, CommHookConfig

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize(
    ("kwargs", "error", "named"),
    [
        ({"timeout": "5"}, TypeError, "timeout"),
        ({"timeout": 0}, ValueError, "timeout must be positive"),
        ({"timeout": -1}, ValueError, "timeout must be positive"),
        ({"timeout": float("nan")}, ValueError, "timeout must be a finite number"),
        ({"timeout": float("inf")}, ValueError, "timeout must be a finite number"),
        ({"monitored_barrier_timeout": 0}, ValueError, "timeout must be positive"),
        ({"start_method": 3}, TypeError, "start_method"),
        ({"start_method": "thread"}, ValueError, "Unknown start_method='thread'"),
        ({"process_group_backend": ["gloo"]}, TypeError, "process_group_backend"),
        ({"seed": "1"}, TypeError, "seed"),
        ({"seed": 2**70}, ValueError, "seed must be between 0 and"),
        ({"seed": -1}, ValueError, "seed must be between 0 and"),
        ({"init_method": 5}, TypeError, "init_method"),
        ({"init_method": "http://x"}, ValueError, "init_method"),
        ({"store": "localhost:1234"}, TypeError, "store"),
        ({"allow_cpu_oversubscription": "yes"}, TypeError, "allow_cpu_oversubscription"),
        ({"checkpoint_on_sigterm": 3}, TypeError, "checkpoint_on_sigterm"),
        ({"checkpoint_on_sigterm": ""}, ValueError, "checkpoint_on_sigterm"),
        ({"verify_sync_every_n_steps": 0}, ValueError, "verify_sync_every_n_steps must be a positive"),
        ({"verify_sync_every_n_steps": 2.5}, TypeError, "verify_sync_every_n_steps"),
        ({"bucket_cap_mb": "25"}, TypeError, "bucket_cap_mb"),
        ({"bucket_size": 25}, TypeError, "unknown DistributedDataParallel option"),
        ({"find_unused_params": True}, TypeError, "unknown DistributedDataParallel option"),
        ({"ddp_comm_hook": 3}, TypeError, "callable"),
        ({"ddp_comm_state": object()}, TypeError, "without ddp_comm_hook"),
    ],
)
def test_bad_strategy_arguments_are_refused_in_init_naming_the_argument(kwargs, error, named):
    """Each mistyped or out-of-range argument raises TypeError/ValueError in MyDDPStrategy(...) naming it."""
    with pytest.raises(error, match=named):
        MyDDPStrategy(**kwargs)


def test_what_lightning_accepts_is_still_accepted():
    """Lightning-compatible values construct fine: timedelta or seconds, numpy-like ints, truthy DDP flags (warned)."""
    strategy = MyDDPStrategy(
        timeout=timedelta(seconds=30),
        monitored_barrier_timeout=2.5,
        seed=7,
        bucket_cap_mb=1,
        start_method="spawn",
        process_group_backend="gloo",
        init_method="tcp://127.0.0.1:1",
        store=None,
        checkpoint_on_sigterm=True,
        verify_sync_every_n_steps=3,
    )
    assert strategy._options.barrier_timeout == timedelta(seconds=2.5)
    assert strategy._options.timeout == timedelta(seconds=30)
    MyDDPStrategy(store=dist.HashStore(), start_method="fork")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        MyDDPStrategy(find_unused_parameters=1, static_graph=0)  # ints: what DDP reads as bools, silently
        assert not [w for w in caught if "not True or False" in str(w.message)]
        MyDDPStrategy(find_unused_parameters="false")  # Lightning passes it on; DDP reads it as True
    assert any("find_unused_parameters='false') is not True or False" in str(w.message) for w in caught)


# ------------------------------------------------------------------ errors and their suggested fixes
def test_store_with_spawn_error_suggestions_work(tmp_path):
    """store= with start_method='spawn' is refused; 'fork' or 'popen' with a FileStore, or init_method='file://'
    with 'spawn', is accepted, and the FileStore and file:// rendezvous train in this process (popen)."""
    with pytest.raises(
        ValueError, match="store= cannot be used with start_method='spawn'.* Use start_method='fork' or 'popen'"
    ):
        MyDDPStrategy(store=torch.distributed.FileStore(str(tmp_path / "s0"), 1), start_method="spawn")
    MyDDPStrategy(store=torch.distributed.FileStore(str(tmp_path / "s1"), 1), start_method="fork")
    popen = MyDDPStrategy(timeout=30, store=torch.distributed.FileStore(str(tmp_path / "s2"), 1), start_method="popen")
    assert fit_steps(tmp_path, Regressor(), popen) == 3
    MyDDPStrategy(init_method=f"file://{tmp_path / 'rdzv0'}", start_method="spawn")
    file_init = MyDDPStrategy(timeout=30, init_method=f"file://{tmp_path / 'rdzv1'}", start_method="popen")
    assert fit_steps(tmp_path, Regressor(), file_init) == 3


def test_init_method_error_suggestions_are_accepted(tmp_path):
    """A URL without a port or of another scheme is refused; each suggested form is accepted, and tcp:// fits."""
    with pytest.raises(ValueError, match="has no port.*write it as 'tcp://host:port'"):
        MyDDPStrategy(init_method="tcp://127.0.0.1")
    with pytest.raises(
        ValueError,
        match="init_method='http://127.0.0.1:80' is not supported.*use 'env://' .* or pass"
        " a torch.distributed Store as store=",
    ):
        MyDDPStrategy(init_method="http://127.0.0.1:80")
    for url in ("env://", "tcp://127.0.0.1:29500", f"file://{tmp_path}/x"):
        MyDDPStrategy(init_method=url)
    tcp = MyDDPStrategy(timeout=30, init_method=f"tcp://127.0.0.1:{free_port()}")
    assert fit_steps(tmp_path, Regressor(), tcp) == 3


def test_comm_hook_and_ddp_option_error_suggestions_are_accepted(tmp_path):
    """An unknown hook name or DDP option is refused; every listed hook name and DDP option is accepted (they
    are this PyTorch's), a wrapper with its hook is accepted, and a listed hook fits."""
    for unknown in ("fp32", "int8", "zip"):
        with pytest.raises(
            ValueError,
            match=rf"Unknown ddp_comm_hook='{unknown}'.*use one of \['allreduce', 'bf16',"
            r" 'fp16', 'powersgd'\]",
        ):
            MyDDPStrategy(ddp_comm_hook=unknown)
    for name in HOOKS_BY_NAME:
        MyDDPStrategy(ddp_comm_hook=name)
    wrapper = importlib.import_module("torch.distributed.algorithms.ddp_comm_hooks.default_hooks").fp16_compress_wrapper
    with pytest.raises(TypeError, match="pass the hook too"):
        CommHookConfig(wrapper=wrapper)
    CommHookConfig(hook="allreduce", wrapper=wrapper)
    with pytest.raises(TypeError, match="valid options are") as error:
        MyDDPStrategy(bucket_size_mb=25)
    listed = eval(str(error.value).split("valid options are ")[1].rstrip("."))  # the list the message prints
    assert set(listed) <= set(inspect.signature(DistributedDataParallel.__init__).parameters)
    assert "bucket_cap_mb" in listed
    assert fit_steps(tmp_path, Regressor(), MyDDPStrategy(timeout=30, ddp_comm_hook="fp16", bucket_cap_mb=1)) == 3
