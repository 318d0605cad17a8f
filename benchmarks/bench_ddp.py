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

Code layout: this file owns the command line, the order of the work and the JSON
file; the work itself is in bench_machine.py (what can run here), bench_runs.py
(launching each run of ddp_worker.py, which hands it to handwritten_worker.py or
lightning_worker.py), bench_stats.py (the figures and ratios) and bench_tables.py
(the markdown). benchmarks/README.md lists every file.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_machine import machine_info, plan_runs, resolve_device, usable_cores  # noqa: E402
from bench_runs import RunResult, run_all  # noqa: E402
from bench_stats import Agg, aggregate, loss_note, ratios, verdicts  # noqa: E402
from bench_tables import render  # noqa: E402
from bench_workloads import IMPLS, WORKLOADS  # noqa: E402


def _csv(kind: type, text: str) -> list:
    return [kind(x) for x in text.split(",") if x.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    # --help tells what the benchmark does; the code layout is for readers of the source.
    description = __doc__.partition("\n\nCode layout:")[0] + "\n"
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
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
    args.device = resolve_device(args.device)
    args.cores = usable_cores()
    machine = machine_info(args.device)
    impls, notes = plan_runs(args)
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
    if (note := loss_note(agg)) is not None:
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
