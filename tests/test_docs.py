"""The documentation's examples run, every docs page opens with one, and every relative link resolves.

Convention: a fenced ``python`` block in ``README.md`` or ``docs/*.md`` is *runnable* when the line right before
its opening fence is exactly ``<!-- runnable -->`` (an HTML comment, invisible when the Markdown is rendered).
Each runnable block is written to ``example.py`` in the test's ``tmp_path`` and run as
``python example.py`` with that folder as the working directory, as a user runs a saved script. Running it
as a file matters: with the default ``start_method="popen"`` Lightning re-runs ``sys.argv[0]`` once per
extra device, so a block that is only importable as a file (no ``if __name__ == "__main__":`` guard, as the
examples are written) is exercised as users run it; ``python -c`` would not be.

A runnable block must pass with exit status 0 within :data:`BLOCK_TIMEOUT_S` and leave no process behind,
and it must check something (contain an ``assert``): an example that cannot fail would not notice the
behaviour it documents going away. The exit status is that of the launching process (global rank 0), so an
example that checks values of other ranks gathers them to rank 0. Blocks that are not meant to run
(shell commands, fragments that need your own model or cluster) stay unmarked.

Examples are kept small (two CPU processes, a few batches, files written into the working directory), about
one per page: the whole file takes well under two minutes on two idle cores.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
from ddp_testing import session_members, start_session

ROOT = Path(__file__).resolve().parents[1]
MARKER = "<!-- runnable -->"
#: Wall-clock limit for one example (seconds): a two-process fit takes 5-15 s, a rank failure ~20 s.
BLOCK_TIMEOUT_S = 120
#: How long the processes an example started may take to exit after it (seconds).
EXIT_GRACE_S = 10.0


def doc_files() -> list[Path]:
    """README.md and every docs/*.md, in a stable order."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


@dataclass(frozen=True)
class Block:
    """One fenced code block: its file, the 1-based line of its opening fence, language, code, marked runnable."""

    path: Path
    line: int
    language: str
    code: str
    runnable: bool

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


_FENCE = re.compile(r"^(`{3,}|~{3,})\s*([\w+-]*)")


def code_blocks(path: Path) -> list[Block]:
    """Every fenced code block of a Markdown file, with whether the line before its fence is the marker."""
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks, i = [], 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        fence, language, start = opening.group(1), opening.group(2), i
        i += 1
        while i < len(lines) and not lines[i].startswith(fence):
            i += 1
        marked = start > 0 and lines[start - 1].strip() == MARKER
        blocks.append(Block(path, start + 1, language, "\n".join(lines[start + 1 : i]) + "\n", marked))
        i += 1
    return blocks


def runnable_blocks() -> list[Block]:
    return [b for path in doc_files() for b in code_blocks(path) if b.runnable]


def _kill_session(sid: int) -> None:
    try:
        os.killpg(sid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run_example(
    code: str, folder: Path, timeout_s: float = BLOCK_TIMEOUT_S, exit_grace_s: float = EXIT_GRACE_S
) -> subprocess.CompletedProcess[str]:
    """Run ``code`` as ``folder/example.py`` in ``folder``, in a session of its own; fail on leftover processes.

    The environment is the test's, less the suite's pin of the Lightning namespace (a user has none), with
    ``PYTHONUNBUFFERED`` so the ranks' lines arrive in order and one BLAS thread per process (2 ranks on 2 cores).
    """
    script = folder / "example.py"
    script.write_text(code, encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k != "DDP_STRATEGY_LIGHTNING"}
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    proc = start_session([sys.executable, script.name], cwd=folder, env=env)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _kill_session(proc.pid)
        out, _ = proc.communicate()
        pytest.fail(f"the example did not finish within {timeout_s:g} s; its output:\n{out[-6000:]}")
    deadline = time.monotonic() + exit_grace_s
    while (left := session_members(proc.pid)) and time.monotonic() < deadline:
        time.sleep(0.2)
    _kill_session(proc.pid)
    assert not left, f"the example left processes running: {left}; its output:\n{out[-6000:]}"
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, None)


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(BLOCK_TIMEOUT_S + 60)
@pytest.mark.parametrize("block", runnable_blocks(), ids=lambda b: b.id)
def test_runnable_block_runs(block, tmp_path):
    """A block marked runnable runs as a saved script, exits 0 and leaves no process behind."""
    result = run_example(block.code, tmp_path)
    assert result.returncode == 0, f"{block.id} exited with {result.returncode}:\n{result.stdout[-8000:]}"


def test_runnable_blocks_are_python_and_check_something():
    """Every marker sits right before a ``python`` fence, and every runnable block asserts something."""
    problems = []
    for path in doc_files():
        lines = path.read_text(encoding="utf-8").splitlines()
        for number, line in enumerate(lines, start=1):
            if line.strip() == MARKER:
                following = lines[number] if number < len(lines) else ""
                if not re.match(r"^`{3,}python\s*$", following):
                    problems.append(f"{path.relative_to(ROOT)}:{number}: marker not followed by a ```python fence")
    for block in runnable_blocks():
        if not re.search(r"^\s*assert\b", block.code, re.MULTILINE):
            problems.append(f"{block.id}: a runnable block without an assert cannot fail")
    assert len(runnable_blocks()) >= len(doc_files()), "expected at least one runnable block per page"
    assert not problems, "\n".join(problems)


def test_every_docs_page_starts_with_a_runnable_example():
    """Each docs page's first code block is runnable and comes before its first section heading."""
    pages = sorted((ROOT / "docs").glob("*.md"))
    assert pages, "docs/ has no pages"
    problems = []
    for page in pages:
        blocks = code_blocks(page)
        lines = page.read_text(encoding="utf-8").splitlines()
        sections = [n for n, line in enumerate(lines, start=1) if line.startswith("## ") and not _in_block(blocks, n)]
        if not blocks or not blocks[0].runnable:
            problems.append(f"{page.name}: the first code block is not marked runnable")
        elif sections and blocks[0].line > sections[0]:
            problems.append(f"{page.name}: the runnable example comes after the first section (line {sections[0]})")
    assert not problems, "\n".join(problems)


def _in_block(blocks: list[Block], line: int) -> bool:
    """Whether 1-based ``line`` is inside one of ``blocks`` (fences included)."""
    return any(b.line <= line <= b.line + b.code.count("\n") + 1 for b in blocks)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (``-`` and ``_`` kept), spaces to ``-``."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip())  # a link in a heading: its text
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors of a Markdown file's headings (outside code blocks), duplicates numbered as GitHub does."""
    blocks = code_blocks(path)
    seen: dict[str, int] = {}
    result = set()
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        heading = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not heading or _in_block(blocks, number):
            continue
        base = slug(heading.group(1))
        count = seen.get(base, 0)
        seen[base] = count + 1
        result.add(base if count == 0 else f"{base}-{count}")
    return result


def prose(path: Path) -> str:
    """The file's text with every fenced code block's lines emptied (line numbers unchanged)."""
    blocks = code_blocks(path)
    lines = path.read_text(encoding="utf-8").splitlines()
    return "\n".join("" if _in_block(blocks, n) else line for n, line in enumerate(lines, start=1))


_INLINE_CODE = re.compile(r"`([^`]+)`")  # may span a line break, as in Markdown


def _line_of(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def relative_links(path: Path) -> list[tuple[int, str]]:
    """``(line, target)`` of every Markdown link outside code blocks and inline code that is not a URL."""
    text = prose(path)
    text = _INLINE_CODE.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)  # blank inline code, keep lines
    found = []
    for match in re.finditer(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", text):
        target = match.group(1)
        if not re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: ...
            found.append((_line_of(text, match.start()), target))
    return found


def test_relative_links_point_to_existing_files_and_headings():
    """Every relative link in README and docs names a file that exists and, after ``#``, one of its headings."""
    problems = []
    for path in doc_files():
        for number, target in relative_links(path):
            file_part, _, anchor = target.partition("#")
            linked = (path.parent / file_part).resolve() if file_part else path
            where = f"{path.relative_to(ROOT)}:{number}: {target}"
            if not linked.exists():
                problems.append(f"{where}: no such file")
            elif anchor and (linked.suffix != ".md" or anchor not in anchors(linked)):
                problems.append(f"{where}: no heading with anchor #{anchor} in {linked.name}")
    assert not problems, "\n".join(problems)


def inline_code(path: Path) -> list[tuple[int, str]]:
    """``(line, text)`` of every inline code span outside fenced blocks (a span may continue on the next line)."""
    text = prose(path)
    return [(_line_of(text, m.start()), m.group(1).replace("\n", " ")) for m in _INLINE_CODE.finditer(text)]


_REPO_PATH = re.compile(r"(?<![\w./-])((?:ddp_strategy|benchmarks|notebooks|docs|tests|\.ci)/[\w./-]*[\w/])")
_PUBLIC_NAME = re.compile(r"(?<![\w./-])ddp_strategy((?:\.\w+)+)")
#: A bare file name (no folder) of a module or a page: it must be the name of some file of the repository.
_FILE_NAME = re.compile(r"(?<![\w./<-])([\w-]+\.(?:py|md))(?![\w/])")
#: Bare file names that are the user's, not the repository's: the script a docs example is saved as and run from
#: (``python example.py``) and the user's training script of the launch commands (``torchrun ... train.py``).
USER_FILES = {"example.py", "train.py"}


def repository_file_names() -> set[str]:
    """The names of the repository's files (hidden folders, caches and build outputs left out)."""
    names = set()
    for _folder, subfolders, files in os.walk(ROOT):
        subfolders[:] = [d for d in subfolders if not d.startswith((".", "__")) and not d.endswith(".egg-info")]
        names.update(files)
    return names


def names_of_tests() -> set[str]:
    """Every test module's name without ``.py`` and every test function's name, under ``tests/``."""
    names = set()
    for module in (ROOT / "tests").rglob("test_*.py"):
        names |= {module.stem, *re.findall(r"^\s*(?:async )?def (test_\w+)", module.read_text(), re.MULTILINE)}
    return names


def test_repository_paths_and_module_names_in_the_docs_exist():
    """Every repository path in inline code exists, every bare ``name.py``/``name.md`` is one of the repository's
    files (or the user's ``example.py``/``train.py``), every bare ``test_NAME`` is a test module or test function
    of ``tests/`` (or a ``Trainer`` attribute, ``test_dataloaders``), and every ``ddp_strategy.NAME`` is importable
    as written."""
    import importlib
    import importlib.util

    from ddp_strategy._compat import namespace

    files, tests, trainer = (
        repository_file_names() | USER_FILES,
        names_of_tests(),
        namespace.get("pytorch:Trainer"),
    )
    problems = []
    for path in doc_files():
        for number, span in inline_code(path):
            where = f"{path.relative_to(ROOT)}:{number}"
            for found in _REPO_PATH.findall(span):
                if "<" not in found and not (ROOT / found).exists():
                    problems.append(f"{where}: `{found}` does not exist")
            for name in _FILE_NAME.findall(span):
                if name not in files:
                    problems.append(f"{where}: `{name}` is no file of the repository")
            if re.fullmatch(r"test_\w+", span) and span not in tests and not hasattr(trainer, span):
                problems.append(f"{where}: `{span}` is no test module or test function in tests/")
            for dotted in _PUBLIC_NAME.findall(span):
                obj, names = importlib.import_module("ddp_strategy"), dotted.strip(".").split(".")
                for name in names:
                    if not hasattr(obj, name) and importlib.util.find_spec(f"{obj.__name__}.{name}") is not None:
                        importlib.import_module(f"{obj.__name__}.{name}")  # a sub-package not imported by default
                    if not hasattr(obj, name):
                        problems.append(f"{where}: `ddp_strategy{dotted}` has no attribute {name!r}")
                        break
                    obj = getattr(obj, name)
    for number, line in enumerate((ROOT / "README.md").read_text(encoding="utf-8").splitlines(), start=1):
        package = re.search(r"`(ddp_strategy/\w+/)`", line) if line.startswith("|") else None
        for module in re.findall(r"`((?!test_)\w+\.py)`", line) if package else []:
            if not (ROOT / package.group(1) / module).exists():  # a row names modules of its sub-package
                problems.append(f"README.md:{number}: `{module}` is not in `{package.group(1)}`")
    assert not problems, "\n".join(problems)


#: The README is the front page, read in five minutes (issue 48): its size in bytes, as ``wc -c README.md`` counts.
README_MAX_BYTES = 15_000


def test_the_readme_stays_short():
    """README.md is at most 15,000 bytes: long explanations go to the docs page of their step, which it links."""
    size = len((ROOT / "README.md").read_bytes())
    assert size <= README_MAX_BYTES, f"README.md is {size:,} bytes, over {README_MAX_BYTES:,}: move detail to docs/"


def test_the_harness_runs_examples_as_files_and_reports_failures(tmp_path):
    """The runner sees a failing assert as a non-zero exit, and runs the example as a file in its own folder."""
    failing = run_example("assert 1 + 1 == 3, 'arithmetic'\n", tmp_path)
    assert failing.returncode != 0 and "AssertionError: arithmetic" in failing.stdout
    as_file = run_example("import os, sys\nprint(os.path.abspath(sys.argv[0]), os.getcwd())\n", tmp_path)
    assert as_file.returncode == 0
    assert as_file.stdout.split() == [str(tmp_path / "example.py"), str(tmp_path)]


def _processes_running(marker: str, wait_s: float = 5.0) -> list[int]:
    """Live processes whose command line contains ``marker``, after waiting up to ``wait_s`` for them to go
    (SIGKILL takes effect asynchronously)."""
    deadline = time.monotonic() + wait_s
    while True:
        found = [
            proc.pid
            for proc in psutil.process_iter(["cmdline", "status"])
            if marker in " ".join(proc.info["cmdline"] or ()) and proc.info["status"] != psutil.STATUS_ZOMBIE
        ]
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


def test_the_harness_stops_hung_examples_and_reports_leftover_processes(tmp_path):
    """An example past its time limit fails and is killed with its children; one that leaves a child fails."""
    marker = f"docs-harness-{os.getpid()}"
    child = (
        "import subprocess, sys\n"  # a child that outlives the example, its output not tied to the example's
        f"subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)', {marker!r}],"
        " stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
    )
    with pytest.raises(pytest.fail.Exception, match="did not finish within 1 s"):
        run_example(child + "import time\ntime.sleep(60)\n", tmp_path, timeout_s=1)
    assert _processes_running(marker) == []
    with pytest.raises(AssertionError, match="left processes running"):
        run_example(child, tmp_path, exit_grace_s=1.0)
    assert _processes_running(marker) == []


def test_link_and_anchor_helpers(tmp_path):
    """The link checker's GitHub anchors and link extraction, on known headings and lines."""
    assert slug("Set up and train (command 1)") == "set-up-and-train-command-1"
    assert slug("`find_unused_parameters` (default `False`)") == "find_unused_parameters-default-false"
    assert slug("Differences from Lightning's DDPStrategy") == "differences-from-lightnings-ddpstrategy"
    page = tmp_path / "page.md"
    page.write_text(
        "# Title\n\nSee [a](other.md#x-y), [b](#title), [c](https://example.com), `[d](e.md)`.\n"
        "## Title\n\n```python\n# [f](g.md)\n```\nA `span over\n[h](i.md) two lines`, [j](k.md).\n",
        encoding="utf-8",
    )
    assert relative_links(page) == [(3, "other.md#x-y"), (3, "#title"), (10, "k.md")]
    assert anchors(page) == {"title", "title-1"}
    assert inline_code(page) == [(3, "[d](e.md)"), (9, "span over [h](i.md) two lines")]


def test_bare_file_names_are_found_in_inline_code():
    """The docs check takes a bare module or page name from a span, and leaves paths and placeholders to the others."""
    spans = "run a.py, see docs/b.md or c.md, not <name>.py, x.pyc or tests/d.py; my-notes.md"
    assert _FILE_NAME.findall(spans) == ["a.py", "c.md", "my-notes.md"]
