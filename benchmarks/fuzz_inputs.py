"""Seeded sweep of bad inputs: many more than the suite tries, with a table of what each kind gave.

Usage: python benchmarks/fuzz_inputs.py [--examples N] (default 300 per kind; a few minutes on 2 cores)

Uses the suite's own generators (tests/checkpoint/checkpoint_fuzzing.py, Hypothesis derandomized: the same inputs on
every run). For checkpoint files each input goes through all four loaders (DDPCheckpointIO.load_checkpoint,
load_plain_state_dict, import_plain_checkpoint, export_weights); a "documented" outcome is one of the
errors the loader's docstring promises, "loaded" a valid checkpoint (for bit flips and removed members:
only with exactly the original content, else it counts as OTHER). Launch variables go through
launching.check_launch_env ("accepted": values in range for Lightning and for us). Exit status 1 if any
OTHER outcome occurred.
"""

from __future__ import annotations

import argparse
import collections
import shutil
import sys
import tempfile
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "checkpoint"))

from checkpoint_fuzzing import (  # noqa: E402
    flip_bit,
    loads_unchanged,
    outcomes,
    reference_checkpoint,
    rewrite_zip,
    saved,
    unreadable_outcomes,
    write,
    wrong_objects,
    zip_member_names,
)
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from lightning.fabric.plugins.environments import LightningEnvironment, TorchElasticEnvironment  # noqa: E402

from ddp_strategy.process import check_launch_env  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=300, help="inputs per kind (default 300)")
    n = parser.parse_args().examples
    good = reference_checkpoint()
    names = zip_member_names(good)
    folder = Path(tempfile.mkdtemp(prefix="ddp_fuzz_bench_"))
    rows: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    tried: collections.Counter = collections.Counter()
    fuzz = settings(max_examples=n, derandomize=True, deadline=None, database=None,
                    suppress_health_check=list(HealthCheck))

    def record(kind: str, data: bytes, must_be_original: bool = False) -> None:
        path = write(folder, data)
        tried[kind] += 1
        for outcome in outcomes(path, folder).values():
            if outcome == "loaded" and must_be_original and not loads_unchanged(path, good):
                outcome = "OTHER: loaded changed content"
            rows[kind][outcome[:120]] += 1

    @fuzz
    @given(st.binary(max_size=8192))
    def random_bytes(data):
        record("random bytes (0-8 KiB)", data)

    @fuzz
    @given(st.integers(0, len(good) - 1))
    def truncated(length):
        record("truncated valid checkpoint", good[:length])

    @fuzz
    @given(st.integers(0, len(good) - 1), st.integers(0, 7))
    def flipped(position, bit):
        record("single bit flip", flip_bit(good, position, bit), must_be_original=True)

    @fuzz
    @given(st.integers(0, len(names) - 1), st.none() | st.binary(max_size=64))
    def member(index, replacement):
        legit = replacement is not None and ("/data/" in names[index] or names[index].endswith("byteorder"))
        record("zip member removed/rewritten", rewrite_zip(good, index, replacement), must_be_original=not legit)

    @fuzz
    @given(wrong_objects)
    def wrong(obj):
        record("valid pickle, wrong content", saved(obj))

    @fuzz
    @given(st.dictionaries(st.sampled_from(["MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK"]),
                           st.one_of(st.text(max_size=6), st.integers(-(2**40), 2**40).map(str)), max_size=5),
           st.booleans())
    def launch_env(environ, elastic):
        tried["launch variables"] += 1
        env_rows = rows["launch variables"]
        env = TorchElasticEnvironment() if elastic else LightningEnvironment()
        try:
            check_launch_env(env, 1, 2, {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", **environ}
                             if elastic else environ)
            env_rows["loaded"] += 1
        except ValueError as e:
            env_rows["documented: ValueError" if any(k in str(e) for k in ("MASTER_PORT", "RANK", "WORLD_SIZE"))
                     else f"OTHER: unnamed {e}"] += 1
        except Exception as e:
            env_rows[f"OTHER: {type(e).__name__}: {e}"] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Hypothesis' own; the loaders run with warnings as errors inside
        for run in (random_bytes, truncated, flipped, member, wrong, launch_env):
            print(f"running {run.__name__} ...", file=sys.stderr, flush=True)
            run()
    for kind, data in (("missing file", None), ("directory", None), ("unreadable file (chmod 000)", good)):
        tried[kind] += 1
        if kind == "unreadable file (chmod 000)":
            result = unreadable_outcomes(data)
        else:
            path = folder / "missing.ckpt" if kind == "missing file" else folder / "a_dir"
            if kind == "directory":
                path.mkdir(exist_ok=True)
            result = outcomes(path, folder)
        for outcome in result.values():
            rows[kind][outcome[:120]] += 1

    print("| kind of input | inputs tried | loader calls | documented error (by type) | loaded / accepted (valid)"
          " | other outcomes |")
    print("|---|---:|---:|---|---:|---|")
    failed = False
    for kind, counts in rows.items():
        other = {k: v for k, v in counts.items() if k.startswith("OTHER")}
        failed |= bool(other)
        documented = {k.split(": ", 1)[1]: v for k, v in sorted(counts.items()) if k.startswith("documented")}
        by_type = ", ".join(f"{name} {v}" for name, v in documented.items())
        print(f"| {kind} | {tried[kind]} | {sum(counts.values())} | {sum(documented.values())} ({by_type}) |"
              f" {counts.get('loaded', 0)} | {sum(other.values())}{' ' + str(other) if other else ''} |")
    shutil.rmtree(folder, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
