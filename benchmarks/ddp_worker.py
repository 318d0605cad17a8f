"""One benchmark run's entry point: parses the run's settings and hands them to the implementation's worker.

``bench_ddp.py`` starts this file once per run, in a fresh interpreter, so that
start-up is measured from launch::

    python benchmarks/ddp_worker.py --impl handwritten --workload small \
        --world-size 2 --steps 200 --out-dir /tmp/run

``--impl handwritten`` runs ``handwritten_worker.py``; ``--impl lightning`` and
``--impl ours`` run ``lightning_worker.py``, which is imported only for them, so
the hand-written loop never imports Lightning (its start-up and memory are those
of plain PyTorch). Lightning's popen launcher starts the other ranks by re-running
this file with the same arguments, so they take the same path.

This is the only module that picks a worker; the workers import neither it nor
each other (what they share is in ``bench_workloads.py`` and ``bench_recorder.py``).

Each rank writes ``<out-dir>/rank<N>.json`` (see ``bench_recorder.StepRecorder.finish``).

Environment read by the workers (set by ``bench_ddp.py``):
    BENCH_LAUNCH_TIME: ``time.time()`` of the launch, in seconds since the epoch.
    MASTER_ADDR, MASTER_PORT: the rendezvous address (127.0.0.1 and a free port).
    OMP_NUM_THREADS: intra-op threads per rank (cores // world size for all impls).
"""

import argparse

from bench_workloads import DATA, IMPLS, WORKLOADS, RunConfig


def _parse(argv: list[str] | None = None) -> RunConfig:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--impl", choices=IMPLS, required=True)
    p.add_argument("--workload", choices=sorted(WORKLOADS), required=True)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--steps", type=int, required=True, help="optimizer steps, warm-up included")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--out-dir", required=True)
    p.add_argument("--pg-timeout", type=float, default=60.0, help="process-group timeout, seconds")
    p.add_argument("--data", choices=DATA, default="even", help="training data of a Lightning run (bench_uneven.py)")
    a = p.parse_args(argv)
    return RunConfig(a.impl, a.workload, a.world_size, a.steps, a.seed, a.device, a.out_dir, a.pg_timeout, a.data)


def main(argv: list[str] | None = None) -> None:
    """Run one configuration (see the module docstring)."""
    cfg = _parse(argv)
    # Each run imports only its own worker, so the hand-written loop stays Lightning-free.
    if cfg.impl == "handwritten":
        import handwritten_worker

        handwritten_worker.run(cfg)
    else:
        import lightning_worker

        lightning_worker.run(cfg)


if __name__ == "__main__":
    main()
