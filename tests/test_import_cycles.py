"""No module under gateway/ imports another inside a function to step around an import cycle.

An import inside a function is fine when it defers a heavy or optional package (the CLI's
subcommands, OpenVINO for `optimize`); it is a hidden cycle when the module it imports reaches
back, through module-level imports, to the importer. Read from the source with ``ast``: the
module-level imports of every batchgate module (``if TYPE_CHECKING:`` blocks left out: they never
run), then each function-level import under gateway/ checked for a path back."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import ROOT

PACKAGES = ("gateway", "workers", "cache", "bench", "proto", "client")


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(("batchgate", *parts))


def _names(node: ast.Import | ast.ImportFrom) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if node.level or not node.module:
        return []
    # `from batchgate.x import y`: y may be a module (batchgate.x.y) or a name in batchgate.x
    return [node.module, *(f"{node.module}.{a.name}" for a in node.names)]


def _type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING"
    )


def _top_level(tree: ast.Module) -> list[str]:
    out: list[str] = []

    def walk(body):
        for node in body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                out.extend(_names(node))
            elif isinstance(node, ast.If) and not _type_checking(node):
                walk(node.body)
                walk(node.orelse)
            elif isinstance(node, ast.Try):
                walk(node.body)
                for h in node.handlers:
                    walk(h.body)
                walk(node.orelse)

    walk(tree.body)
    return out


def _in_functions(tree: ast.Module) -> list[tuple[int, str]]:
    out = []
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(fn):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    out.extend((node.lineno, n) for n in _names(node))
    return out


def _graph() -> tuple[dict[str, set[str]], dict[str, tuple[Path, ast.Module]]]:
    files = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            files[_module(path)] = (path, ast.parse(path.read_text(), str(path)))
    graph = {}
    for mod, (_, tree) in files.items():
        deps = {n for n in _top_level(tree) if n in files}
        # importing a.b.c runs a/__init__ and a/b/__init__ first
        for n in list(deps):
            parts = n.split(".")
            deps.update(".".join(parts[:k]) for k in range(2, len(parts)) if ".".join(parts[:k]) in files)
        graph[mod] = deps - {mod}
    return graph, files


def _path(graph: dict[str, set[str]], start: str, goal: str) -> list[str] | None:
    seen, stack = {start}, [[start]]
    while stack:
        trail = stack.pop()
        if trail[-1] == goal:
            return trail
        for nxt in graph.get(trail[-1], ()):
            if nxt not in seen:
                seen.add(nxt)
                stack.append([*trail, nxt])
    return None


def cycles_stepped_around(graph, files) -> list[str]:
    found = []
    for mod, (path, tree) in files.items():
        if not mod.startswith("batchgate.gateway"):
            continue
        for line, target in _in_functions(tree):
            if target not in graph or target == mod:
                continue
            back = _path(graph, target, mod)
            if back:
                found.append(
                    f"{path.relative_to(ROOT)}:{line} imports {target}, which imports it back: {' -> '.join(back)}"
                )
    return found


def test_no_function_level_import_steps_around_a_cycle():
    graph, files = _graph()
    assert len(files) > 100 and graph["batchgate.gateway.admission.limits"], "the source was not read"
    assert cycles_stepped_around(graph, files) == []


def test_the_check_finds_a_cycle_stepped_around():
    """The check itself, on the real graph with one edge added: limits imports budgets at the top;
    a budgets function importing limits would be a cycle stepped around."""
    graph, files = _graph()
    path, _ = files["batchgate.gateway.admission.budgets"]
    src = path.read_text() + "\n\ndef _late():\n    from batchgate.gateway.admission.limits import Ticket\n"
    files = {**files, "batchgate.gateway.admission.budgets": (path, ast.parse(src))}
    (found,) = cycles_stepped_around(graph, files)
    assert "budgets.py" in found and "limits" in found, found
