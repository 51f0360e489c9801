"""The shape of the code: no import cycle among megarl's modules, the import contracts of
pyproject.toml ([tool.importlinter], docs/architecture.md "Layers"), files and functions of a
readable size. Static: nothing is imported or run but the checkers."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "megarl"
MAX_FILE_LINES = 450
MAX_FUNCTION_LINES = 80


@pytest.fixture(scope="module")
def graph():
    """megarl's import graph: every import statement, inside functions and TYPE_CHECKING blocks too."""
    return grimp.build_graph("megarl", include_external_packages=False, cache_dir=None)


def strongly_connected(graph) -> list[list[str]]:
    """The import graph's cycles as strongly connected components of more than one module (Tarjan,
    iterative: the graph is deeper than Python's recursion allows on some trees)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            module, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.find_modules_directly_imported_by(child)))))
                elif child in on_stack:
                    low[module] = min(low[module], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[module])
            if low[module] == index[module]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == module:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def describe_cycle(graph, component: list[str]) -> str:
    """The component's modules, and one cycle through them with the line of every import."""
    members = set(component)
    start = component[0]
    first = sorted(m for m in graph.find_modules_directly_imported_by(start) if m in members)[0]
    chain = (start,) + graph.find_shortest_chain(importer=first, imported=start, as_packages=False)
    steps = []
    for importer, imported in zip(chain, chain[1:]):
        lines = sorted(d["line_number"] for d in graph.get_import_details(importer=importer, imported=imported))
        steps.append(f"    {importer} -> {imported} (line {', '.join(map(str, lines))})")
    return f"  modules: {', '.join(component)}\n  cycle:\n" + "\n".join(steps)


def test_no_import_cycle_among_megarl_modules(graph):
    cycles = strongly_connected(graph)
    assert not cycles, (
        f"{len(cycles)} import cycle(s) among megarl's modules; move what both sides need into a "
        "module both import (an interface, a registry, the errors), or the assembly into one above "
        "them:\n" + "\n".join(describe_cycle(graph, c) for c in cycles)
    )


def test_the_cycle_finder_finds_a_cycle():
    """The check above would see a cycle (a graph of three modules importing round)."""
    g = grimp.ImportGraph()
    for importer, imported in (("pkg.a", "pkg.b"), ("pkg.b", "pkg.c"), ("pkg.c", "pkg.a"), ("pkg.c", "pkg.d")):
        g.add_import(importer=importer, imported=imported, line_number=1, line_contents="import")
    assert strongly_connected(g) == [["pkg.a", "pkg.b", "pkg.c"]]
    assert "pkg.a -> pkg.b (line 1)" in describe_cycle(g, ["pkg.a", "pkg.b", "pkg.c"])


def test_import_contracts_hold():
    """pyproject.toml's [tool.importlinter] contracts (scripts/lint.sh runs the same command)."""
    lint_imports = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    assert lint_imports is not None, (
        "lint-imports is missing next to this Python: import-linter is pinned in requirements.lock; "
        "run scripts/setup_env.sh"
    )
    result = subprocess.run([lint_imports, "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]


def _sources():
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path.relative_to(ROOT), path.read_text()


def test_no_file_is_over_the_line_limit():
    long_files = [f"{path}: {n} lines" for path, text in _sources() if (n := len(text.splitlines())) > MAX_FILE_LINES]
    assert not long_files, f"files over {MAX_FILE_LINES} lines; split them by concern:\n  " + "\n  ".join(long_files)


def test_no_function_is_over_the_line_limit():
    long_functions = []
    for path, text in _sources():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1  # from `def` to its last line, docstring included
                if n > MAX_FUNCTION_LINES:
                    long_functions.append(f"{path}:{node.lineno} {node.name}: {n} lines")
    assert not long_functions, (
        f"functions over {MAX_FUNCTION_LINES} lines; give their steps names of their own:\n  "
        + "\n  ".join(long_functions)
    )


def test_nothing_points_outside_the_repo():
    """A clone has only its own files: code, tests and docs name none beside it (the design notes
    the project started from live in docs/architecture.md)."""
    outside = "../" + "shared"  # spelled in two so this file does not name it
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    texts = [p for p in tracked if p.endswith((".py", ".md", ".sh", ".yaml", ".toml", ".sbatch", "Dockerfile"))]
    hits = []
    for name in texts:
        for i, line in enumerate((ROOT / name).read_text(errors="replace").splitlines(), 1):
            if outside in line or ("shared/" + "reference") in line:
                hits.append(f"{name}:{i}: {line.strip()[:100]}")
    assert not hits, "references to files outside the repo:\n  " + "\n  ".join(hits)
