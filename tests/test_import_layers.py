"""Imports run one way: no import circle, and no layer imports one above it (fast tier: parses, imports nothing).

ARCHITECTURE.md "Layers": front doors -> calibration -> the compile driver -> reports / runtime -> stages -> base
-> cost_model -> torch adapter. This test
parses every module of the distribution (``autotp/``, and ``passes/`` and ``cost_model/``, which install
as ``autotp.passes`` and ``autotp.cost_model``), reads every import, at module level and inside
functions alike (imports under ``if TYPE_CHECKING:`` excepted: they never run), resolves relative
imports, and builds the module import graph. It names every import circle with the lines that tie it,
and every import of a higher layer by a lower one as ``file:line``.

An import names one module: ``from autotp.base import errors`` reads ``autotp.base.errors``; ``from
autotp.planning.plan import Plan`` reads ``autotp.planning.plan``. The parent packages that Python
imports on the way (their ``__init__.py`` files only hand names on) are not edges.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

from package_modules import ROOT, package_modules

LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("front doors", ("autotp", "autotp.api", "autotp.pretrained", "autotp.dynamo_backend", "autotp.cli",
                     "autotp.generation")),
    ("mesh", ("autotp.runtime.mesh",)),
    ("calibration", ("autotp.calibration",)),
    ("driver", ("autotp.driver",)),
    ("reports / runtime", ("autotp.inspect", "autotp.runtime", "autotp.runtime.execution",
                           "autotp.runtime.generation", "autotp.runtime.checkpoints", "autotp.runtime.training")),
    ("collectives", ("autotp.runtime.collectives",)),
    ("agreement", ("autotp.runtime.agreement",)),
    ("stages", ("autotp.planning", "autotp.passes", "autotp.capture")),
    ("base", ("autotp.base", "autotp.adapters", "autotp.capture.stamping")),
    ("cost_model", ("autotp.cost_model",)),
    ("torch adapter", ("autotp.adapters.torch_internals", "autotp.adapters.releases", "autotp.base.errors")),
)
"""The layers from the top down, each with the modules and packages it holds (a package: all its modules;
an entry of INIT_ONLY: the package's own ``__init__.py`` only). A module may import its own layer or those
below. The runtime's rooms sit in four layers: the mesh (imported by the front doors alone); execution,
generation, checkpoints and training; collectives (agreement below them only); agreement (no other room)."""

INIT_ONLY = ("autotp", "autotp.runtime")
"""Entries that hold a package's ``__init__.py`` only: a module put straight into ``autotp/`` or
``autotp/runtime/`` has no layer until it is placed (the runtime holds rooms, not loose modules)."""


@dataclass(frozen=True)
class Import:
    """One import statement of one module: the module it reads and where it stands."""

    source: str
    target: str
    where: str  # "path:line"


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _statements(tree: ast.AST):
    """Every import statement of a module, at any depth, except those under ``if TYPE_CHECKING:``."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def _known(name: str, modules: dict[str, Path]) -> str | None:
    """The longest prefix of a dotted name that is a module of the distribution."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in modules:
            return ".".join(parts[:end])
    return None


def _imports(module: str, path: Path, modules: dict[str, Path]) -> list[Import]:
    """The modules of the distribution that one module imports, with file:line of each import."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in _statements(ast.parse(path.read_text(), str(path))):
        where = f"{path.relative_to(ROOT)}:{node.lineno}"
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join([*parts[:len(parts) - (node.level - 1)], *([node.module] if node.module else [])])
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        for name in names:
            target = _known(name, modules)
            if target is not None and target != module:
                found.append(Import(module, target, where))
    return found


def _graph() -> tuple[dict[str, Path], list[Import]]:
    modules = package_modules()
    return modules, [edge for module, path in modules.items() for edge in _imports(module, path, modules)]


def _layer_of(module: str) -> int | None:
    """Index in LAYERS (0 = top) of the layer holding a module; the longest matching entry decides."""
    best: tuple[int, int] | None = None
    for index, (_, entries) in enumerate(LAYERS):
        for entry in entries:
            covers = module == entry or (entry not in INIT_ONLY and module.startswith(entry + "."))
            if covers and (best is None or len(entry) > best[0]):
                best = (len(entry), index)
    return None if best is None else best[1]


def _cycles(modules: dict[str, Path], edges: list[Import]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    successors: dict[str, set[str]] = {module: set() for module in modules}
    for edge in edges:
        successors[edge.source].add(edge.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components = []

    def visit(start: str) -> None:
        # iterative Tarjan: (module, iterator over its successors)
        work = [(start, iter(sorted(successors[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            module, pending = work[-1]
            for successor in pending:
                if successor not in index:
                    index[successor] = low[successor] = len(index)
                    stack.append(successor)
                    on_stack.add(successor)
                    work.append((successor, iter(sorted(successors[successor]))))
                    break
                if successor in on_stack:
                    low[module] = min(low[module], index[successor])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[module])
                if low[module] == index[module]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == module:
                            break
                    if len(component) > 1:
                        components.append(sorted(component))

    for module in sorted(modules):
        if module not in index:
            visit(module)
    return sorted(components)


def test_every_module_has_a_layer():
    """Each module of the distribution is in exactly one layer of LAYERS (a new module must be placed)."""
    missing = sorted(module for module in package_modules() if _layer_of(module) is None)
    assert not missing, f"modules in no layer of LAYERS (add each where it belongs): expected none, got {missing}"


def test_no_import_cycle():
    """No set of modules imports each other in a loop, not even through imports inside functions."""
    modules, edges = _graph()
    cycles = _cycles(modules, edges)
    lines = []
    for members in cycles:
        inside = set(members)
        ties = sorted({f"{edge.where}: {edge.source} -> {edge.target}" for edge in edges
                       if edge.source in inside and edge.target in inside})
        lines.append(f"cycle of {len(members)}: {', '.join(members)}\n    " + "\n    ".join(ties))
    assert not cycles, f"expected no import cycle, got {len(cycles)}:\n" + "\n".join(lines)


def test_no_layer_imports_a_higher_one():
    """front doors -> mesh -> calibration -> driver -> reports / runtime -> collectives -> agreement ->
    stages -> base -> cost_model -> torch adapter -> torch adapter: never the other way."""
    modules, edges = _graph()
    upward = []
    for edge in edges:
        source, target = _layer_of(edge.source), _layer_of(edge.target)
        if source is not None and target is not None and target < source:
            upward.append(f"{edge.where}: {edge.source} ({LAYERS[source][0]}) imports "
                          f"{edge.target} ({LAYERS[target][0]})")
    assert not upward, f"expected no import of a higher layer, got {len(upward)}:\n" + "\n".join(sorted(upward))
