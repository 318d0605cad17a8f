"""Measuring: per-run figures, repeats pooled per configuration, paired ratios and issue 9's targets.

Turns the :class:`~bench_runs.RunResult` list into the aggregate the tables and
the JSON are made from (:func:`aggregate`), the ratios ours / reference
(:func:`ratios`), their verdicts (:func:`verdicts`) and the note on diverging final losses
(:func:`loss_note`). No I/O and no tables.
"""

import argparse
import statistics
from typing import Any

from bench_runs import RunResult
from bench_workloads import WORKLOADS

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


def loss_note(agg: Agg) -> str | None:
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
