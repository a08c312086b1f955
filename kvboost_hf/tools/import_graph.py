"""Measure the package's structure: modules, import edges, upward imports between layers, import cycles, sizes.

Run ``python -m kvboost_hf.tools.import_graph`` for a report. The layering, lowest first, is :data:`LAYERS`; an
import from a module to one of a higher layer is *upward*. Imports are read with :mod:`ast` (nothing is imported)
and sorted by where they sit:

* ``module``: executed when the module is imported (including inside ``try``/``if`` at module level);
* ``lazy``: inside a function or method body, executed when that code runs;
* ``typing``: under ``if TYPE_CHECKING:``, never executed.

Cycles are searched among ``module`` edges (the ones that make import order matter) and, separately, among all
edges (a cycle that only closes through ``lazy`` or ``typing`` edges is still two modules that know each other).
Upward imports count every kind but ``typing``.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from kvboost_hf.core.errors import NotFoundError

PACKAGE = "kvboost_hf"

#: Layers, lowest first. A module belongs to the first entry whose prefix matches its dotted name (after
#: ``kvboost_hf.``); a module the table does not name is an error, so a new top-level module must be placed here.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("core", ("core", "kernels", "results")),
    ("store/offload", ("store", "offload")),
    ("reuse", ("reuse",)),
    ("hf", ("hf",)),
    # factories: the engine's caches, loops and engine cores (scheduler + runner); corpus: its default prompts, no
    # imports of its own
    ("engine", ("engine", "engine_core", "factories", "runner", "scheduling", "kv_budget", "corpus")),
    ("server", ("server",)),
    ("serve_ray", ("serve_ray",)),
    ("bench", ("bench", "demo", "cli", "tools", "__init__")),
)


@dataclass(frozen=True)
class ImportEdge:
    """``source`` imports ``target`` (both dotted module names) at ``line`` of the source, as ``kind``."""

    source: str
    target: str
    line: int
    kind: str  # "module", "lazy" or "typing"


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts.pop()
    return ".".join(parts)


#: Subpackages installed from another directory (pyproject's ``package-dir``): dotted name -> directory under root.
MAPPED_SUBPACKAGES = {f"{PACKAGE}.kernels": "kernels"}


def discover_modules(root: Path) -> dict[str, Path]:
    """Dotted name -> file for every ``.py`` file of the package under ``root`` (the directory holding it)."""
    modules = {_module_name(path, root): path for path in sorted((root / PACKAGE).rglob("*.py"))}
    for dotted, directory in MAPPED_SUBPACKAGES.items():
        for path in sorted((root / directory).rglob("*.py")):
            modules[_module_name(path, root).replace(directory, dotted, 1)] = path
    return modules


def layer_of(module: str) -> int:
    """Index in :data:`LAYERS` of ``module`` (a dotted name); raises :class:`NotFoundError` (a ``LookupError``)
    for a module no layer names."""
    rest = module.removeprefix(PACKAGE).removeprefix(".") or "__init__"
    head = rest.split(".")[0]
    for index, (_, prefixes) in enumerate(LAYERS):
        if head in prefixes:
            return index
    raise NotFoundError(f"{module}: no layer in LAYERS names it")


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _walk_imports(node: ast.AST, kind: str) -> Iterator[tuple[ast.Import | ast.ImportFrom, str]]:
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.Import | ast.ImportFrom):
            yield child, kind
        elif isinstance(child, ast.If) and _is_type_checking(child.test):
            for statement in child.body:
                yield from _walk_imports(ast.Module(body=[statement], type_ignores=[]), "typing")
            for statement in child.orelse:
                yield from _walk_imports(ast.Module(body=[statement], type_ignores=[]), kind)
        elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            yield from _walk_imports(child, "typing" if kind == "typing" else "lazy")
        else:
            yield from _walk_imports(child, kind)


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The longest prefix of dotted ``name`` that is a module of the package, or None for outside names."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in modules:
            return candidate
        parts.pop()
    return None


def import_edges(modules: dict[str, Path]) -> list[ImportEdge]:
    """Every import from one package module to another; ``from pkg import sub`` resolves to the submodule."""
    edges: list[ImportEdge] = []
    for source, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        is_package = path.name == "__init__.py"
        for node, kind in _walk_imports(tree, "module"):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    anchor = source.split(".") if is_package else source.split(".")[:-1]
                    anchor = anchor[: len(anchor) - (node.level - 1)]
                    base = ".".join([*anchor, base] if base else anchor)
                names = [f"{base}.{alias.name}" for alias in node.names]
            for name in names:
                target = _resolve(name, modules)
                if target is not None and target != source:
                    edges.append(ImportEdge(source, target, node.lineno, kind))
    return edges


def strongly_connected(nodes: Iterable[str], edges: Iterable[tuple[str, str]]) -> list[list[str]]:
    """Components of more than one node (Tarjan), each sorted; those are the import cycles."""
    graph: dict[str, set[str]] = defaultdict(set)
    for source, target in edges:
        graph[source].add(target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in sorted(graph[node]):
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for node in sorted(set(nodes)):
        if node not in index:
            visit(node)
    return sorted(components)


def subpackage_of(module: str) -> str:
    """``kvboost_hf.hf.cache`` -> ``hf``; a top-level module is its own group (``engine``)."""
    rest = module.removeprefix(PACKAGE).removeprefix(".") or "__init__"
    return rest.split(".")[0]


def upward_edges(edges: Iterable[ImportEdge]) -> list[ImportEdge]:
    """Executed imports (``module`` or ``lazy``) whose target sits in a higher layer than their source."""
    return [edge for edge in edges if edge.kind != "typing" and layer_of(edge.target) > layer_of(edge.source)]


def large_classes(modules: dict[str, Path], limit: int = 15) -> list[tuple[str, int]]:
    """``(module.Class, methods)`` for every class defining more than ``limit`` methods in its own body."""
    found: list[tuple[str, int]] = []
    for module, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                methods = sum(isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef) for item in node.body)
                if methods > limit:
                    found.append((f"{module}.{node.name}", methods))
    return sorted(found, key=lambda item: -item[1])


def report(root: Path) -> str:
    """The text report for the package under ``root``."""
    modules = discover_modules(root)
    edges = import_edges(modules)
    module_edges = {(edge.source, edge.target) for edge in edges if edge.kind == "module"}
    declared_edges = {(edge.source, edge.target) for edge in edges if edge.kind != "lazy"}
    all_edges = {(edge.source, edge.target) for edge in edges}
    kinds: defaultdict[str, int] = defaultdict(int)
    for edge in edges:
        kinds[edge.kind] += 1
    lines = [
        f"modules: {len(modules)}",
        f"import edges (distinct module pairs): {len(all_edges)}",
        f"import statements by kind: {dict(sorted(kinds.items()))}",
    ]
    upward = upward_edges(edges)
    lines.append(f"upward imports (executed, lower layer -> higher layer): {len(upward)}")
    lines += [
        f"  {edge.source}:{edge.line} -> {edge.target} ({edge.kind}; {LAYERS[layer_of(edge.source)][0]} -> "
        f"{LAYERS[layer_of(edge.target)][0]})"
        for edge in upward
    ]
    for label, pairs in (
        ("module-level edges", module_edges),
        ("module-level + TYPE_CHECKING edges", declared_edges),
        ("all edges incl. lazy", all_edges),
    ):
        cycles = strongly_connected(modules, pairs)
        lines.append(f"module import cycles ({label}): {len(cycles)}")
        lines += [f"  {' <-> '.join(cycle)}" for cycle in cycles]
    reach_past = sorted({(s, t) for s, t in all_edges if subpackage_of(s) == "server" and subpackage_of(t) == "hf"})
    lines.append(f"server -> hf module pairs (the server reaching past the engine): {len(reach_past)}")
    package_pairs = {
        (subpackage_of(source), subpackage_of(target))
        for source, target in all_edges
        if subpackage_of(source) != subpackage_of(target)
    }
    package_cycles = strongly_connected({subpackage_of(module) for module in modules}, package_pairs)
    lines.append(f"subpackage cycles (all edges): {len(package_cycles)}")
    lines += [f"  {' <-> '.join(cycle)}" for cycle in package_cycles]
    sizes: dict[str, int] = defaultdict(int)
    for module, path in modules.items():
        sizes[subpackage_of(module)] += len(path.read_text().splitlines())
    lines.append(f"lines per subpackage (total {sum(sizes.values())}):")
    lines += [f"  {name}: {count}" for name, count in sorted(sizes.items(), key=lambda item: -item[1])]
    classes = large_classes(modules)
    lines.append(f"classes with over 15 methods: {len(classes)}")
    lines += [f"  {name}: {count}" for name, count in classes]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--root", type=Path, default=Path(__file__).resolve().parents[2], help="directory holding the package"
    )
    args = parser.parse_args(argv)
    print(report(args.root))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
