"""What each rank holds and does as the world grows (issue 49): W = 2, 4, 8, 16 CPU processes on one machine.

    python benchmarks/bench_scale.py                     # about 5 minutes on 2 CPU cores
    python benchmarks/bench_scale.py --world-sizes 2,4 --markdown /tmp/scale.md

For each W the hand-written loop, Lightning's ``ddp`` and ``MyDDPStrategy`` train the small workload of
``bench_ddp.py`` (an MLP of 51k parameters, batch 32 per rank, 2,048 samples: 64 / W batches per rank and epoch) for
two epochs and two steps, interleaved (the order rotates from W to W), each a fresh ``ddp_worker.py`` with
``BENCH_SCALE=1`` (gloo, one thread per rank; oversubscribed beyond 2 ranks). Every rank counts
(``bench_recorder.py``, ``bench_probe.py``), and the table gives, per rank (the mean over ranks, the largest in
brackets where they differ):

* after set-up (at the first step's start): established TCP connections (and again at the last step, once pairs that
  a group connects on first use are connected), process groups, the store operations (and those made by the last
  step's start) and the collectives made since launch;
* per steady-state step (the second epoch's, each from one step's start to the next's): the collectives on the
  world group (the gradient buckets through the comm hook included) and on any other group, with their bytes, and
  the store operations;
* per epoch: what the boundary between the second and third epochs adds to a step (the last step's start to the
  next epoch's first step's start, less a steady step);
* launch to the first step: seconds, and their ratio to Lightning's at the same W (machine noise; counts are the
  headline and do not depend on it).

A benchmark, not a test: nothing is asserted (``tests/test_benchmarks.py`` runs it at W = 8, under the slow marker,
and bounds the connections). ``--dry-run`` runs W = 2 alone and checks only that each implementation's counts were
read back.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_machine import machine_info, usable_cores  # noqa: E402
from bench_runs import RunResult, run_one  # noqa: E402
from bench_workloads import IMPLS, WORKLOADS  # noqa: E402

NAMES = {"handwritten": "hand-written", "lightning": "Lightning ddp", "ours": "MyDDPStrategy"}


def _delta(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Counts between two cumulative snapshots ``a`` (earlier) and ``b``: ``{"world"|"other": {name: [calls,
    bytes]}, "store": {op: n}}``, the gradient buckets as ``world["grad"]``."""
    out: dict[str, Any] = {"world": {}, "other": {}, "store": {}}
    for group in ("world", "other"):
        for name, (calls, nbytes) in b["groups"][group].items():
            c0, b0 = a["groups"][group].get(name, [0, 0])
            if calls - c0:
                out[group][name] = [calls - c0, nbytes - b0]
    if b["grad"][0] - a["grad"][0]:
        out["world"]["grad"] = [b["grad"][0] - a["grad"][0], b["grad"][1] - a["grad"][1]]
    out["store"] = {op: n - a["store"].get(op, 0) for op, n in b["store"].items() if n - a["store"].get(op, 0)}
    return out


def _minus(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """``a - b`` for two :func:`_delta` results (an epoch boundary less a steady step)."""
    out: dict[str, Any] = {"world": {}, "other": {}, "store": {}}
    for group in ("world", "other"):
        for name in set(a[group]) | set(b[group]):
            calls = a[group].get(name, [0, 0])[0] - b[group].get(name, [0, 0])[0]
            nbytes = a[group].get(name, [0, 0])[1] - b[group].get(name, [0, 0])[1]
            if calls:
                out[group][name] = [calls, nbytes]
    for op in set(a["store"]) | set(b["store"]):
        if n := a["store"].get(op, 0) - b["store"].get(op, 0):
            out["store"][op] = n
    return out


def rank_counts(rank: dict[str, Any], per_epoch: int) -> dict[str, Any]:
    """One rank's figures: connections, groups, set-up, a steady step (the second epoch's last one, checked equal
    to the epoch's other steps: ``steady_equal``) and an epoch boundary's extra."""
    scale = rank["scale"]
    snaps = scale["snapshots"]
    zero = {"groups": {"world": {}, "other": {}}, "grad": [0, 0], "store": {}}
    steps = [_delta(snaps[i], snaps[i + 1]) for i in range(per_epoch, 2 * per_epoch - 1)]
    steady = steps[-1] if steps else _delta(snaps[0], snaps[0])
    boundary = _delta(snaps[2 * per_epoch - 1], snaps[2 * per_epoch])
    return {
        "tcp": scale["tcp_connections"],
        "tcp_end": scale.get("tcp_connections_end", 0),
        "run": _delta(zero, snaps[-1]),
        "groups": scale["process_groups"],
        "setup": _delta(zero, snaps[0]),
        "step": steady,
        "steady_equal": all(s == steady for s in steps),
        "epoch": _minus(boundary, steady),
        "startup_s": rank["startup_s"],
    }


def _mean_max(values: list[float]) -> str:
    """``mean`` or ``mean (max)`` where the ranks differ; integers without decimals."""
    mean, most = statistics.fmean(values), max(values)
    text = f"{mean:.0f}" if mean == int(mean) else f"{mean:.1f}"
    return text if min(values) == most else f"{text} ({most:g})"


def _collectives(per_rank: list[dict[str, Any]], group: str) -> str:
    """``name n×bytes B`` per collective on ``group``, rank 0's, with ``(ranks differ)`` where they do."""
    first = per_rank[0][group]
    differ = any(r[group] != first for r in per_rank)
    parts = [f"{name} {calls}× {nbytes / calls:,.0f} B" for name, (calls, nbytes) in sorted(first.items())]
    return ("; ".join(parts) or "0") + (" (rank 0; ranks differ)" if differ else "")


def _store(per_rank: list[dict[str, Any]]) -> str:
    """Store operations per rank: the mean total, and by operation (mean over ranks)."""
    totals = [sum(r["store"].values()) for r in per_rank]
    ops = sorted({op for r in per_rank for op in r["store"]})
    by_op = ", ".join(f"{op} {statistics.fmean(r['store'].get(op, 0) for r in per_rank):g}" for op in ops)
    return _mean_max(totals) + (f" ({by_op})" if by_op else "")


def summarize(results: dict[tuple[int, str], RunResult]) -> list[dict[str, Any]]:
    """One row per (W, implementation) that ran: per-rank figures pooled as the table shows them."""
    rows = []
    for (world, impl), res in sorted(results.items(), key=lambda kv: (kv[0][0], IMPLS.index(kv[0][1]))):
        if not res.ok:
            rows.append({"world": world, "impl": impl, "error": res.error})
            continue
        per_epoch = WORKLOADS["small"].samples // (world * WORKLOADS["small"].batch)
        ranks = [rank_counts(r, per_epoch) for r in sorted(res.ranks, key=lambda r: r["rank"])]
        startup = max(r["startup_s"] for r in ranks)
        rows.append(
            {
                "world": world,
                "impl": impl,
                "tcp": [r["tcp"] for r in ranks],
                "tcp_end": [r["tcp_end"] for r in ranks],
                "run": [r["run"] for r in ranks],
                "groups": [r["groups"] for r in ranks],
                "setup": [r["setup"] for r in ranks],
                "step": [r["step"] for r in ranks],
                "steady_equal": all(r["steady_equal"] for r in ranks),
                "epoch": [r["epoch"] for r in ranks],
                "startup_s": startup,
            }
        )
    for row in rows:
        ref = next(
            (r for r in rows if r["world"] == row["world"] and r["impl"] == "lightning" and "error" not in r), None
        )
        row["startup_ratio"] = row["startup_s"] / ref["startup_s"] if ref and "error" not in row else None
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    """The tables: set-up, then steady state, one row per (W, implementation)."""
    setup = [
        "| W | implementation | TCP connections/rank | at the last step | process groups | store ops/rank |"
        " by the last step | collectives (world) | collectives (other groups) | launch→1st step s | ÷ Lightning |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    steady = [
        "| W | implementation | per step: world group | per step: other groups | per step: store ops/rank |"
        " per epoch: world group | per epoch: other groups | per epoch: store ops/rank |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        name = NAMES[row["impl"]]
        if "error" in row:
            setup.append(f"| {row['world']} | {name} | failed: {row['error'].splitlines()[0]} | | | | | | | | |")
            continue
        ratio = f"{row['startup_ratio']:.2f}" if row["startup_ratio"] is not None else "–"
        by_last_step = _mean_max([sum(r["store"].values()) for r in row["run"]])
        setup.append(
            f"| {row['world']} | {name} | {_mean_max(row['tcp'])} | {_mean_max(row['tcp_end'])} |"
            f" {_mean_max(row['groups'])} | {_store(row['setup'])} | {by_last_step} |"
            f" {_collectives(row['setup'], 'world')} |"
            f" {_collectives(row['setup'], 'other')} | {row['startup_s']:.1f} | {ratio} |"
        )
        note = "" if row["steady_equal"] else " (steps differ)"
        steady.append(
            f"| {row['world']} | {name} | {_collectives(row['step'], 'world')}{note} |"
            f" {_collectives(row['step'], 'other')} | {_store(row['step'])} |"
            f" {_collectives(row['epoch'], 'world')} | {_collectives(row['epoch'], 'other')} | {_store(row['epoch'])} |"
        )
    return "\n".join(setup) + "\n\n" + "\n".join(steady) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-sizes", default="2,4,8,16")
    p.add_argument("--impls", default=",".join(IMPLS))
    p.add_argument("--timeout", type=float, default=900.0, help="per-run limit, seconds")
    p.add_argument("--pg-timeout", type=float, default=600.0, help="process-group timeout (and the join's), seconds")
    p.add_argument("--json", default=str(HERE / "scale_results.json"))
    p.add_argument("--markdown", default=None, help="also write the tables to this file")
    p.add_argument("--dry-run", action="store_true", help="W = 2, two steps per epoch: a check that it runs")
    args = p.parse_args(argv)
    args.seed, args.device, args.cores = 1234, "cpu", usable_cores()
    worlds = [2] if args.dry_run else [int(w) for w in args.world_sizes.split(",")]
    impls = args.impls.split(",")
    os.environ["BENCH_SCALE"] = "1"  # run_one passes the environment on to every rank
    results: dict[tuple[int, str], RunResult] = {}
    t0 = time.perf_counter()
    for i, world in enumerate(worlds):
        order = impls[i % len(impls) :] + impls[: i % len(impls)]
        for pos, impl in enumerate(order):
            per_epoch = WORKLOADS["small"].samples // (world * WORKLOADS["small"].batch)
            print(f"W={world} {impl} ...", file=sys.stderr, flush=True)
            res = run_one(impl, "small", world, 2 * per_epoch + 2, args, 0, pos)
            results[world, impl] = res
            if not res.ok:
                print(f"  failed: {res.error}", file=sys.stderr)
    rows = summarize(results)
    machine = machine_info("cpu")
    text = (
        f"Machine: {machine.get('cpu')}, {machine.get('cores')} cores; torch {machine.get('torch')},"
        f" lightning {machine.get('lightning')}; gloo; total {time.perf_counter() - t0:.0f} s; 1-minute load"
        f" average before runs: max {max(r.load_avg for r in results.values()):.1f}.\n\n" + markdown(rows)
    )
    print(text)
    Path(args.json).write_text(json.dumps({"machine": machine, "rows": rows, "markdown": text}, indent=1))
    if args.markdown:
        Path(args.markdown).write_text(text)
    ok = all("error" not in r for r in rows)
    if args.dry_run:
        ok = ok and all(r["tcp"] and r["setup"][0]["store"] for r in rows if "error" not in r)
        print("dry run:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
