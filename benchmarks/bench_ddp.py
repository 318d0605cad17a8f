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

from ddp_worker import IMPLS, WORKLOADS  # noqa: E402

IMPL_LABEL = {"handwritten": "hand-written", "lightning": "Lightning ddp", "ours": "MyDDPStrategy"}
# Targets from issue 9 (ratios are ours / reference).
STEP_VS_LIGHTNING_MAX = 1.00
STEP_VS_HANDWRITTEN_MAX = 1.10
STARTUP_VS_LIGHTNING_MAX = 1.00
RSS_VS_LIGHTNING_MAX = 1.00
NOISE_FLOOR = 0.02  # smallest tolerance added to the "<= 1.00" targets, as a fraction


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


_SCRUB = ("MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "RANK", "WORLD_SIZE", "NODE_RANK", "GROUP_RANK",
          "LOCAL_WORLD_SIZE", "PL_GLOBAL_SEED", "PL_SEED_WORKERS", "OMP_NUM_THREADS")  # fmt: skip


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
            sys.executable, str(WORKER), "--impl", impl, "--workload", workload,
            "--world-size", str(world_size), "--steps", str(steps), "--seed", str(args.seed),
            "--device", args.device, "--out-dir", str(out_dir), "--pg-timeout", str(args.pg_timeout),
        ]  # fmt: skip
        log_path = Path(tmp) / "log.txt"
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
        return RunResult(impl, workload, world_size, repeat, order, error is None, wall, ranks, error)


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
    steps = [max(vals) for vals in zip(*(r["step_s"] for r in res.ranks))][warmup:]
    r0 = res.ranks[0]
    return {
        "steady_step_s": steps,
        "median_step_s": _median(steps),
        "startup_s": max(r["startup_s"] for r in res.ranks),
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


def aggregate(results: list[RunResult], args: argparse.Namespace) -> dict[tuple[str, int, str], dict[str, Any]]:
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
            "samples_per_s": key[1] * w.batch / med if med == med and med > 0 else float("nan"),
            "startup_s": _median([s["startup_s"] for s in summaries.values()]),
            "peak_rss_mib": _median([s["peak_rss_mib"] for s in summaries.values()]),
            "peak_cuda_mib": _median([s["peak_cuda_mib"] for s in summaries.values() if s["peak_cuda_mib"]]) or None,
            "allreduce_kib_per_step": _median([s["allreduce_bytes_per_step"] for s in summaries.values()]) / 1024,
            "other_collectives_per_step": _median([s["other_collectives_per_step"] for s in summaries.values()]),
            "final_loss": _median([s["final_loss"] for s in summaries.values() if s["final_loss"] is not None]),
            "hook_registered": all(s["hook_registered"] for s in summaries.values()),
        }
    return agg


def _rel_range(xs: list[float]) -> float:
    """(max - min) / median of a list, as a fraction; 0 for fewer than two values."""
    return (max(xs) - min(xs)) / statistics.median(xs) if len(xs) > 1 else 0.0


def ratios(agg: dict[tuple[str, int, str], dict[str, Any]], workload: str, ws: int) -> dict[str, Any] | None:
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


def _fmt_ratio(r: dict[str, Any] | None, limit: float | None) -> str:
    if r is None:
        return "n/a"
    s = f"{r['median']:.2f}"
    if r["max"] - r["min"] > 0.005:
        s += f" ({r['min']:.2f}–{r['max']:.2f})"
    if limit is not None:
        ok = r["median"] <= limit + (r["tolerance"] if limit == 1.0 else 0.0)
        s += " ✓" if ok else " ✗"
    return s


def render(agg: dict, machine: dict[str, Any], args: argparse.Namespace, impls: list[str], notes: list[str]) -> str:
    """The markdown report: machine, per-configuration table, ratio table, scaling table, notes."""
    lines = []
    gpu = f", {machine['gpu']}" if machine.get("gpu") else ""
    lines.append(
        f"Machine: {machine['cpu']}, {machine['cores']} cores usable, {machine['memory_gib']} GiB RAM{gpu}; "
        f"Python {machine['python']}, torch {machine['torch']}, lightning {machine['lightning']}; "
        f"device {machine['device']} ({'nccl' if machine['device'] == 'cuda' else 'gloo'})."
    )
    steps_desc = ", ".join(f"{w} {args.steps_for[w]}" for w in args.workload_list)
    lines.append(
        f"Settings: {args.repeats} repeat(s) interleaved; steps per run: {steps_desc} "
        f"(first {args.warmup} excluded as warm-up); per-device batch: "
        + ", ".join(f"{w} {WORKLOADS[w].batch}" for w in args.workload_list)
        + f"; OMP_NUM_THREADS = {args.cores} // ranks; seed {args.seed}; total {args.total_s:.0f} s."
    )
    lines.append("")
    mem_col = "peak GPU MiB/rank" if args.device == "cuda" else None
    head = ["workload", "ranks", "implementation", "step ms (median)", "IQR ms", "run medians ms", "samples/s",
            "launch→1st step s", "peak RSS MiB/rank"]  # fmt: skip
    if mem_col:
        head.append(mem_col)
    head += ["all-reduced KiB/step", "other collectives/step", "final loss"]
    lines.append("| " + " | ".join(head) + " |")
    lines.append("|" + "|".join("---" for _ in head) + "|")
    for w in args.workload_list:
        for ws in args.world_size_list:
            for impl in impls:
                a = agg.get((w, ws, impl))
                if a is None:
                    continue
                if not a["per_repeat"]:
                    lines.append(f"| {w} | {ws} | {IMPL_LABEL[impl]} | failed ({a['failed']}/{a['runs']} runs) |")
                    continue
                fail = f" ({a['failed']} failed)" if a["failed"] else ""
                row = [
                    w, str(ws), IMPL_LABEL[impl] + fail,
                    f"{a['step_ms_median']:.2f}",
                    f"{a['step_ms_p25']:.2f}–{a['step_ms_p75']:.2f}",
                    " / ".join(f"{m:.2f}" for m in a["run_medians_ms"]),
                    f"{a['samples_per_s']:.0f}",
                    f"{a['startup_s']:.2f}",
                    f"{a['peak_rss_mib']:.0f}",
                ]  # fmt: skip
                if mem_col:
                    row.append(f"{a['peak_cuda_mib']:.0f}" if a["peak_cuda_mib"] else "–")
                kib = f"{a['allreduce_kib_per_step']:.1f}" if a["hook_registered"] else "– (no DDP module)"
                row += [kib, f"{a['other_collectives_per_step']:.2f}", f"{a['final_loss']:.4f}"]
                lines.append("| " + " | ".join(row) + " |")
    lines.append("")

    if "ours" in impls:
        lines.append("Ratios, MyDDPStrategy ÷ reference: median of the per-repeat ratios (range over repeats); "
                     "✓/✗ = issue 9 target met (≤ 1.00 within noise vs Lightning, ≤ 1.10 vs hand-written step time).")  # fmt: skip
        lines.append("")
        head = ["workload", "ranks", "step ÷ Lightning", "step ÷ hand-written", "start-up ÷ Lightning",
                "start-up ÷ hand-written", "peak RSS ÷ Lightning", "peak RSS ÷ hand-written"]  # fmt: skip
        lines.append("| " + " | ".join(head) + " |")
        lines.append("|" + "|".join("---" for _ in head) + "|")
        for w in args.workload_list:
            for ws in args.world_size_list:
                rat = ratios(agg, w, ws)
                if rat is None:
                    continue
                g = rat.get
                lines.append("| " + " | ".join([
                    w, str(ws),
                    _fmt_ratio(g("median_step_s/lightning"), STEP_VS_LIGHTNING_MAX),
                    _fmt_ratio(g("median_step_s/handwritten"), STEP_VS_HANDWRITTEN_MAX),
                    _fmt_ratio(g("startup_s/lightning"), STARTUP_VS_LIGHTNING_MAX),
                    _fmt_ratio(g("startup_s/handwritten"), None),
                    _fmt_ratio(g("peak_rss_mib/lightning"), RSS_VS_LIGHTNING_MAX),
                    _fmt_ratio(g("peak_rss_mib/handwritten"), None),
                ]) + " |")  # fmt: skip
        lines.append("")

    if len(args.world_size_list) > 1:
        lo, hi = min(args.world_size_list), max(args.world_size_list)
        lines.append(f"Scaling from {lo} to {hi} ranks (samples/s; efficiency = speed-up ÷ {hi // lo}).")
        lines.append("")
        head = ["workload", "implementation", f"samples/s @{lo}", f"samples/s @{hi}", "speed-up", "efficiency"]
        lines.append("| " + " | ".join(head) + " |")
        lines.append("|" + "|".join("---" for _ in head) + "|")
        for w in args.workload_list:
            for impl in impls:
                a, b = agg.get((w, lo, impl)), agg.get((w, hi, impl))
                if not a or not b or not a["per_repeat"] or not b["per_repeat"]:
                    continue
                sp = b["samples_per_s"] / a["samples_per_s"]
                lines.append(
                    f"| {w} | {IMPL_LABEL[impl]} | {a['samples_per_s']:.0f} | {b['samples_per_s']:.0f} "
                    f"| {sp:.2f} | {sp / (hi / lo):.0%} |"
                )
        lines.append("")
    for n in notes:
        lines.append(f"Note: {n}")
    return "\n".join(lines).rstrip() + "\n"


# --------------------------------------------------------------------------- main


def _csv(kind: type, text: str) -> list:
    return [kind(x) for x in text.split(",") if x.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", default="small,heavy", help=f"comma-separated, from {sorted(WORKLOADS)}")
    p.add_argument("--impls", default=",".join(IMPLS), help="comma-separated, from " + ",".join(IMPLS))
    p.add_argument("--world-sizes", default="1,2", help="comma-separated ranks per run")
    p.add_argument("--steps", type=int, default=0,
                   help="optimizer steps per run, warm-up included (default: per workload, "
                        + ", ".join(f"{k} {v.steps}" for k, v in WORKLOADS.items()) + ")")  # fmt: skip
    p.add_argument("--warmup", type=int, default=5, help="leading steps excluded from step statistics")
    p.add_argument("--repeats", type=int, default=2, help="interleaved rounds over all configurations")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="cuda uses NCCL and needs one GPU per rank; auto picks cuda when available")  # fmt: skip
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


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.device = _resolve_device(args.device)
    args.cores = _usable_cores()
    machine = machine_info(args.device)
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
    if args.device == "cpu" and max(args.world_size_list) > args.cores:
        notes.append(f"more ranks ({max(args.world_size_list)}) than cores ({args.cores}): ranks share cores.")

    print(f"# bench_ddp: {machine['cpu']}, {args.cores} cores, torch {machine['torch']}, "
          f"lightning {machine['lightning']}, device {args.device}", file=sys.stderr, flush=True)  # fmt: skip
    results: list[RunResult] = []
    t_start = time.perf_counter()
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
                    status = "ok" if res.ok else "FAILED"
                    print(f"[{len(results)}/{total}] repeat {repeat} {w} ranks={ws} {impl}: {status} "
                          f"({res.wall_s:.1f} s)", file=sys.stderr, flush=True)  # fmt: skip
                    if not res.ok:
                        print(f"    {res.error}", file=sys.stderr, flush=True)
    args.total_s = time.perf_counter() - t_start

    agg = aggregate(results, args)
    losses = {}
    for (w, ws, impl), a in agg.items():
        if a["per_repeat"]:
            losses.setdefault((w, ws), set()).add(round(a["final_loss"], 4))
    diverged = [f"{w}/{ws}" for (w, ws), s in losses.items() if len(s) > 1]
    if diverged:
        notes.append(f"final losses differ between implementations for {', '.join(diverged)} "
                     "(they should match: same seed, data order and optimizer).")  # fmt: skip
    report = render(agg, machine, args, impls, notes)
    print(report)

    payload = {
        "machine": machine,
        "settings": {k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, list, dict, type(None)))},
        "workloads": {w: vars(WORKLOADS[w]) for w in args.workload_list},
        "results": [
            {"workload": w, "world_size": ws, "impl": impl, **{k: v for k, v in a.items() if k != "per_repeat"},
             "per_repeat": {r: {k: v for k, v in s.items() if k != "steady_step_s"} for r, s in a["per_repeat"].items()}}
            for (w, ws, impl), a in sorted(agg.items())
        ],  # fmt: skip
        "ratios": {f"{w}/{ws}": {"ratios": rat, "targets": verdicts(rat)} for w in args.workload_list
                   for ws in args.world_size_list if (rat := ratios(agg, w, ws)) is not None},  # fmt: skip
        "failures": [{"impl": r.impl, "workload": r.workload, "world_size": r.world_size, "repeat": r.repeat,
                      "error": r.error} for r in results if not r.ok],  # fmt: skip
        "notes": notes,
        "markdown": report,
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(payload, indent=2) + "\n")
    if args.markdown:
        Path(args.markdown).write_text(report)
    print(f"# wrote {args.json}", file=sys.stderr)
    return 1 if any(not r.ok for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
