"""The machine a benchmark runs on: what it is (for the report's first line) and what can run on it.

Used by ``bench_ddp.py`` before any run: :func:`resolve_device` turns ``--device auto``
into ``cpu`` or ``cuda``, :func:`usable_cores` sets the threads per rank, and
:func:`plan_runs` drops what cannot run here (``MyDDPStrategy`` not importable,
more ranks than GPUs) with a note for the report. Imports neither a worker nor
Lightning; ``ddp_strategy`` is tried in a subprocess, through its top-level name only.
"""

import argparse
import os
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any


def machine_info(device: str) -> dict[str, Any]:
    """CPU model, usable cores, memory, library versions and (if used) GPU name."""
    cpu = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_gib = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                mem_gib = round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    info: dict[str, Any] = {
        "cpu": cpu,
        "cores": usable_cores(),
        "memory_gib": mem_gib,
        "os": platform.platform(),
        "python": platform.python_version(),
        "torch": metadata.version("torch"),
        "lightning": metadata.version("lightning"),
        "device": device,
    }
    if device == "cuda":
        import torch

        info["gpu"] = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    return info


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity), else all the machine's cores; at least 1."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def resolve_device(requested: str) -> str:
    """``--device`` as run: ``auto`` becomes ``cuda`` when torch sees a GPU, else ``cpu``; others pass through."""
    if requested != "auto":
        return requested
    try:
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    except ImportError:
        return "cpu"


def _ours_available() -> str | None:
    """None if ``from ddp_strategy import MyDDPStrategy`` works, else the reason it does not."""
    proc = subprocess.run(
        [sys.executable, "-c", "from ddp_strategy import MyDDPStrategy"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if proc.returncode == 0:
        return None
    lines = proc.stderr.strip().splitlines()
    return lines[-1] if lines else f"exit code {proc.returncode}"


def plan_runs(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """Drop what cannot run here (MyDDPStrategy not importable, more ranks than GPUs); return (impls, notes)."""
    notes: list[str] = []
    impls = list(args.impl_list)
    if "ours" in impls:
        reason = _ours_available()
        if reason is not None:
            impls.remove("ours")
            notes.append(f"MyDDPStrategy skipped: `from ddp_strategy import MyDDPStrategy` failed ({reason}).")
    if args.device == "cuda":
        import torch

        n_gpu = torch.cuda.device_count()
        dropped = [ws for ws in args.world_size_list if ws > n_gpu]
        args.world_size_list = [ws for ws in args.world_size_list if ws <= n_gpu]
        if dropped:
            notes.append(f"world sizes {dropped} skipped: only {n_gpu} GPU(s).")
    if not impls or not args.world_size_list:
        raise SystemExit("nothing to run: " + " ".join(notes))
    if args.device == "cpu" and max(args.world_size_list) > args.cores:
        notes.append(f"more ranks ({max(args.world_size_list)}) than cores ({args.cores}): ranks share cores.")
    return impls, notes
