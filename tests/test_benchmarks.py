"""The benchmark scripts that must keep working between their runs: ``benchmarks/gpu_check.py``'s dry run, and
``benchmarks/bench_scale.py`` at 8 processes (slow), whose connection counts are issue 49's bound.

The scripts run as a user runs them, ``python benchmarks/<script>.py`` in a fresh interpreter, in a folder of their
own; nothing here imports them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: gpu_check.py's parts after its self-check, in order: each prints one line.
GPU_PARTS = ["cuda-tests", "fit", "bf16", "sync-bn", "comm-hooks", "sync-debug", "two-ranks", "timing"]


def test_gpu_check_dry_run_skips_every_gpu_part_with_its_reason_and_passes_its_self_check(tmp_path):
    """Without CUDA, ``gpu_check.py`` prints one SKIPPED line per GPU part naming the missing device, passes its
    self-check (every fit's Trainer built on the CPU, the timing tables rendered from fake step times), writes its
    JSON and nothing else, and exits 0."""
    report = tmp_path / "gpu_check.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--json", str(report)],
        cwd=tmp_path,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [line for line in proc.stdout.splitlines() if not line.startswith("#")]
    assert lines[0].startswith("PASS self-check: imports; 10 fits of 5 checks built on the CPU;"), proc.stdout
    assert [line.split(":")[0] for line in lines[1:]] == [f"SKIPPED {part}" for part in GPU_PARTS]
    assert all(": no CUDA device (torch " in line and "CUDA_VISIBLE_DEVICES ''" in line for line in lines[1:])
    payload = json.loads(report.read_text())
    assert [(p["part"], p["status"]) for p in payload["parts"]] == [("self-check", "PASS")] + [
        (part, "SKIPPED") for part in GPU_PARTS
    ]
    assert payload["timing"] is None
    fake = payload["fake_timing_markdown"]  # 4.00, 4.40 and 4.43 ms per step, then 2% more in the second round
    assert "| gpu | 1 | MyDDPStrategy | 4.47 | 4.43–4.52 | 4.43 / 4.52 |" in fake
    assert "| 1 | 1.007 (1.007–1.007) | 1.107 (1.107–1.108) | ✓ |" in fake
    assert sorted(path.name for path in tmp_path.iterdir()) == ["gpu_check.json"]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_at_8_processes_a_fit_holds_the_world_groups_connections_plus_a_small_constant(tmp_path):
    """``benchmarks/bench_scale.py`` at W = 8, Lightning's ``ddp`` beside ``MyDDPStrategy`` (issue 49): after set-up
    (the first step's start, past the first epoch barrier) our processes hold on average at most 4 more TCP connections
    than Lightning's (the world group's full mesh and the store's), every rank but 0 at most 4 more, and no group
    connects a full mesh of its own; a steady step makes no store operation and no world-group collective but the
    gradient bucket and whatever Lightning's own loop makes (its SIGTERM broadcast). (Before issue 49 each rank held
    W - 1 = 7 more.)"""
    report = tmp_path / "scale.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_scale.py"), "--world-sizes", "8", "--impls",
         "lightning,ours", "--json", str(report)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=880,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {row["impl"]: row for row in json.loads(report.read_text())["rows"]}
    ours, lightning = rows["ours"], rows["lightning"]
    for key in ("tcp", "tcp_end"):  # after set-up; at the last step, the pairs connected on first use included
        assert len(ours[key]) == len(lightning[key]) == 8
        assert sum(ours[key]) / 8 <= sum(lightning[key]) / 8 + 4, (key, ours[key], lightning[key])
        assert all(o <= ref + 4 for o, ref in zip(ours[key][1:], lightning[key][1:], strict=True)), key
    for step in ours["step"]:
        assert step["store"] == {} and set(step["world"]) == {"grad"}, step
