"""Wall time of the test suite, run one way after another in one session, as a table.

Usage: python benchmarks/bench_suite.py [--variants serial,parallel] [--marks soak] [-- extra pytest args]

Each variant runs ``python -m pytest`` in a subprocess from the repository root:
  * ``serial``: one pytest process (``-n 0``), every test after the other, as before the testing kit;
  * ``parallel``: the README's command, two pytest-xdist workers (pyproject.toml's addopts:
    ``--numprocesses=2 --dist=loadfile``).
``--marks`` selects tests for both (``-m``; pyproject's default, ``"not soak"``, leaves out the soak loop).
Prints one markdown table: variant, wall time (m:ss), passed, failed, skipped. Run it on an idle machine: the
suite is bound by CPU and by waits for timeouts, so anything else running changes the figures. A benchmark, not a
test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = {"serial": ["-n", "0"], "parallel": []}


def run(variant: str, marks: str | None, extra: list[str]) -> dict[str, object]:
    """Run the suite one way; return the wall time (s) and the counts from pytest's last line."""
    args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *VARIANTS[variant], *extra]
    if marks:
        args += ["-m", marks]
    print(f"running {variant}: {' '.join(args[1:])}", file=sys.stderr, flush=True)
    start = time.monotonic()
    proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True)
    wall = time.monotonic() - start
    last = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|error)", last)}
    if proc.returncode not in (0, 1):
        print(proc.stdout[-3000:], proc.stderr[-3000:], file=sys.stderr)
    return {"variant": variant, "wall": wall, **counts}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default="serial,parallel", help="comma-separated: serial, parallel")
    parser.add_argument(
        "--marks", default=None, help="pytest -m expression for every variant (default: pyproject's 'not soak')"
    )
    parser.add_argument("extra", nargs="*", help="extra pytest arguments (after --)")
    opts = parser.parse_args()
    rows = [run(v, opts.marks, opts.extra) for v in opts.variants.split(",")]
    print(f"\n| suite run{f' (-m {opts.marks!r})' if opts.marks else ''} | wall (m:ss) | passed | failed | skipped |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        minutes, seconds = divmod(round(r["wall"]), 60)
        print(
            f"| {r['variant']} | {minutes}:{seconds:02d} | {r.get('passed', 0)} | {r.get('failed', 0)} "
            f"| {r.get('skipped', 0)} |"
        )


if __name__ == "__main__":
    main()
