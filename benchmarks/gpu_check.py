"""The CUDA/NCCL path on one GPU (issue 52): each part prints one line, PASS, FAIL or SKIPPED. Runs anywhere.

    python benchmarks/gpu_check.py                          # on a GPU: under 8 minutes (--budget 420 s)
    CUDA_VISIBLE_DEVICES= python benchmarks/gpu_check.py    # the dry run, seconds: every GPU part SKIPPED
    python benchmarks/gpu_check.py --parts fit,sync-debug --json out.json --log parts.log

One process group of world size 1 on NCCL: two ranks cannot share one GPU under NCCL, so nothing here tests NCCL
between ranks (the line ``two-ranks`` says so). The parts, in order:

    self-check  always, on the CPU: everything below imported, every fit's Trainer built on the CPU (nothing fitted),
                the cuda tests found, the timing tables rendered from fake numbers
    cuda-tests  ``pytest -m cuda`` on the test files that hold such tests
    fit         DigitsClassifier and DigitsDataModule on accelerator="gpu", devices=1, strategy="ddp" and
                MyDDPStrategy(): nccl, device_ids [0], accuracy; each last checkpoint loaded on the CPU into DigitsNet
                (load_plain_state_dict) and compared with the trained weights and the GPU's predictions; ours vs ddp
    bf16        precision="bf16-mixed": bfloat16 logits, float32 parameters, accuracy; ours vs ddp
    sync-bn     sync_batchnorm=True on a BatchNorm variant: torch.nn.SyncBatchNorm while fitting, BatchNorm after
    comm-hooks  MyDDPStrategy(ddp_comm_hook="fp16"), then "powersgd", on NCCL: bytes and dtypes all-reduced per step
    sync-debug  torch.cuda.set_sync_debug_mode("error") around 20 steady-state steps, MyDDPStrategy then Lightning's
                ddp: a host-device sync raises, and the FAIL line names where (file:line function)
    two-ranks   SKIPPED on one GPU, saying why
    timing      bench_workloads.py's "gpu" workload (a CNN of 3.55 M parameters, batch 32, 300 steps) under the
                hand-written DDP loop, Lightning's ddp and MyDDPStrategy, interleaved (bench_runs.run_one, fresh
                processes), --repeats rounds while the budget lasts; bench_ddp.py's tables, then the step-time ratios
                against the target, MyDDPStrategy within 2% of Lightning's ddp (FAIL above it)

Each part runs in processes of its own (the fits: this file with ``--child``; the tests: pytest; the timing:
``ddp_worker.py``), killed at its time limit; their output goes to ``--log``. A part that would start after
``--budget`` seconds is SKIPPED. Exit status 1 if a part failed, else 0 (all passed or skipped).

On the GPU machine of the workplace's device tool (Python 3.12, torch 2.11, no package registry):

* Wheels: none needed. Its image holds torch, lightning, pytorch-lightning, lightning-utilities, torchmetrics,
  scikit-learn, typing-extensions, psutil, pytest, pytest-timeout and pytest-xdist (``KINDS.md``'s list of
  2026-11-17; pytorch-lightning 2.6.6, torchmetrics 1.9.0). ``jsonargparse`` is missing, but only ``ddp_strategy.cli``
  (the LightningCLI main job) needs it, and nothing here imports that. The command's first line prints the versions:
  if ``lightning`` is missing or outside 2.4-2.6, download its wheel here into ``.whl`` (the device README's
  ``pip download --no-deps ... -d .whl lightning==<pytorch-lightning's version there>``; pure Python, nothing else
  missing) and the command installs it.
* The package has no wheel: this script puts the checkout first on its own path and on its children's PYTHONPATH,
  so nothing needs installing. ``python3 -m pip install --no-deps --no-build-isolation -e .`` works too (with build
  isolation pip would fetch setuptools, and there is no registry).
* Lightning's namespace: the script, the benchmark workers and the cuda tests import ``lightning``, so the script
  sets ``DDP_STRATEGY_LIGHTNING=lightning`` for itself and its children (both namespaces are installed there). The
  package alone also runs on ``pytorch_lightning`` (``DDP_STRATEGY_LIGHTNING=pytorch_lightning``,
  ``ddp_strategy/_compat/namespace.py``), but this check does not.
* The one call of the device tool, from the root of the session's checkout (480 s: the 420 s budget, start-up and
  slack; about half the session's 15 minutes, so a failing part can be rerun alone with ``--parts``)::

    run(
        command=(
            "python3 -m pip list 2>/dev/null | grep -iE '^(torch|lightning|pytorch-lightning|torchmetrics|"
            "lightning-utilities|scikit-learn|pytest) '; nvidia-smi -L; "
            "if [ -d .whl ]; then python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir"
            " --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site; fi; "
            "PYTHONUNBUFFERED=1 python3 benchmarks/gpu_check.py --json $OUT/gpu_check.json --log $OUT/gpu_check.log"
        ),
        timeout_s=480,
        carry=[".whl"],
    )

Code layout: this file owns the command line, the order of the parts, their processes and the report; the fits and
their checks are in ``gpu_fits.py``; the timing reuses ``bench_runs.py``, ``bench_stats.py`` and ``bench_tables.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ElementTree
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

STARTED = time.monotonic()  # before the imports below, which take most of a dry run's seconds
HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(HERE), str(ROOT)]  # the other benchmark modules; ddp_strategy from this checkout, installed or not
os.environ.setdefault("DDP_STRATEGY_LIGHTNING", "lightning")  # before gpu_fits imports ddp_strategy (see docstring)

import handwritten_worker  # noqa: E402  (the timing's runs import it in their own processes; a break shows here)
import torch  # noqa: E402
from bench_machine import machine_info, usable_cores  # noqa: E402
from bench_recorder import StepRecorder  # noqa: E402
from bench_runs import WORKER, RunResult, run_one  # noqa: E402
from bench_stats import aggregate, loss_note, ratios  # noqa: E402
from bench_tables import render  # noqa: E402
from bench_workloads import IMPLS, WORKLOADS, build_model  # noqa: E402
from gpu_fits import CHECKS, SEED, CheckFailed, expect, place  # noqa: E402

#: The parts after the self-check, in the order they run.
PARTS = ("cuda-tests", *CHECKS, "two-ranks", "timing")
#: Time limit of each part's process, seconds.
PART_TIMEOUT_S = {"cuda-tests": 240, "fit": 120, "bf16": 90, "sync-bn": 90, "comm-hooks": 90, "sync-debug": 90}
#: Time limit of one timing run (one implementation, fresh processes), seconds.
RUN_TIMEOUT_S = 90
#: A part starts only with this much of the budget left, seconds (the timing: twice this).
MIN_LEFT_S = 30
#: A timing run starts only with this much of the budget left, seconds.
MIN_RUN_LEFT_S = 40
WORKLOAD = "gpu"
#: Issue 52's target: MyDDPStrategy's step time at most this times Lightning's ddp's (median of paired ratios).
STEP_VS_LIGHTNING_MAX = 1.02
CUDA_MARK = "@pytest.mark.cuda"
#: Step times of the self-check's fake timing runs, milliseconds.
FAKE_STEP_MS = {"handwritten": 4.0, "lightning": 4.4, "ours": 4.43}


@dataclass
class Outcome:
    """One part's result: ``status`` is PASS, FAIL or SKIPPED; ``detail`` completes its line."""

    part: str
    status: str
    detail: str
    seconds: float = 0.0

    def line(self) -> str:
        return f"{self.status} {self.part}: {self.detail}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    # --help tells how to run it; the GPU machine's recipe and the code layout are for readers of the source.
    description = __doc__.partition("\n\nOn the GPU machine")[0] + "\n"
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", default=",".join(PARTS), help="comma-separated, from " + ",".join(PARTS))
    p.add_argument("--budget", type=float, default=420.0, help="seconds for all parts; later ones are SKIPPED")
    p.add_argument("--repeats", type=int, default=5, help="interleaved timing rounds at most")
    p.add_argument("--steps", type=int, default=WORKLOADS[WORKLOAD].steps, help="optimizer steps per timing run")
    p.add_argument("--warmup", type=int, default=20, help="leading timing steps left out of the statistics")
    p.add_argument("--json", default=None, help="also write every part's outcome and the timing here")
    p.add_argument("--log", default=None, help="the parts' processes' output [a file in the temporary folder]")
    p.add_argument("--child", choices=sorted(CHECKS), help=argparse.SUPPRESS)  # one check, in this process
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)  # where --child writes its outcome
    args = p.parse_args(argv)
    args.part_list = [name.strip() for name in args.parts.split(",") if name.strip()]
    if unknown := [name for name in args.part_list if name not in PARTS]:
        p.error(f"unknown part(s) {unknown}; choose from {list(PARTS)}")
    if args.child and not args.result:
        p.error("--child needs --result")
    if args.repeats < 1 or args.warmup < 1 or args.steps < args.warmup + 2:
        p.error("--repeats and --warmup must be >= 1, --steps >= --warmup + 2")
    return args


def no_gpu_reason() -> str | None:
    """Why the GPU parts cannot run here, or None when CUDA is available."""
    if torch.cuda.is_available():
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return (
        f"no CUDA device (torch {torch.__version__}, CUDA {torch.version.cuda or 'not built in'},"
        f" CUDA_VISIBLE_DEVICES {'unset' if visible is None else repr(visible)})"
    )


def header() -> dict[str, Any]:
    """What ran where: the GPU(s), Python and the versions the check depends on."""
    found: dict[str, Any] = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda}
    for name in ("lightning", "pytorch-lightning", "torchmetrics"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            found[name] = metadata.version(name)
    if torch.cuda.is_available():
        found["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return found


def run_process(cmd: list[str], cwd: Path, timeout_s: float, log: Path, title: str) -> tuple[str | None, list[str]]:
    """Run ``cmd`` in a session of its own, killed with everything it started at ``timeout_s`` seconds or when it
    ends; its output is appended to ``log`` under a line naming ``title``. Returns what went wrong (None, ``"exit
    code 1"``, ``"timed out after 90 s"``) and the output's last 20 lines."""
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, text=True)
        try:
            code = proc.wait(timeout=timeout_s)
            problem = None if code == 0 else f"exit code {code}"
        except subprocess.TimeoutExpired:
            problem = f"timed out after {timeout_s:.0f} s"
        finally:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        out.seek(0)
        output = out.read()
    with log.open("a") as f:
        f.write(f"\n===== {title}: {' '.join(cmd)}\n{output}")
    return problem, output.strip().splitlines()[-20:]


def run_check(name: str, timeout_s: float, log: Path) -> Outcome:
    """One of :data:`gpu_fits.CHECKS` in a fresh process (this file with ``--child``), in a temporary folder."""
    with tempfile.TemporaryDirectory(prefix=f"gpu_check_{name}_") as folder:
        result = Path(folder) / "result.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", name, "--result", str(result)]
        problem, tail = run_process(cmd, Path(folder), timeout_s, log, name)
        if result.exists():
            return Outcome(name, **json.loads(result.read_text()))
    return Outcome(name, "FAIL", f"{problem or 'no result'}; its last line: {tail[-1] if tail else '(no output)'}")


def run_child(name: str, result: Path) -> int:
    """``--child NAME``: plan and check one of :data:`gpu_fits.CHECKS` on the GPU here; write its status and detail
    to ``result`` as JSON. Exit status 0 once written."""
    plan, check = CHECKS[name]
    try:
        status, detail = "PASS", check(plan("gpu", Path.cwd()))
    except CheckFailed as e:
        status, detail = "FAIL", str(e)
    except Exception as e:
        traceback.print_exc()
        status, detail = "FAIL", f"{type(e).__name__}: {' '.join(str(e).split())[:400]} (at {place(e)})"
    result.write_text(json.dumps({"status": status, "detail": detail}))
    return 0


def cuda_test_files() -> list[Path]:
    """The test files that hold a test marked ``cuda``."""
    return sorted(path for path in (ROOT / "tests").rglob("test_*.py") if CUDA_MARK in path.read_text())


def run_cuda_tests(timeout_s: float, log: Path) -> Outcome:
    """``pytest -m cuda`` on :func:`cuda_test_files`, in one process; counts read from its JUnit report."""
    files = [str(path.relative_to(ROOT)) for path in cuda_test_files()]
    with tempfile.TemporaryDirectory(prefix="gpu_check_pytest_") as folder:
        report = Path(folder) / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", "-m", "cuda", "-n", "0", "-p", "no:cacheprovider"]
        problem, tail = run_process([*cmd, f"--junitxml={report}", *files], ROOT, timeout_s, log, "cuda-tests")
        if not report.exists():
            return Outcome("cuda-tests", "FAIL", f"{problem}, no report; last line: {tail[-1] if tail else ''}")
        root = ElementTree.parse(report).getroot()
        suites = list(root.iter("testsuite"))
        counts = {key: sum(int(s.get(key, 0)) for s in suites) for key in ("tests", "failures", "errors", "skipped")}
        failed = [
            case.get("name", "?")
            for case in root.iter("testcase")
            if case.find("failure") is not None or case.find("error") is not None
        ]
    passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    detail = (
        f"{passed} passed, {counts['failures'] + counts['errors']} failed, {counts['skipped']} skipped"
        f" ({', '.join(files)})"
        + (f"; failed: {', '.join(failed)}" if failed else "")
        + (f"; {problem}" if problem else "")
    )
    return Outcome("cuda-tests", "PASS" if problem is None and passed > 0 else "FAIL", detail)


def two_ranks(gpus: int) -> Outcome:
    """Always SKIPPED: why nothing here runs two ranks on NCCL (or, with 2 GPUs, what does)."""
    if gpus >= 2:
        return Outcome("two-ranks", "SKIPPED", f"{gpus} GPUs: the timing runs 2 ranks too; the fits stay on one")
    return Outcome(
        "two-ranks",
        "SKIPPED",
        "one GPU: NCCL needs a GPU per rank (a second rank on the same GPU fails, 'Duplicate GPU detected'), so every"
        " part runs one rank and nothing here tests NCCL between ranks",
    )


def timing_settings(args: argparse.Namespace, world_sizes: list[int]) -> argparse.Namespace:
    """The settings ``bench_runs.run_one``, ``bench_stats.aggregate`` and ``bench_tables.render`` read."""
    return argparse.Namespace(
        workload_list=[WORKLOAD],
        impl_list=list(IMPLS),
        world_size_list=world_sizes,
        steps_for={WORKLOAD: args.steps},
        warmup=args.warmup,
        repeats=0,
        seed=SEED,
        device="cuda",
        cores=usable_cores(),
        timeout=RUN_TIMEOUT_S,
        pg_timeout=60.0,
        total_s=0.0,
        load_avg={},
    )


def timing_report(
    results: list[RunResult], settings: argparse.Namespace, machine: dict[str, Any]
) -> tuple[str, dict[int, dict[str, Any]]]:
    """``bench_ddp.py``'s markdown tables of ``results``, then the issue-52 target table; and the paired ratios
    MyDDPStrategy / reference per world size (``bench_stats.ratios``)."""
    loads = [res.load_avg for res in results]
    settings.load_avg = {"median": statistics.median(loads), "max": max(loads)}
    agg = aggregate(results, settings)
    markdown = render(agg, machine, settings, list(IMPLS), [note for note in [loss_note(agg)] if note])
    found = {ws: ratios(agg, WORKLOAD, ws) or {} for ws in settings.world_size_list}
    rows = []
    for ws, rat in found.items():
        cells = [_ratio(rat.get(f"median_step_s/{ref}")) for ref in ("lightning", "handwritten")]
        rows.append(f"| {ws} | {cells[0]} | {cells[1]} | {'✓' if _meets_target(rat) else '✗'} |")
    return markdown + "\n".join(
        [
            "",
            f"Issue 52: MyDDPStrategy's step time at most {STEP_VS_LIGHTNING_MAX:.2f} x Lightning's ddp (median of"
            " the per-repeat ratios, range over repeats).",
            "",
            "| ranks | step ÷ Lightning ddp | step ÷ hand-written | within 2% of Lightning ddp |",
            "|---|---|---|---|",
            *rows,
            "",
        ]
    ), found


def _ratio(r: dict[str, float] | None) -> str:
    return "n/a" if r is None else f"{r['median']:.3f} ({r['min']:.3f}–{r['max']:.3f})"


def _meets_target(rat: dict[str, Any]) -> bool:
    return rat.get("median_step_s/lightning", {}).get("median", float("inf")) <= STEP_VS_LIGHTNING_MAX


def run_timing(args: argparse.Namespace, deadline: float, gpus: int) -> tuple[Outcome, dict[str, Any] | None]:
    """Interleaved rounds of the three implementations (the order rotated per block, as ``bench_runs.run_all``): a
    new round only while the budget holds one as long as the last, a run only with :data:`MIN_RUN_LEFT_S` left and
    stopped at the budget's end. FAIL on a failed run or a missed target."""
    settings = timing_settings(args, [1, 2] if gpus >= 2 else [1])
    results: list[RunResult] = []
    started, block, last_round_s, out_of_time = time.monotonic(), 0, 0.0, False
    for repeat in range(args.repeats):
        round_started = time.monotonic()
        if out_of_time or deadline - round_started < 1.2 * last_round_s:
            break
        for ws in settings.world_size_list:
            order = list(IMPLS[block % len(IMPLS) :] + IMPLS[: block % len(IMPLS)])
            block += 1
            for position, impl in enumerate(order):
                left = deadline - time.monotonic()
                out_of_time = out_of_time or left < MIN_RUN_LEFT_S
                if out_of_time:
                    continue
                settings.timeout = min(RUN_TIMEOUT_S, left)
                results.append(run_one(impl, WORKLOAD, ws, args.steps, settings, repeat, position))
                res = results[-1]
                print(f"# timing {repeat} {impl} ranks={ws}: {res.wall_s:.1f} s {res.error or 'ok'}", file=sys.stderr)
        settings.repeats = repeat + 1
        last_round_s = time.monotonic() - round_started
    if not results:
        return Outcome("timing", "SKIPPED", "no time left in the budget (--budget) for a run"), None
    settings.total_s = time.monotonic() - started
    markdown, found = timing_report(results, settings, machine_info("cuda"))
    failures = [f"{r.impl} ranks={r.world_size}: {(r.error or '').splitlines()[0]}" for r in results if not r.ok]
    summary = "; ".join(
        f"{ws} rank(s): step ÷ Lightning ddp {_ratio(rat.get('median_step_s/lightning'))},"
        f" ÷ hand-written {_ratio(rat.get('median_step_s/handwritten'))}"
        for ws, rat in found.items()
    )
    ok = not failures and all(_meets_target(rat) for rat in found.values())
    detail = f"{summary}; target ≤ {STEP_VS_LIGHTNING_MAX:.2f}; {settings.repeats} round(s) of {args.steps} steps" + (
        f"; failed runs: {'; '.join(failures)}" if failures else ""
    )
    record = {"markdown": markdown, "ratios": found, "failures": failures, "settings": vars(settings)}
    return Outcome("timing", "PASS" if ok else "FAIL", detail), record


def fake_results(folder: Path, settings: argparse.Namespace) -> list[RunResult]:
    """Two rounds of one rank as the timing returns them, each rank's file written by ``bench_recorder``'s
    ``StepRecorder`` with set step times (:data:`FAKE_STEP_MS`, times 1.00 and 1.02 per round) for measured ones."""
    results = []
    steps = settings.steps_for[WORKLOAD]
    for repeat, scale in enumerate((1.0, 1.02)):
        for position, impl in enumerate(IMPLS):
            recorder = StepRecorder(torch.device("cpu"))
            recorder.step_start()
            recorder.step_end(torch.tensor(2.25), last=True)
            step_s = FAKE_STEP_MS[impl] * scale / 1e3
            recorder.starts = [i * step_s for i in range(steps)]
            recorder.ends = [(i + 1) * step_s for i in range(steps)]
            recorder.finish(0, 1, folder / f"{impl}{repeat}", {"impl": impl})
            ranks = [json.loads((folder / f"{impl}{repeat}" / "rank0.json").read_text())]
            results.append(RunResult(impl, WORKLOAD, 1, repeat, position, True, 10.0, ranks, load_avg=0.5))
    return results


def self_check(args: argparse.Namespace, folder: Path) -> tuple[Outcome, str]:
    """Without a GPU: every check's fits built on the CPU, the cuda tests found, the timing's workload and workers
    there, the timing tables rendered from :func:`fake_results`. Returns the outcome and the fake tables."""
    started, lightning_log = time.monotonic(), logging.getLogger("lightning.pytorch")
    level = lightning_log.level
    lightning_log.setLevel(logging.WARNING)  # not a line per Trainer built ("GPU available: False, ...")
    try:
        fits = sum(len(plan("cpu", folder / name)) for name, (plan, _) in CHECKS.items())
        files = cuda_test_files()
        expect(bool(files), f"no test file under {ROOT / 'tests'} holds {CUDA_MARK}")
        parameters = sum(p.numel() for p in build_model(WORKLOADS[WORKLOAD]).parameters())
        expect(10**6 <= parameters <= 10**7, f"the {WORKLOAD} workload has {parameters} parameters, not a few million")
        expect(WORKER.exists() and callable(handwritten_worker.run), f"no timing worker {WORKER}")
        expect(callable(getattr(torch.cuda, "set_sync_debug_mode", None)), "torch.cuda.set_sync_debug_mode is gone")
        settings = timing_settings(args, [1])
        settings.repeats, settings.total_s = 2, 20.0
        markdown, found = timing_report(fake_results(folder, settings), settings, machine_info("cpu"))
        ratio = found[1]["median_step_s/lightning"]["median"]
        expected = FAKE_STEP_MS["ours"] / FAKE_STEP_MS["lightning"]
        expect(
            abs(ratio - expected) < 1e-9
            and f"| {WORKLOAD} | 1 | MyDDPStrategy |" in markdown
            and "| 1 | 1.007" in markdown,
            f"the fake timing gave step ÷ Lightning ddp {ratio}, not {expected}, or its table is off:\n{markdown}",
        )
    except Exception as e:
        traceback.print_exc()
        failed = f"{type(e).__name__}: {' '.join(str(e).split())[:400]} (at {place(e)})"
        return Outcome("self-check", "FAIL", failed, round(time.monotonic() - started, 1)), ""
    finally:
        lightning_log.setLevel(level)
    detail = (
        f"imports; {fits} fits of {len(CHECKS)} checks built on the CPU; {len(files)} files with cuda tests; the"
        f" {WORKLOAD} workload has {parameters / 1e6:.2f} M parameters; the timing tables render (fake numbers: step"
        f" ÷ Lightning ddp {ratio:.3f} ✓)"
    )
    return Outcome("self-check", "PASS", detail, round(time.monotonic() - started, 1)), markdown


def main(argv: list[str] | None = None) -> int:
    """Run the self-check, then each part in order (see the module docstring); exit status 1 if a part failed."""
    args = parse_args(argv)
    if args.child:
        return run_child(args.child, Path(args.result))
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    deadline = time.monotonic() + args.budget
    log = Path(args.log) if args.log else Path(tempfile.gettempdir()) / f"gpu_check_{os.getpid()}.log"
    machine, no_gpu = header(), no_gpu_reason()
    gpus = len(machine.get("gpus", []))
    print("# gpu_check: " + ", ".join(f"{k} {v}" for k, v in machine.items()), flush=True)
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as folder:
        checked, fake_markdown = self_check(args, Path(folder))
    outcomes, timing = [checked], None
    print(checked.line(), flush=True)
    for part in args.part_list:
        part_started = time.monotonic()
        left = deadline - part_started
        if no_gpu:
            outcome = Outcome(part, "SKIPPED", no_gpu)
        elif part == "two-ranks":
            outcome = two_ranks(gpus)
        elif left < MIN_LEFT_S * (2 if part == "timing" else 1):
            outcome = Outcome(part, "SKIPPED", f"{left:.0f} s of the {args.budget:.0f} s budget left (--budget)")
        elif part == "cuda-tests":
            outcome = run_cuda_tests(min(PART_TIMEOUT_S[part], left), log)
        elif part == "timing":
            outcome, timing = run_timing(args, deadline, gpus)
        else:
            outcome = run_check(part, min(PART_TIMEOUT_S[part], left), log)
        outcome.seconds = round(time.monotonic() - part_started, 1)
        outcomes.append(outcome)
        print(outcome.line(), flush=True)
        if part == "timing" and timing is not None:
            print("\n" + timing["markdown"], flush=True)
    counts = {s: sum(o.status == s for o in outcomes) for s in ("PASS", "FAIL", "SKIPPED")}
    total = time.monotonic() - STARTED
    print(
        f"# gpu_check: {counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIPPED']} skipped in {total:.0f} s"
        + (f"; the parts' output: {log}" if log.exists() else ""),
        flush=True,
    )
    if args.json:
        payload = {
            "machine": machine,
            "budget_s": args.budget,
            "total_s": round(total, 1),
            "parts": [asdict(o) for o in outcomes],
            "timing": timing,
            "fake_timing_markdown": fake_markdown,
        }
        Path(args.json).write_text(json.dumps(payload, indent=2, default=str) + "\n")
    return 1 if counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
