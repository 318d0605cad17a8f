"""Benchmark MyDDPStrategy against Lightning's ``strategy="ddp"`` and a hand-written DDP loop.

Runs, interleaved so machine noise hits all alike, every combination of
workload x world size x implementation, each in fresh processes, then prints
markdown tables and writes JSON::

    python benchmarks/bench_ddp.py                      # default, a few minutes on 2 CPU cores
    python benchmarks/bench_ddp.py --repeats 5 --steps 400 --json /tmp/long.json

Implementations (same model, data, per-device batch, optimizer, seed, world size):
    handwritten  init_process_group + DistributedSampler/set_epoch + DDP + plain loop, mp.spawn
    lightning    lightning.Trainer(strategy=DDPStrategy())   (what strategy="ddp" builds)
    ours         lightning.Trainer(strategy=MyDDPStrategy())

See benchmarks/README.md for what each column means.
"""

import argparse
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
WORKER = HERE / "ddp_worker.py"
sys.path.insert(0, str(HERE))

from bench_workloads import IMPLS, WORKLOADS  # noqa: E402

IMPL_LABEL = {"handwritten": "hand-written", "lightning": "Lightning ddp", "ours": "MyDDPStrategy"}
# Targets from issue 9 (ratios are ours / reference).
STEP_VS_LIGHTNING_MAX = 1.00
STEP_VS_HANDWRITTEN_MAX = 1.10
STARTUP_VS_LIGHTNING_MAX = 1.00
RSS_VS_LIGHTNING_MAX = 1.00
NOISE_FLOOR = 0.02  # smallest tolerance added to the "<= 1.00" targets, as a fraction
# Start-up milestones, seconds since launch, slowest rank: interpreter + imports done, process group
# joined, DDP-wrapped model ready, first step begun, first step done.
STARTUP_MARKS = ("imports", "process_group", "train_start", "first_step_start", "first_step_end")

# Aggregated figures keyed by (workload, world size, impl); see aggregate().
Agg = dict[tuple[str, int, str], dict[str, Any]]


# --------------------------------------------------------------------------- machine


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
        "cores": _usable_cores(),
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


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def _resolve_device(requested: str) -> str:
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


# --------------------------------------------------------------------------- one run


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
    impl: str, workload: str, world_size: int, steps: int, args: argparse.Namespace, repeat: int, order: int
) -> RunResult:
    """Launch one configuration in a fresh process group and collect each rank's JSON.

    Start-up is measured from just before ``Popen``; the launched process (and
    every rank it starts) is killed if it outlives ``args.timeout`` seconds.
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


# --------------------------------------------------------------------------- statistics


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _quantile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    pos = q * (len(s) - 1)
    lo, hi = int(pos), min(int(pos) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def run_summary(res: RunResult, warmup: int) -> dict[str, Any]:
    """Per-run figures; per step, the slowest rank's duration counts (seconds)."""
    steps = [max(vals) for vals in zip(*(r["step_s"] for r in res.ranks), strict=True)][warmup:]
    r0 = res.ranks[0]
    return {
        "steady_step_s": steps,
        "median_step_s": _median(steps),
        "mean_step_s": statistics.fmean(steps),
        "startup_s": max(r["startup_s"] for r in res.ranks),
        "marks_s": {
            **{k: max(r["marks_s"].get(k, float("nan")) for r in res.ranks) for k in STARTUP_MARKS[:3]},
            "first_step_start": max(r["launch_to_first_start_s"] for r in res.ranks),
            "first_step_end": max(r["startup_s"] for r in res.ranks),
        },
        "modules_loaded": max(r["modules_loaded"] for r in res.ranks),
        "peak_rss_mib": max(r["peak_rss_mib"] for r in res.ranks),
        "peak_cuda_mib": max((r["peak_cuda_mib"] or 0) for r in res.ranks) or None,
        "allreduce_bytes_per_step": r0["comm"]["grad_bytes_per_step"] + r0["comm"]["other_all_reduce_bytes_per_step"],
        "grad_bytes_per_step": r0["comm"]["grad_bytes_per_step"],
        "other_collectives_per_step": r0["comm"]["other_calls_per_step"],
        "other_call_sites": r0["comm"]["other_call_sites"],
        "hook_registered": all(r["comm"]["hook_registered"] for r in res.ranks),
        "threads": r0["threads"],
        "final_loss": r0["final_loss"],
        "wall_s": res.wall_s,
    }


def aggregate(results: list[RunResult], args: argparse.Namespace) -> Agg:
    """Pool repeats per (workload, world size, impl): medians, spreads and per-repeat values."""
    groups: dict[tuple[str, int, str], list[RunResult]] = {}
    for res in results:
        groups.setdefault((res.workload, res.world_size, res.impl), []).append(res)
    agg = {}
    for key, runs in groups.items():
        ok = [r for r in runs if r.ok]
        summaries = {r.repeat: run_summary(r, args.warmup) for r in ok}
        pooled = [s for summ in summaries.values() for s in summ["steady_step_s"]]
        w = WORKLOADS[key[0]]
        med = _median(pooled)
        run_meds = [s["median_step_s"] for s in summaries.values()]
        agg[key] = {
            "runs": len(runs),
            "failed": len(runs) - len(ok),
            "per_repeat": summaries,
            "step_ms_median": med * 1e3,
            "step_ms_p25": _quantile(pooled, 0.25) * 1e3,
            "step_ms_p75": _quantile(pooled, 0.75) * 1e3,
            "run_medians_ms": [m * 1e3 for m in run_meds],
            "step_ms_mean": statistics.fmean(pooled) * 1e3 if pooled else float("nan"),
            # from the mean, not the median, so periodic slow steps (epoch boundaries) count
            "samples_per_s": key[1] * w.batch / statistics.fmean(pooled) if pooled else float("nan"),
            "startup_s": _median([s["startup_s"] for s in summaries.values()]),
            "peak_rss_mib": _median([s["peak_rss_mib"] for s in summaries.values()]),
            "peak_cuda_mib": _median([s["peak_cuda_mib"] for s in summaries.values() if s["peak_cuda_mib"]]) or None,
            "allreduce_kib_per_step": _median([s["allreduce_bytes_per_step"] for s in summaries.values()]) / 1024,
            "other_collectives_per_step": _median([s["other_collectives_per_step"] for s in summaries.values()]),
            "final_loss": _median([s["final_loss"] for s in summaries.values() if s["final_loss"] is not None]),
            "hook_registered": all(s["hook_registered"] for s in summaries.values()),
            "startup_marks_s": {m: _median([s["marks_s"][m] for s in summaries.values()]) for m in STARTUP_MARKS},
            "modules_loaded": _median([s["modules_loaded"] for s in summaries.values()]),
        }
    return agg


def _rel_range(xs: list[float]) -> float:
    """(max - min) / median of a list, as a fraction; 0 for fewer than two values."""
    return (max(xs) - min(xs)) / statistics.median(xs) if len(xs) > 1 else 0.0


def ratios(agg: Agg, workload: str, ws: int) -> dict[str, Any] | None:
    """Paired per-repeat ratios ours / reference for step time, start-up and peak RSS.

    Repeats are paired because each repeat ran the implementations back to back.
    Returns the median ratio, its range over repeats, and the tolerance used for
    the "<= 1.00 within noise" targets: the larger of 2% and Lightning's own
    run-to-run spread ((max - min) / median) of that figure.
    """
    ours = agg.get((workload, ws, "ours"))
    if not ours or not ours["per_repeat"]:
        return None
    out: dict[str, Any] = {}
    for ref in ("lightning", "handwritten"):
        base = agg.get((workload, ws, ref))
        if not base:
            continue
        for metric in ("median_step_s", "startup_s", "peak_rss_mib"):
            common = sorted(set(ours["per_repeat"]) & set(base["per_repeat"]))
            rs = [ours["per_repeat"][r][metric] / base["per_repeat"][r][metric] for r in common]
            if not rs:
                continue
            tol = max(NOISE_FLOOR, _rel_range([base["per_repeat"][r][metric] for r in common]))
            out[f"{metric}/{ref}"] = {"median": statistics.median(rs), "min": min(rs), "max": max(rs), "tolerance": tol}
    return out


def verdicts(rat: dict[str, Any]) -> dict[str, bool]:
    """Issue 9's targets, evaluated on the median paired ratios."""
    v = {}
    if "median_step_s/lightning" in rat:
        r = rat["median_step_s/lightning"]
        v["step <= Lightning"] = r["median"] <= STEP_VS_LIGHTNING_MAX + r["tolerance"]
    if "median_step_s/handwritten" in rat:
        v["step <= 1.10 x hand-written"] = rat["median_step_s/handwritten"]["median"] <= STEP_VS_HANDWRITTEN_MAX
    if "startup_s/lightning" in rat:
        r = rat["startup_s/lightning"]
        v["start-up <= Lightning"] = r["median"] <= STARTUP_VS_LIGHTNING_MAX + r["tolerance"]
    if "peak_rss_mib/lightning" in rat:
        r = rat["peak_rss_mib/lightning"]
        v["peak RSS <= Lightning"] = r["median"] <= RSS_VS_LIGHTNING_MAX + r["tolerance"]
    return v


# --------------------------------------------------------------------------- tables


def _md_table(head: list[str], rows: list[list[str]]) -> list[str]:
    """A markdown table as lines, followed by a blank line."""
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    return lines + ["| " + " | ".join(r) + " |" for r in rows] + [""]


def _fmt_ratio(r: dict[str, Any] | None, limit: float | None, noisy: bool = True) -> str:
    """``median (min–max)`` plus ✓/✗ against ``limit``; ``noisy`` adds the ratio's noise tolerance."""
    if r is None:
        return "n/a"
    s = f"{r['median']:.2f}"
    if r["max"] - r["min"] > 0.005:
        s += f" ({r['min']:.2f}–{r['max']:.2f})"
    if limit is not None:
        ok = r["median"] <= limit + (r["tolerance"] if noisy else 0.0)
        s += " ✓" if ok else " ✗"
    return s


def _rows(agg: Agg, args: argparse.Namespace, impls: list[str]) -> list[tuple[str, int, str, dict[str, Any]]]:
    """(workload, ranks, impl, aggregate) in table order, for configurations that ran."""
    return [
        (w, ws, impl, agg[(w, ws, impl)])
        for w in args.workload_list
        for ws in args.world_size_list
        for impl in impls
        if (w, ws, impl) in agg
    ]


def _main_table(agg: Agg, args: argparse.Namespace, impls: list[str]) -> list[str]:
    cuda = args.device == "cuda"
    head = ["workload", "ranks", "implementation", "step ms (median)", "IQR ms", "run medians ms", "mean ms"]
    head += ["samples/s"]
    head += ["launch→1st step s", "peak RSS MiB/rank"] + (["peak GPU MiB/rank"] if cuda else [])
    head += ["all-reduced KiB/step", "other collectives/step", "final loss"]
    rows = []
    for w, ws, impl, a in _rows(agg, args, impls):
        if not a["per_repeat"]:
            rows.append([w, str(ws), IMPL_LABEL[impl], f"failed ({a['failed']}/{a['runs']} runs)"])
            continue
        row = [
            w,
            str(ws),
            IMPL_LABEL[impl] + (f" ({a['failed']} failed)" if a["failed"] else ""),
            f"{a['step_ms_median']:.2f}",
            f"{a['step_ms_p25']:.2f}–{a['step_ms_p75']:.2f}",
            " / ".join(f"{m:.2f}" for m in a["run_medians_ms"]),
            f"{a['step_ms_mean']:.2f}",
            f"{a['samples_per_s']:.0f}",
            f"{a['startup_s']:.2f}",
            f"{a['peak_rss_mib']:.0f}",
        ]
        if cuda:
            row.append(f"{a['peak_cuda_mib']:.0f}" if a["peak_cuda_mib"] else "–")
        row.append(f"{a['allreduce_kib_per_step']:.1f}" if a["hook_registered"] else "unknown")
        row += [f"{a['other_collectives_per_step']:.2f}", f"{a['final_loss']:.4f}"]
        rows.append(row)
    return _md_table(head, rows)


def _ratio_table(agg: Agg, args: argparse.Namespace) -> list[str]:
    head = ["workload", "ranks", "step ÷ Lightning", "step ÷ hand-written", "start-up ÷ Lightning"]
    head += ["start-up ÷ hand-written", "peak RSS ÷ Lightning", "peak RSS ÷ hand-written"]
    rows = []
    for w in args.workload_list:
        for ws in args.world_size_list:
            rat = ratios(agg, w, ws)
            if rat is None:
                continue
            rows.append(
                [
                    w,
                    str(ws),
                    _fmt_ratio(rat.get("median_step_s/lightning"), STEP_VS_LIGHTNING_MAX),
                    _fmt_ratio(rat.get("median_step_s/handwritten"), STEP_VS_HANDWRITTEN_MAX, noisy=False),
                    _fmt_ratio(rat.get("startup_s/lightning"), STARTUP_VS_LIGHTNING_MAX),
                    _fmt_ratio(rat.get("startup_s/handwritten"), None),
                    _fmt_ratio(rat.get("peak_rss_mib/lightning"), RSS_VS_LIGHTNING_MAX),
                    _fmt_ratio(rat.get("peak_rss_mib/handwritten"), None),
                ]
            )
    intro = (
        "Ratios, MyDDPStrategy ÷ reference: median of the per-repeat ratios (range over repeats); ✓/✗ = issue 9 "
        "target met (≤ 1.00 within noise vs Lightning, ≤ 1.10 vs hand-written step time)."
    )
    return [intro, ""] + _md_table(head, rows)


def _startup_table(agg: Agg, args: argparse.Namespace, impls: list[str]) -> list[str]:
    head = ["workload", "ranks", "implementation", "imports", "process group", "DDP ready", "1st step begun"]
    head += ["1st step done", "modules loaded"]
    rows = [
        [w, str(ws), IMPL_LABEL[impl]]
        + [f"{a['startup_marks_s'][k]:.2f}" for k in STARTUP_MARKS]
        + [f"{a['modules_loaded']:.0f}"]
        for w, ws, impl, a in _rows(agg, args, impls)
        if a["per_repeat"]
    ]
    intro = (
        "Start-up breakdown: seconds from launch until the slowest rank has finished its imports, joined the "
        "process group, built the DDP model, begun and finished its first step (median over repeats)."
    )
    return [intro, ""] + _md_table(head, rows)


def _scaling_table(agg: Agg, args: argparse.Namespace, impls: list[str]) -> list[str]:
    lo, hi = min(args.world_size_list), max(args.world_size_list)
    head = ["workload", "implementation", f"samples/s @{lo}", f"samples/s @{hi}", "speed-up", "efficiency"]
    rows = []
    for w in args.workload_list:
        for impl in impls:
            a, b = agg.get((w, lo, impl)), agg.get((w, hi, impl))
            if not a or not b or not a["per_repeat"] or not b["per_repeat"]:
                continue
            sp = b["samples_per_s"] / a["samples_per_s"]
            rows.append(
                [w, IMPL_LABEL[impl], f"{a['samples_per_s']:.0f}", f"{b['samples_per_s']:.0f}", f"{sp:.2f}"]
                + [f"{sp / (hi / lo):.0%}"]
            )
    intro = f"Scaling from {lo} to {hi} ranks (samples/s; efficiency = speed-up ÷ {hi / lo:g})."
    return [intro, ""] + _md_table(head, rows)


def render(agg: Agg, machine: dict[str, Any], args: argparse.Namespace, impls: list[str], notes: list[str]) -> str:
    """The markdown report: machine and settings, then the main, ratio, start-up and scaling tables, notes."""
    gpu = f", {machine['gpu']}" if machine.get("gpu") else ""
    backend = "nccl" if machine["device"] == "cuda" else "gloo"
    lines = [
        f"Machine: {machine['cpu']}, {machine['cores']} cores usable, {machine['memory_gib']} GiB RAM{gpu}; "
        f"Python {machine['python']}, torch {machine['torch']}, lightning {machine['lightning']}; "
        f"device {machine['device']} ({backend}).",
        f"Settings: {args.repeats} repeat(s) interleaved; steps per run "
        + ", ".join(f"{w} {args.steps_for[w]}" for w in args.workload_list)
        + f" (first {args.warmup} excluded as warm-up); per-device batch "
        + ", ".join(f"{w} {WORKLOADS[w].batch}" for w in args.workload_list)
        + f"; OMP_NUM_THREADS = {args.cores} // ranks; seed {args.seed}; total {args.total_s:.0f} s; "
        f"1-minute load average before runs: median {args.load_avg['median']:.1f}, max {args.load_avg['max']:.1f}.",
        "",
    ]
    lines += _main_table(agg, args, impls)
    if "ours" in impls:
        lines += _ratio_table(agg, args)
    lines += _startup_table(agg, args, impls)
    if len(args.world_size_list) > 1:
        lines += _scaling_table(agg, args, impls)
    lines += [f"Note: {n}" for n in notes]
    return "\n".join(lines).rstrip() + "\n"


# --------------------------------------------------------------------------- main


def _csv(kind: type, text: str) -> list:
    return [kind(x) for x in text.split(",") if x.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", default="small,heavy", help=f"comma-separated, from {sorted(WORKLOADS)}")
    p.add_argument("--impls", default=",".join(IMPLS), help="comma-separated, from " + ",".join(IMPLS))
    p.add_argument("--world-sizes", default="1,2", help="comma-separated ranks per run")
    p.add_argument(
        "--steps",
        type=int,
        default=0,
        help="optimizer steps per run, warm-up included (default: per workload, "
        + ", ".join(f"{k} {v.steps}" for k, v in WORKLOADS.items())
        + ")",
    )
    p.add_argument("--warmup", type=int, default=5, help="leading steps excluded from step statistics")
    p.add_argument("--repeats", type=int, default=2, help="interleaved rounds over all configurations")
    p.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="cuda uses NCCL and needs one GPU per rank; auto picks cuda when available",
    )
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--timeout", type=float, default=180.0, help="per-run limit, seconds")
    p.add_argument("--pg-timeout", type=float, default=60.0, help="process-group timeout, seconds")
    p.add_argument("--json", default=str(HERE / "results.json"), help="where to write the results")
    p.add_argument("--markdown", default=None, help="also write the printed tables to this file")
    args = p.parse_args(argv)
    args.workload_list = _csv(str, args.workloads)
    args.impl_list = _csv(str, args.impls)
    args.world_size_list = sorted(set(_csv(int, args.world_sizes)))
    for w in args.workload_list:
        if w not in WORKLOADS:
            p.error(f"unknown workload {w!r}; choose from {sorted(WORKLOADS)}")
    for i in args.impl_list:
        if i not in IMPLS:
            p.error(f"unknown implementation {i!r}; choose from {list(IMPLS)}")
    if any(ws < 1 for ws in args.world_size_list) or args.repeats < 1 or args.warmup < 1:
        p.error("--world-sizes, --repeats and --warmup must be >= 1")
    args.steps_for = {w: args.steps or WORKLOADS[w].steps for w in args.workload_list}
    for w, n in args.steps_for.items():
        if n < args.warmup + 2:
            p.error(f"--steps for {w} is {n}, need at least --warmup + 2 = {args.warmup + 2}")
    return args


def _plan(args: argparse.Namespace) -> tuple[list[str], list[str]]:
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


def _loss_note(agg: Agg) -> str | None:
    """A note if the implementations' final losses differ for some workload and world size."""
    losses: dict[tuple[str, int], set[float]] = {}
    for (w, ws, _impl), a in agg.items():
        if a["per_repeat"]:
            losses.setdefault((w, ws), set()).add(round(a["final_loss"], 4))
    diverged = [f"{w}/{ws}" for (w, ws), s in losses.items() if len(s) > 1]
    if not diverged:
        return None
    return (
        f"final losses differ between implementations for {', '.join(diverged)} "
        "(they should match: same seed, data order and optimizer)."
    )


def _payload(
    agg: Agg, results: list[RunResult], machine: dict[str, Any], args: argparse.Namespace, notes: list[str], md: str
) -> dict[str, Any]:
    """Everything for the JSON file; per-step durations are left out, per-repeat summaries kept."""
    return {
        "machine": machine,
        "settings": {k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, list, dict, type(None)))},
        "workloads": {w: vars(WORKLOADS[w]) for w in args.workload_list},
        "results": [
            {
                "workload": w,
                "world_size": ws,
                "impl": impl,
                **{k: v for k, v in a.items() if k != "per_repeat"},
                "per_repeat": {
                    r: {k: v for k, v in s.items() if k != "steady_step_s"} for r, s in a["per_repeat"].items()
                },
            }
            for (w, ws, impl), a in sorted(agg.items())
        ],
        "ratios": {
            f"{w}/{ws}": {"ratios": rat, "targets": verdicts(rat)}
            for w in args.workload_list
            for ws in args.world_size_list
            if (rat := ratios(agg, w, ws)) is not None
        },
        "failures": [
            {"impl": r.impl, "workload": r.workload, "world_size": r.world_size, "repeat": r.repeat, "error": r.error}
            for r in results
            if not r.ok
        ],
        "notes": notes,
        "markdown": md,
    }


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; exit status 1 if any run failed."""
    args = parse_args(argv)
    args.device = _resolve_device(args.device)
    args.cores = _usable_cores()
    machine = machine_info(args.device)
    impls, notes = _plan(args)
    print(
        f"# bench_ddp: {machine['cpu']}, {args.cores} cores, torch {machine['torch']}, "
        f"lightning {machine['lightning']}, device {args.device}",
        file=sys.stderr,
        flush=True,
    )
    t_start = time.perf_counter()
    results = run_all(args, impls)
    args.total_s = time.perf_counter() - t_start
    loads = [r.load_avg for r in results]
    args.load_avg = {"median": statistics.median(loads), "max": max(loads)}
    if args.load_avg["max"] > args.cores:
        notes.append(
            f"the machine was busy: 1-minute load average up to {args.load_avg['max']:.1f} on {args.cores} cores "
            "before some runs, so absolute figures are noisy; the interleaved ratios are the ones to read."
        )

    agg = aggregate(results, args)
    if (note := _loss_note(agg)) is not None:
        notes.append(note)
    md = render(agg, machine, args, impls, notes)
    print(md)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(_payload(agg, results, machine, args, notes, md), indent=2) + "\n")
    if args.markdown:
        Path(args.markdown).write_text(md)
    print(f"# wrote {args.json}", file=sys.stderr)
    return 1 if any(not r.ok for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
