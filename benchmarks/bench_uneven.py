"""The per-step cost of uneven inputs (issues 27, 38): the small workload on 2 ranks, six ways, interleaved.

    python benchmarks/bench_uneven.py                   # 3 repeats, about 5 minutes on 2 CPU cores
    python benchmarks/bench_uneven.py --repeats 5 --steps 640

Cases (same model, data, per-device batch, optimizer and seed as ``bench_ddp.py``'s small workload):
    ddp, even          Lightning's strategy="ddp" on a shuffled DataLoader
    ours, even         MyDDPStrategy on the same loader: the strategy shards it, counts known and equal
    ours, map-style    MyDDPStrategy on a map-style loader of the stream's own batches (rank r reads data[r::2] in
                       order, use_distributed_sampler=False): counts known and equal, nothing added. The base
    ddp, iterable      Lightning's ddp on an IterableDataset without __len__ (rank r streams data[r::2]), equal
                       counts: what the stream costs without the join (Lightning fetches one batch ahead)
    ours, iterable     MyDDPStrategy on the same stream: the join is active, no rank runs out (the cost of the
                       agreement on whether every rank has a next batch)
    ours, uneven       the same stream with 5% fewer batches on rank 1 (rounded: 30 of 32 per epoch): the tail
                       steps and the epoch-end state copy

Each run is a fresh ``ddp_worker.py`` (``bench_runs.run_one``), ``--steps`` optimizer steps (default 320: 10 epochs
of rank 0's 32 batches, so every case has the same epoch boundaries). A step's time is rank 0's (the longest rank,
which takes every step), from one step's end to the next's (``bench_recorder.StepRecorder``): everything the loop
does per batch, the fetch, the batch transfer (where the join agrees), the hooks, forward, backward and optimizer
step, counted once; warm-up left out. Per case: the median, and the mean, which includes the epoch boundaries (the
uneven epoch's end: the join's exit and the state copy); their ratios to the base, per repeat, then the median of
those; and the tail steps' ratio: the median of the steps rank 1 has no batch for (the last 2 of each epoch) over
the base's median at the same positions. Prints a markdown table; a benchmark, not a test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_machine import machine_info, usable_cores  # noqa: E402
from bench_runs import RunResult, run_one  # noqa: E402
from bench_workloads import WORKLOADS, short_batches  # noqa: E402

_PER_RANK, _SHORT = short_batches(WORKLOADS["small"], 2)
#: (label, implementation, data): the table's rows, in order.
CASES = (
    ("Lightning ddp, even", "lightning", "even"),
    ("MyDDPStrategy, even", "ours", "even"),
    ("MyDDPStrategy, map-style, the stream's batches", "ours", "map"),
    ("Lightning ddp, IterableDataset, equal counts", "lightning", "iterable"),
    ("MyDDPStrategy, IterableDataset, equal counts", "ours", "iterable"),
    (f"MyDDPStrategy, IterableDataset, rank 1 {_PER_RANK - _SHORT} of {_PER_RANK} batches", "ours", "uneven"),
)
BASE = 2  # the row ratios divide by: the map-style loader of the stream's batches
UNEVEN = len(CASES) - 1  # the row with tail steps


def rank0_steps(res: RunResult, warmup: int, tail: bool = False) -> list[float]:
    """Rank 0's step durations after warm-up, milliseconds; ``tail``: only those at the positions of the tail steps
    (the last ``_SHORT`` of each epoch of ``_PER_RANK``)."""
    steps = res.ranks[0]["step_s"]
    return [s * 1e3 for i, s in enumerate(steps) if i >= warmup and (not tail or i % _PER_RANK >= _PER_RANK - _SHORT)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3, help="interleaved rounds over the cases")
    p.add_argument("--steps", type=int, default=320, help="optimizer steps per run, warm-up included")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--timeout", type=float, default=180.0, help="per-run limit, seconds")
    p.add_argument("--pg-timeout", type=float, default=60.0, help="process-group timeout, seconds")
    args = p.parse_args(argv)
    args.seed, args.device, args.cores = 1234, "cpu", usable_cores()
    machine = machine_info("cpu")
    runs: dict[int, dict[int, RunResult]] = {}  # repeat -> case -> result
    loads, t0 = [], time.perf_counter()
    for repeat in range(args.repeats):
        order = list(range(len(CASES)))[repeat % len(CASES) :] + list(range(len(CASES)))[: repeat % len(CASES)]
        for pos, case in enumerate(order):
            label, impl, data = CASES[case]
            loads.append(os.getloadavg()[0])
            res = run_one(impl, "small", 2, args.steps, args, repeat, pos, ("--data", data))
            runs.setdefault(repeat, {})[case] = res
            print(
                f"[repeat {repeat}] {label}: {res.wall_s:.1f} s {'ok' if res.ok else 'FAILED: ' + str(res.error)}",
                file=sys.stderr,
                flush=True,
            )
    rows = []
    for case, (label, _, _) in enumerate(CASES):
        done = {r: c[case] for r, c in runs.items() if c[case].ok}
        steps = {r: rank0_steps(res, args.warmup) for r, res in done.items()}
        pooled = [s for v in steps.values() for s in v]
        if not pooled:
            rows.append(f"| {label} | failed | | | | | | |")
            continue
        ratio = {
            kind: [fn(steps[r]) / fn(rank0_steps(runs[r][BASE], args.warmup)) for r in steps if runs[r][BASE].ok]
            for kind, fn in (("median", statistics.median), ("mean", statistics.fmean))
        }
        if case == UNEVEN:
            ratio["tail"] = [
                statistics.median(rank0_steps(res, args.warmup, tail=True))
                / statistics.median(rank0_steps(runs[r][BASE], args.warmup, tail=True))
                for r, res in done.items()
                if runs[r][BASE].ok
            ]
        calls = statistics.median(res.ranks[0]["comm"]["other_calls_per_step"] for res in done.values())
        rows.append(
            f"| {label} | {statistics.median(pooled):.2f} | "
            + " / ".join(f"{statistics.median(v):.2f}" for v in steps.values())
            + f" | {statistics.fmean(pooled):.2f} | "
            + " | ".join(f"{statistics.median(v):.2f} ({min(v):.2f}–{max(v):.2f})" for v in ratio.values())
            + (" | –" if "tail" not in ratio else "")
            + f" | {calls:.2f} |"
        )
    print(
        f"Machine: {machine['cpu']}, {args.cores} cores; torch {machine['torch']}, lightning {machine['lightning']};"
        f" small workload, 2 ranks (gloo), {args.steps} steps per run ({args.warmup} warm-up), {args.repeats}"
        f" repeats interleaved; total {time.perf_counter() - t0:.0f} s; 1-minute load average before runs: median"
        f" {statistics.median(loads):.1f}, max {max(loads):.1f}.\n"
    )
    print(
        "| case | step ms (median) | run medians ms | mean ms | median ÷ map-style | mean ÷ map-style"
        " | tail steps ÷ map-style | world-group collectives/step (rank 0) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    return 0 if all(res.ok for c in runs.values() for res in c.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
