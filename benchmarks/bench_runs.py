"""Launching the references: one run in fresh processes, and every run interleaved.

:func:`run_one` starts ``ddp_worker.py`` for one implementation, workload and world
size in its own process group, kills whatever outlives ``--timeout``, and reads
back each rank's ``rank<N>.json`` into a :class:`RunResult`; :func:`run_all` runs
every configuration in the interleaved order and reports progress to stderr.
Imports neither a worker nor Lightning (the workers run in the launched processes).
"""

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

WORKER = Path(__file__).resolve().parent / "ddp_worker.py"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_SCRUB = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "LOCAL_RANK",
    "RANK",
    "WORLD_SIZE",
    "NODE_RANK",
    "GROUP_RANK",
    "LOCAL_WORLD_SIZE",
    "PL_GLOBAL_SEED",
    "PL_SEED_WORKERS",
    "OMP_NUM_THREADS",
)


@dataclass
class RunResult:
    """Outcome of one launch (one implementation, workload, world size, repeat)."""

    impl: str
    workload: str
    world_size: int
    repeat: int
    order: int  # position within its interleaved block
    ok: bool
    wall_s: float  # launch to exit of the launched process, seconds
    ranks: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None
    load_avg: float = float("nan")  # 1-minute load average just before the launch


def _kill_group(pgid: int) -> None:
    """SIGKILL the process group this script created for one run (its ranks included)."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_one(
    impl: str,
    workload: str,
    world_size: int,
    steps: int,
    args: argparse.Namespace,
    repeat: int,
    order: int,
    extra: tuple[str, ...] = (),
) -> RunResult:
    """Launch one configuration in a fresh process group and collect each rank's JSON.

    Start-up is measured from just before ``Popen``; the launched process (and
    every rank it starts) is killed if it outlives ``args.timeout`` seconds.
    ``extra``: more ``ddp_worker.py`` arguments (``("--data", "uneven")``).
    """
    with tempfile.TemporaryDirectory(prefix="bench_ddp_") as tmp:
        out_dir = Path(tmp) / "out"
        env = {k: v for k, v in os.environ.items() if k not in _SCRUB}
        threads = max(1, args.cores // world_size)
        env.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(_free_port()),
            OMP_NUM_THREADS=str(threads),
            PYTHONUNBUFFERED="1",
        )
        cmd = [
            sys.executable,
            str(WORKER),
            "--impl",
            impl,
            "--workload",
            workload,
            "--world-size",
            str(world_size),
            "--steps",
            str(steps),
            "--seed",
            str(args.seed),
            "--device",
            args.device,
            "--out-dir",
            str(out_dir),
            "--pg-timeout",
            str(args.pg_timeout),
            *extra,
        ]
        log_path = Path(tmp) / "log.txt"
        load_avg = os.getloadavg()[0]
        with log_path.open("wb") as log:
            env["BENCH_LAUNCH_TIME"] = repr(time.time())
            t0 = time.perf_counter()
            proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            error = None
            try:
                rc = proc.wait(timeout=args.timeout)
                if rc != 0:
                    error = f"exit code {rc}"
            except subprocess.TimeoutExpired:
                error = f"timed out after {args.timeout:.0f} s"
            except BaseException:
                _kill_group(proc.pid)
                proc.wait()
                raise
            finally:
                wall = time.perf_counter() - t0
                _kill_group(proc.pid)  # no rank outlives its run, whatever happened
                proc.wait()
        ranks = []
        for r in range(world_size):
            path = out_dir / f"rank{r}.json"
            if path.exists():
                ranks.append(json.loads(path.read_text()))
            elif error is None:
                error = f"rank {r} wrote no result"
        if error is not None:
            tail = log_path.read_text(errors="replace").strip().splitlines()[-15:]
            error = error + "\n    " + "\n    ".join(tail)
        return RunResult(impl, workload, world_size, repeat, order, error is None, wall, ranks, error, load_avg)


def run_all(args: argparse.Namespace, impls: list[str]) -> list[RunResult]:
    """Every configuration, interleaved: repeat > workload > world size > implementations back to back."""
    results: list[RunResult] = []
    block = 0
    total = args.repeats * len(args.workload_list) * len(args.world_size_list) * len(impls)
    for repeat in range(args.repeats):
        for w in args.workload_list:
            for ws in args.world_size_list:
                k = block % len(impls)
                order = impls[k:] + impls[:k]  # rotate so each impl takes each slot equally often
                block += 1
                for pos, impl in enumerate(order):
                    res = run_one(impl, w, ws, args.steps_for[w], args, repeat, pos)
                    results.append(res)
                    status = "ok" if res.ok else f"FAILED: {res.error}"
                    print(
                        f"[{len(results)}/{total}] repeat {repeat} {w} ranks={ws} {impl}: {res.wall_s:.1f} s {status}",
                        file=sys.stderr,
                        flush=True,
                    )
    return results
