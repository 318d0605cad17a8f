"""The package's layout: the four steps as sub-packages, small modules, no import cycles, no reaching inside.

These tests read the source (no import), so they are fast and fail with the offending module named.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "ddp_strategy"
#: A module past this many lines is probably two concerns (STYLE.md); the strategy only orchestrates.
MAX_MODULE_LINES = 400
MAX_STRATEGY_LINES = 400  # issue 25: hooks that do their work, in hook order
#: Which sub-packages each part may import (through the sub-package's public names), lowest layer first.
ALLOWED = {
    "_compat": set(),
    "process": {"_compat"},
    "sampling": {"_compat", "process"},
    "sync": {"_compat", "process"},
    "checkpoint": {"_compat"},
    "diagnostics": {"_compat", "process"},
    "reference": {"_compat", "process", "sampling", "diagnostics"},
    "options": {"_compat", "process", "sync"},
    "strategy": {"_compat", "process", "sampling", "sync", "checkpoint", "diagnostics", "options"},
    "cli": {"_compat", "reference", "strategy"},
    "__main__": {"cli"},
    "__init__": {"_compat", "process", "sampling", "sync", "checkpoint", "reference", "strategy"},
    "testing": {"process"},  # besides process.free_port, the kit uses only public names, as a user's test does
}
SUBPACKAGES = ("_compat", "process", "sampling", "sync", "checkpoint", "reference", "testing")


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def runtime_imports(path: Path) -> list[tuple[str, list[str], int]]:
    """``(module, names, line)`` of every import outside ``if TYPE_CHECKING:`` blocks, function bodies included."""
    tree = ast.parse(path.read_text())
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(child) for stmt in node.body for child in ast.walk(stmt))
    found = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.module, [a.name for a in node.names], node.lineno))
        elif isinstance(node, ast.Import):
            found.extend((a.name, [], node.lineno) for a in node.names)
    return found


def import_graph(root: Path, prefix: str, files: list[Path]) -> dict[str, set[str]]:
    """module -> modules it imports (a ``from pkg import submodule`` counts as importing the submodule)."""
    modules = {module_name(f, root) for f in files}
    graph: dict[str, set[str]] = {}
    for f in files:
        edges = set()
        for module, names, _ in runtime_imports(f):
            if not (module == prefix or module.startswith(prefix + ".")) and prefix:
                continue
            subs = {f"{module}.{n}" for n in names if f"{module}.{n}" in modules}
            edges |= subs or ({module} if module in modules else set())
        graph[module_name(f, root)] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def package_files() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def part_of(module: str) -> str:
    """``ddp_strategy.sampling.sampler`` -> ``sampling``; ``ddp_strategy.strategy`` -> ``strategy``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_every_step_is_a_subpackage_with_a_docstring_saying_what_it_owns():
    """process/, sampling/, sync/, checkpoint/ (and reference/, _compat/) each say what they own."""
    for name in SUBPACKAGES:
        init = PACKAGE / name / "__init__.py"
        assert init.exists(), name
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc and "Owns:" in doc and ("Must not" in doc or name == "reference"), name


@pytest.mark.parametrize("path", package_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_modules_are_small(path):
    """No module over ~400 lines; strategy.py, which only orchestrates, under 350."""
    limit = MAX_STRATEGY_LINES if path.name == "strategy.py" and path.parent == PACKAGE else MAX_MODULE_LINES
    assert len(path.read_text().splitlines()) <= limit


def test_no_import_cycles_in_the_package():
    """Data goes down the tree and never comes back up: the module import graph has no cycle."""
    files = package_files()
    assert find_cycle(import_graph(ROOT, "ddp_strategy", files)) is None


def test_no_import_cycles_in_the_benchmarks():
    """The benchmark scripts import each other without a cycle."""
    files = sorted((ROOT / "benchmarks").glob("*.py"))
    graph = import_graph(ROOT / "benchmarks", "", files)
    assert find_cycle(graph) is None


def test_parts_import_only_lower_layers_through_their_public_names():
    """Outside a sub-package only its ``__all__`` is used (``_compat``'s modules are its interface), and only
    from a lower layer (:data:`ALLOWED`)."""
    public = {}
    for name in SUBPACKAGES:
        tree = ast.parse((PACKAGE / name / "__init__.py").read_text())
        names = [ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign)
                 and any(getattr(t, "id", None) == "__all__" for t in n.targets)]
        public[name] = set(names[0]) if names else set()
    problems = []
    for path in package_files():
        me = module_name(path, ROOT)
        mine = part_of(me)
        for module, names, line in runtime_imports(path):
            if not module.startswith("ddp_strategy"):
                continue
            target = module.split(".")
            if len(target) == 1:  # from ddp_strategy import a, b: each is a part (or a public name for reference)
                parts = [n for n in names if n in SUBPACKAGES or n in ("options", "strategy", "cli", "diagnostics")]
                if mine not in ("reference", "cli", "__main__"):
                    problems += [f"{me}:{line} imports public name {n} from ddp_strategy" for n in names
                                 if n not in parts]
                problems += [f"{me}:{line} imports {p}" for p in parts if p != mine and p not in ALLOWED[mine]]
                continue
            theirs = target[1]
            if theirs == mine:
                continue
            if theirs not in ALLOWED[mine]:
                problems.append(f"{me}:{line} imports {module} (layer {theirs} is not below {mine})")
            elif theirs in SUBPACKAGES and theirs != "_compat" and (
                    len(target) > 2 or not set(names) <= public[theirs]):
                problems.append(f"{me}:{line} reaches inside {theirs}: {module} {names}")
    assert problems == []


def test_module_paths_of_the_flat_layout_still_import():
    """Every public name of every 0.1 module (tests/flat_layout_names.json, taken from 0.1's source) is still
    there at its old path, as ``from ddp_strategy.<old> import name`` and as ``ddp_strategy.<old>.name``."""
    import importlib
    import json

    import ddp_strategy

    names = json.loads((Path(__file__).parent / "flat_layout_names.json").read_text())
    missing = [f"{old}.{name}" for old, listed in names.items() for name in listed
               if not hasattr(importlib.import_module(f"ddp_strategy.{old}"), name)]
    assert missing == []
    assert ddp_strategy.comm_hooks.bf16_all_reduce_hook is ddp_strategy.bf16_all_reduce_hook  # attribute access
    from ddp_strategy.failures import StalledRankError
    from ddp_strategy.model import DigitsClassifier

    from ddp_strategy.process import boundaries

    assert DigitsClassifier is ddp_strategy.DigitsClassifier and StalledRankError is boundaries.StalledRankError
    with pytest.raises(AttributeError, match="moved to ddp_strategy.reference.model"):
        ddp_strategy.model.NoSuchName  # noqa: B018
