"""The package's layout: the four steps as sub-packages, small modules, no import cycles, no reaching inside.

These tests read the source (no import), so they are fast and fail with the offending module named.
"""

from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "ddp_strategy"
TESTS = ROOT / "tests"
#: No module over this many statements, lambdas counted (STYLE.md: a module past ~220 is probably two concerns).
#: Issue 48's budget: no issue raises it; a feature pays for its statements by simplifying elsewhere.
MAX_MODULE_STATEMENTS = 220
#: The whole package at most this many statements, lambdas counted (Lightning's whole ``strategies/ddp.py`` has 218)
#: and this many code lines after ``ruff format``. Issue 48's budget, never raised: packing cannot meet it.
MAX_PACKAGE_STATEMENTS = 2800
MAX_PACKAGE_CODE_LINES = 4400
#: Which sub-packages each part may import (through the sub-package's public names), lowest layer first.
ALLOWED = {
    "_compat": set(),
    "process": {"_compat"},
    "sampling": {"_compat", "process"},
    "sync": {"_compat", "process"},
    "checkpoint": {"_compat"},
    "diagnostics": {"_compat", "process", "sampling"},
    "reference": {"_compat", "process", "sampling", "diagnostics", "testing"},
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
                return stack[stack.index(nxt) :] + [nxt]
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


def _is_docstring(node: ast.AST) -> bool:
    return isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)


def statements(path: Path) -> int:
    """Statements of a source file: its AST's statement nodes, nested ones included, docstrings excluded, and one
    more for each ``lambda`` (a function, packed into an expression).

    Formatting cannot change the count (``ruff format`` may split a statement over lines, never add one), and
    docstrings cost nothing, so they stay as full as the contract needs.
    """
    return sum(
        isinstance(node, ast.stmt) and not _is_docstring(node) or isinstance(node, ast.Lambda)
        for node in ast.walk(ast.parse(path.read_text()))
    )


def code_lines(path: Path) -> int:
    """Lines of a source file (formatted by ``ruff format``, as CI checks) holding a token other than a comment,
    outside docstrings: so packing clauses onto a line saves nothing that the formatter does not undo."""
    source = path.read_text()
    docstrings = {
        line
        for node in ast.walk(ast.parse(source))
        if isinstance(body := getattr(node, "body", None), list) and body and _is_docstring(body[0])
        for line in range(body[0].lineno, body[0].end_lineno + 1)
    }
    layout = (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER)
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    return len({token.start[0] for token in tokens if token.type not in layout} - docstrings)


def test_statements_and_code_lines_count_code_not_docstrings_or_comments(tmp_path):
    """The counters count each statement once, nested ones too, a lambda as one more, and neither docstrings, line
    breaks nor comments; code lines are the lines with code."""
    source = (
        'def f(a,\n      b):\n    """Doc."""\n    # a comment\n    if a:\n        return (a +\n                b)\n'
        "    g = lambda: 0\n    return g()\n"
    )
    path = tmp_path / "probe.py"
    path.write_text(source)
    assert statements(path) == 6  # def, if, return, g = (and its lambda), return
    assert code_lines(path) == 7  # def f(a, / b): / if a: / return (a + / b) / g = lambda: 0 / return g()


def test_modules_are_small():
    """No module over :data:`MAX_MODULE_STATEMENTS` statements; each that is, is named with its count."""
    too_long = {
        str(path.relative_to(ROOT)): n for path in package_files() if (n := statements(path)) > MAX_MODULE_STATEMENTS
    }
    assert too_long == {}


def test_the_package_is_small():
    """The whole package is at most :data:`MAX_PACKAGE_STATEMENTS` statements (lambdas counted) and
    :data:`MAX_PACKAGE_CODE_LINES` code lines, docstrings and comments excluded."""
    total = sum(statements(path) for path in package_files())
    assert total <= MAX_PACKAGE_STATEMENTS, f"ddp_strategy/ has {total} statements"
    lines = sum(code_lines(path) for path in package_files())
    assert lines <= MAX_PACKAGE_CODE_LINES, f"ddp_strategy/ has {lines} code lines"


def test_no_import_cycles_in_the_package():
    """Data goes down the tree and never comes back up: the module import graph has no cycle."""
    files = package_files()
    assert find_cycle(import_graph(ROOT, "ddp_strategy", files)) is None


def test_the_tests_mirror_the_package():
    """tests/ holds one folder per sub-package (and scripts/, and diagnostics/ for diagnostics.py and its
    workers), and at its top only the tests of the top-level modules
    (test_strategy.py for strategy.py, ...), of the docs, of the benchmarks and of this layout, conftest.py and the
    shared helpers.
    Module names are unique: tests/ has no __init__.py, so pytest and spawned ranks import them by name."""
    modules = {f"test_{path.stem}.py" for path in PACKAGE.glob("*.py") if not path.stem.startswith("_")}
    allowed = modules | {"conftest.py", "ddp_testing.py", "test_docs.py", "test_benchmarks.py", "test_layout.py"}
    assert sorted(path.name for path in TESTS.glob("*.py") if path.name not in allowed) == []
    folders = {path.name for path in TESTS.iterdir() if path.is_dir() and not path.name.startswith((".", "__"))}
    assert sorted(folders - set(SUBPACKAGES) - {"scripts", "diagnostics"}) == []
    names = [path.name for path in TESTS.rglob("*.py")]
    assert sorted({name for name in names if names.count(name) > 1}) == []


def test_the_benchmarks_do_not_import_the_tests():
    """benchmarks/ stands alone: no benchmark imports a module of tests/ or puts tests/ on sys.path."""
    test_modules = {path.stem for path in TESTS.rglob("*.py")} | {"tests"}
    problems = []
    for path in sorted((ROOT / "benchmarks").glob("*.py")):
        problems += [
            f"{path.name}:{line} imports {module}"
            for module, _, line in runtime_imports(path)
            if module.split(".")[0] in test_modules
        ]
        numbered = enumerate(path.read_text().splitlines(), 1)
        problems += [
            f"{path.name}:{n} puts tests/ on sys.path" for n, text in numbered if "sys.path" in text and "tests" in text
        ]
    assert problems == []


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
        names = [
            ast.literal_eval(n.value)
            for n in tree.body
            if isinstance(n, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in n.targets)
        ]
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
                    problems += [
                        f"{me}:{line} imports public name {n} from ddp_strategy" for n in names if n not in parts
                    ]
                problems += [f"{me}:{line} imports {p}" for p in parts if p != mine and p not in ALLOWED[mine]]
                continue
            theirs = target[1]
            if theirs == mine:
                continue
            if theirs not in ALLOWED[mine]:
                problems.append(f"{me}:{line} imports {module} (layer {theirs} is not below {mine})")
            elif (
                theirs in SUBPACKAGES and theirs != "_compat" and (len(target) > 2 or not set(names) <= public[theirs])
            ):
                problems.append(f"{me}:{line} reaches inside {theirs}: {module} {names}")
    assert problems == []
