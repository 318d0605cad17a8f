"""Shared fixtures: every test leaves no process group, no changed environment, no child process, no stray file."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import time
from pathlib import Path

import psutil
import pytest
import torch
import torch.distributed as dist

from ddp_strategy.process import failures

# One Lightning namespace per process (ddp_strategy._compat.namespace): pin the one the test files are written
# against (pytest's __main__ names none). tests/_compat/test_namespace.py clears it for its user processes.
if all(importlib.util.find_spec(name) is not None for name in ("lightning", "pytorch_lightning")):
    os.environ.setdefault("DDP_STRATEGY_LIGHTNING", "lightning")


# Child processes that may outlive a test by design: multiprocessing's resource tracker and forkserver.
_LONG_LIVED_HELPERS = ("resource_tracker", "forkserver", "semaphore_tracker")


def _child_pids() -> dict[int, str]:
    """Live (non-zombie) child processes of this process: pid -> command line."""
    children: dict[int, str] = {}
    for child in psutil.Process().children():
        with contextlib.suppress(psutil.Error):  # gone, or a zombie (whose command line cannot be read)
            cmdline = " ".join(child.cmdline())
            if child.status() != psutil.STATUS_ZOMBIE and not any(h in cmdline for h in _LONG_LIVED_HELPERS):
                children[child.pid] = cmdline
    return children


@pytest.fixture(autouse=True)
def seeded_random_generators():
    """Seed Python's, NumPy's and torch's global generators before every test, so no test depends on luck.

    Tests that need their own stream use a seeded ``torch.Generator`` / ``random.Random``; this covers the
    unseeded ``torch.rand(...)`` inputs and model initialisations of the rest.
    """
    import random

    import numpy as np

    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True, scope="module")
def module_environment():
    """Restore os.environ after each module: a module-scoped fixture's in-process fit (Lightning's launcher sets
    MASTER_PORT, LOCAL_RANK, ... and leaves them, under ddp and ours) is set up before :func:`clean_process_state`
    takes its copy, and a later module's user process inheriting LOCAL_RANK would wait for ranks never launched."""
    env_before = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(env_before)


@pytest.fixture(autouse=True)
def clean_process_state():
    """Destroy any process group (and a failed run's kept store), restore os.environ, and fail on leftover
    children or files in the cwd."""
    env_before = dict(os.environ)
    cwd = Path.cwd()
    files_before = set(os.listdir(cwd))
    threads_before = torch.get_num_threads()
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    failures.KEPT_STORES.clear()  # a failed run's store, kept for this process's next run, ends with its test
    os.environ.clear()
    os.environ.update(env_before)
    torch.set_num_threads(threads_before)
    deadline = time.monotonic() + 10.0
    while (left := _child_pids()) and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in left:  # fail this test, but do not let its orphans fail every test after it
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
    assert not left, f"test left child processes alive: {left}"
    stray = set(os.listdir(cwd)) - files_before - {".hypothesis"}  # Hypothesis's cache (st.text's charmap)
    assert not stray, f"test left files in {cwd}: {sorted(stray)}"


@pytest.fixture
def world_of_one():
    """A gloo process group of one process (rank 0 of 1, an in-memory store) in this process, so real
    DistributedDataParallel wrappers can be built; destroyed after the test."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()
