"""Seeded sweep of bad inputs: the suite's fuzz tests with many more examples than the suite tries.

Usage: python benchmarks/fuzz_inputs.py [--examples N] (default 300 per kind; a few minutes on 2 cores)

Runs the suite's Hypothesis tests (derandomized: the same inputs on every run) in one pytest process with
``DDP_FUZZ_EXAMPLES=N``: for checkpoint files (tests/checkpoint/test_checkpoint_fuzz.py: random bytes,
truncations, bit flips, zip members removed or rewritten, valid pickles of the wrong content, a missing file, a
directory, an unreadable file) each input goes through all four loaders (DDPCheckpointIO.load_checkpoint,
load_plain_state_dict, import_plain_checkpoint, export_weights) and must give one of the errors the loader's
docstring promises, or load a valid checkpoint unchanged; launch variables
(tests/process/test_launch_errors.py) go through launching.check_launch_env and must be accepted, or refused
with a ValueError naming the variable. Prints each test's result and Hypothesis' statistics; exit status 1 if any
input gave another outcome. The benchmark runs the tests, it does not import them.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FUZZ_TESTS = [
    "tests/checkpoint/test_checkpoint_fuzz.py",
    "tests/process/test_launch_errors.py::test_launch_variables_fuzz",
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=300, help="inputs per kind (default 300)")
    n = parser.parse_args().examples
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-p",
        "no:cacheprovider",
        "-n",
        "0",
        "--timeout=0",
        "-v",
        "--hypothesis-show-statistics",
        *FUZZ_TESTS,
    ]
    return subprocess.run(command, cwd=ROOT, env={**os.environ, "DDP_FUZZ_EXAMPLES": str(n)}).returncode


if __name__ == "__main__":
    sys.exit(main())
