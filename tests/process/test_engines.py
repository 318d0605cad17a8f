"""Engines that start every rank themselves, each started here as that engine starts it: two pods of a Kubeflow
PyTorchJob (``KubeflowEnvironment``), two ``jsrun`` tasks of an LSF job (``LSFEnvironment``), and
``mpirun -np 2`` (Open MPI, ``MPIEnvironment``). The same user script (tests/scripts/engine_fit.py) runs under
``strategy="ddp"`` and ``MyDDPStrategy()``; the values are compared: the ranks the environment gives, each training
sample read once per epoch across the ranks, the same final weights on every rank under both strategies, and (ours)
the validation accuracy over the whole validation set, as one process computes it.

Marked ``engines`` (``.ci/run`` runs them; the README's quick command leaves them out); the MPI case skips without
``mpirun`` or ``mpi4py``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from ddp_testing import free_port, load_ranks, session_members, start_session

from ddp_strategy import DigitsDataModule, DigitsNet
from ddp_strategy.testing import assert_each_sample_once, assert_matches_single_process, assert_same_on_every_rank

pytestmark = [pytest.mark.engines, pytest.mark.multiprocess, pytest.mark.timeout(420)]

SCRIPT = Path(__file__).parent.parent / "scripts" / "engine_fit.py"
#: Variables of launchers and schedulers that the test's own environment may hold (a CI job under SLURM or
#: torchrun): left out, so that each rank sees only what its engine sets.
LAUNCHER_VARIABLES = (
    "WORLD_SIZE",
    "RANK",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "NODE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
)
LAUNCHER_PREFIXES = ("SLURM_", "LSB_", "JSM_", "OMPI_", "PMIX_", "TORCHELASTIC_", "KUBERNETES_")
#: Each engine: the environment class every rank must report, and its (world size, global, local, node rank) per rank.
EXPECTED = {
    "kubeflow": ("KubeflowEnvironment", [(2, 0, 0, 0), (2, 1, 0, 1)]),  # one process per pod: a pod is a node
    "lsf": ("LSFEnvironment", [(2, 0, 0, 0), (2, 1, 1, 0)]),  # two tasks on one host
    "mpi": ("MPIEnvironment", [(2, 0, 0, 0), (2, 1, 1, 0)]),
}
TRAIN_SAMPLES = 1438  # DigitsDataModule's training split


def _clean_environment() -> dict[str, str]:
    """This process's environment without any launcher's or scheduler's variables."""
    return {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES and not k.startswith(LAUNCHER_PREFIXES)}


def _start_ranks(
    out: Path, strategy: str, engine: str, variables: dict[str, str], rank_variables: tuple[str, ...]
) -> list[subprocess.Popen]:
    """Two ranks of the user script started as ``engine`` starts them, each in a session of its own: the clean
    environment plus the engine's ``variables``, and each of ``rank_variables`` set to the process's rank."""
    return [
        start_session(
            [sys.executable, str(SCRIPT), str(out), strategy, engine],
            cwd=out,
            env={**_clean_environment(), **variables, **dict.fromkeys(rank_variables, str(rank))},
        )
        for rank in range(2)
    ]


def _kubeflow_pods(out: Path, strategy: str) -> list[subprocess.Popen]:
    """A PyTorchJob of one Master and one Worker replica: each pod runs ``python train.py`` with what Kubeflow's
    training operator sets (kubeflow/training-operator, pkg/controller.v1/pytorch/envvar.go and master.go:
    ``MASTER_ADDR``, the master's headless service, which resolves to the master pod; ``MASTER_PORT``;
    ``WORLD_SIZE``, the number of replicas; ``RANK``, 0 for the master and 1 + index for a worker;
    ``PYTHONUNBUFFERED``) and what Kubernetes sets in every pod (``KUBERNETES_SERVICE_HOST``, ...). Here both
    "pods" are on this machine, the service name is its hostname."""
    pod = {
        "MASTER_ADDR": socket.gethostname(),
        "MASTER_PORT": str(free_port()),
        "WORLD_SIZE": "2",
        "PYTHONUNBUFFERED": "0",
        "KUBERNETES_SERVICE_HOST": "10.96.0.1",
        "KUBERNETES_SERVICE_PORT": "443",
        "KUBERNETES_PORT": "tcp://10.96.0.1:443",
    }
    return _start_ranks(out, strategy, "kubeflow", pod, ("RANK",))


def _lsf_job_id() -> int:
    """An LSF job id whose port (``LSFEnvironment``: ``10000 + LSB_JOBID % 1000``, as jsrun sets no port) is free."""
    for offset in random.Random(os.getpid()).sample(range(1000), 1000):
        with socket.socket() as s, contextlib.suppress(OSError):
            s.bind(("", 10000 + offset))
            return 4_831_000 + offset
    raise AssertionError("no free port in 10000..10999 for an LSF job id")


def _jsrun_tasks(out: Path, strategy: str) -> list[subprocess.Popen]:
    """``jsrun -n 2`` on one host of an LSF job: LSF's job variables (``LSB_JOBID``; ``LSB_DJOB_RANKFILE``, the
    rank file: the launch node first, then one line per task) and what jsrun sets per task
    (``JSM_NAMESPACE_SIZE``, ``_RANK``, ``_LOCAL_RANK``, ``_LOCAL_SIZE``); no ``MASTER_ADDR``/``MASTER_PORT``."""
    host = socket.gethostname()
    rankfile = out / "rankfile"
    rankfile.write_text(f"launch-node\n{host}\n{host}\n")
    job = {
        "LSB_JOBID": str(_lsf_job_id()),
        "LSB_DJOB_RANKFILE": str(rankfile),
        "LSB_DJOB_HOSTFILE": str(rankfile),
        "JSM_NAMESPACE_SIZE": "2",
        "JSM_NAMESPACE_LOCAL_SIZE": "2",
    }
    return _start_ranks(out, strategy, "lsf", job, ("JSM_NAMESPACE_RANK", "JSM_NAMESPACE_LOCAL_RANK"))


def _mpirun(out: Path, strategy: str) -> list[subprocess.Popen]:
    """``mpirun -np 2 python train.py`` (Open MPI; as root it needs ``--allow-run-as-root``; ``--oversubscribe``
    lets 2 ranks start on a 1-core runner)."""
    root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    command = ["mpirun", "-np", "2", "--oversubscribe", *root, sys.executable, str(SCRIPT), str(out), strategy, "mpi"]
    return [start_session(command, cwd=out, env=_clean_environment())]


ENGINES = {"kubeflow": _kubeflow_pods, "lsf": _jsrun_tasks, "mpi": _mpirun}


def _finish(procs: list[subprocess.Popen], timeout: float) -> None:
    """Wait for every process; on overrun kill every process of their sessions (mpirun's ranks lead process groups
    of their own, so a group kill misses them) and fail. Fail unless each exited 0 and left nothing running."""
    try:
        outputs = [proc.communicate(timeout=timeout)[0] for proc in procs]
    except subprocess.TimeoutExpired:
        for proc in procs:
            for pid in session_members(proc.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            proc.communicate()
        raise AssertionError(f"{procs[0].args} did not finish in {timeout} s") from None
    for proc, output in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, f"{proc.args} exited with {proc.returncode}:\n{output[-4000:]}"
        assert session_members(proc.pid) == [], f"{proc.args} left processes running"


@pytest.fixture(scope="module", params=sorted(ENGINES))
def engine_runs(request, tmp_path_factory) -> tuple[str, dict[str, list[dict]]]:
    """Start the engine's 2 ranks on the user script under each strategy, one after the other; return the engine
    and ``{"ddp" | "ours": [rank 0's record, rank 1's]}``."""
    engine = request.param
    if engine == "mpi" and (shutil.which("mpirun") is None or importlib.util.find_spec("mpi4py") is None):
        pytest.skip(
            "needs Open MPI's mpirun and mpi4py: apt-get install openmpi-bin libopenmpi-dev and"
            " pip install 'ddp_strategy[mpi]' (.ci/run does both)"
        )
    records = {}
    for strategy in ("ddp", "ours"):
        out = tmp_path_factory.mktemp(f"{engine}_{strategy}")
        _finish(ENGINES[engine](out, strategy), timeout=200)
        records[strategy] = load_ranks(out, 2)
    return engine, records


def _single_process_val_acc(weights: dict[str, torch.Tensor]) -> torch.Tensor:
    """The accuracy of ``weights`` on the whole validation set (359 images), computed in this one process."""
    data = DigitsDataModule()
    data.setup("fit")
    net = DigitsNet()
    net.load_state_dict(weights)
    x, y = data.val_set.tensors
    with torch.no_grad():
        return (net(x).argmax(dim=1) == y).float().mean()


def test_engine_fit_trains_as_under_ddp(engine_runs):
    """Under each engine both strategies see its environment's ranks, read every training sample once per epoch
    across the 2 ranks (reshuffled the next epoch), and end with the same weights on every rank, bitwise equal
    between strategy="ddp" and MyDDPStrategy(). Ours validates exactly: its val_acc is the one-process value over
    all 359 images (ddp's DistributedSampler repeats one image to make 360, so its value differs)."""
    engine, records = engine_runs
    name, ranks = EXPECTED[engine]
    for strategy, per_rank in records.items():
        assert [(r["env"], r["ranks"]) for r in per_rank] == [(name, expected) for expected in ranks], strategy
        for epoch in (0, 1):
            assert_each_sample_once([r["seen"][epoch] for r in per_rank], TRAIN_SAMPLES)
        assert per_rank[0]["seen"][0] != per_rank[0]["seen"][1]
    assert_same_on_every_rank([r["final"] for r in records["ddp"] + records["ours"]], "final weights")
    single = _single_process_val_acc(records["ours"][0]["final"])
    for r in records["ours"]:
        assert_matches_single_process(r["val_acc"], single, "val_acc", atol=0, rtol=0)
    assert records["ddp"][0]["val_acc"] != single
