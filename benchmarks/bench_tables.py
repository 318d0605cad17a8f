"""Formatting: the markdown report (settings line, main, ratio, start-up and scaling tables, notes).

:func:`render` is the only entry point; the figures come from ``bench_stats.py``
already computed, so this module only lays them out. benchmarks/README.md
explains every column.
"""

import argparse
from typing import Any

from bench_stats import (
    RSS_VS_LIGHTNING_MAX,
    STARTUP_MARKS,
    STARTUP_VS_LIGHTNING_MAX,
    STEP_VS_HANDWRITTEN_MAX,
    STEP_VS_LIGHTNING_MAX,
    Agg,
    ratios,
)
from bench_workloads import WORKLOADS

IMPL_LABEL = {"handwritten": "hand-written", "lightning": "Lightning ddp", "ours": "MyDDPStrategy"}


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
