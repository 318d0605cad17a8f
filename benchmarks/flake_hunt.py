"""Hunt for flaky tests: run the whole suite N times and the timing-sensitive multi-process tests M times.

Usage: python benchmarks/flake_hunt.py [--suite-runs 3] [--repeat 20] [--only PATTERN ...] [--minutes M]

Not part of the default run (it takes hours: the suite alone is 15+ minutes). Each run writes a JUnit XML
report into a temporary folder; the table at the end counts pass/fail/skip/error per test over all runs,
with failing tests first. Set DDP_TEARDOWN_LOOPS (default 30 in tests/process/test_launching.py) to shorten the
repeated-fits test when repeating. Exit status 1 if any test failed at least once.
"""

from __future__ import annotations

import argparse
import collections
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: Tests whose outcome could depend on timing between processes: launch, teardown, failures, rendezvous,
#: the notebook demo.
TIMING_SENSITIVE = (
    "tests/process/test_failures.py",
    "tests/reference/test_demo.py",
    "tests/reference/test_notebook.py",
    "tests/process/test_launching.py",
    "tests/process/test_process_group.py",
    "tests/process/test_restarts.py",
)


def run_pytest(targets: list[str], report: Path, extra: list[str]) -> None:
    """One pytest run of ``targets``, its JUnit report at ``report`` (a crash of pytest itself is reported)."""
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-p",
        "no:cacheprovider",
        "-q",
        f"--basetemp={report.parent / (report.stem + '_tmp')}",
        f"--junitxml={report}",
        *extra,
        *targets,
    ]
    print("$", " ".join(command), file=sys.stderr, flush=True)
    subprocess.run(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def count(reports: list[Path]) -> dict[str, collections.Counter]:
    """test id -> Counter of "pass"/"fail"/"error"/"skip" over the JUnit reports."""
    table: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for report in reports:
        if not report.exists():
            table[f"(pytest crashed: {report.name})"]["error"] += 1
            continue
        for case in ET.parse(report).iter("testcase"):
            name = f"{case.get('classname')}::{case.get('name')}"
            kinds = {child.tag for child in case}
            outcome = (
                "fail"
                if "failure" in kinds
                else "error"
                if "error" in kinds
                else "skip"
                if "skipped" in kinds
                else "pass"
            )
            table[name][outcome] += 1
    return table


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite-runs", type=int, default=3, help="whole-suite runs (default 3)")
    parser.add_argument("--repeat", type=int, default=20, help="runs of each timing-sensitive target (default 20)")
    parser.add_argument("--only", nargs="*", default=None, help="timing-sensitive targets to repeat (default all)")
    parser.add_argument("-k", default=None, help="pytest -k expression for the repeated runs")
    parser.add_argument(
        "--minutes",
        type=float,
        default=None,
        help="stop starting new runs after this many minutes and report what ran (default: no limit)",
    )
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="flake_hunt_"))
    reports: list[Path] = []
    extra = ["-k", args.k] if args.k else []
    targets = args.only if args.only is not None else TIMING_SENSITIVE
    deadline = time.monotonic() + args.minutes * 60 if args.minutes else None
    # Round-robin: round i runs the whole suite (while i < --suite-runs), then each target once (while
    # i < --repeat), so a run cut short by --minutes has still tried every target about equally often.
    for i in range(max(args.suite_runs, args.repeat)):
        runs = ([([], f"suite_{i}.xml")] if i < args.suite_runs else []) + (
            [([t], f"{Path(t.split('::')[0]).stem}_{i}.xml") for t in targets] if i < args.repeat else []
        )
        for chosen, name in runs:
            if deadline is not None and time.monotonic() > deadline:
                break
            reports.append(folder / name)
            run_pytest(chosen, reports[-1], extra if chosen else [])
        else:
            continue
        break
    table = count(reports)
    print("| test | pass | fail | error | skip |")
    print("|---|---:|---:|---:|---:|")
    for name, c in sorted(table.items(), key=lambda item: (-(item[1]["fail"] + item[1]["error"]), item[0])):
        print(f"| {name} | {c['pass']} | {c['fail']} | {c['error']} | {c['skip']} |")
    print(f"reports: {folder}", file=sys.stderr)
    return 1 if any(c["fail"] or c["error"] for c in table.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
