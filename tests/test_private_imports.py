"""No autotp module reaches for another's private names (fast tier: parses the source, imports nothing).

A name that starts with ``_`` is its module's own business: it may change or go without notice to its
callers. Code that two modules share is public in the module that owns it (listed in its ``__all__``
where it has one), so a rename there shows in one place. This test parses every module of the
distribution — ``autotp/``, and ``passes/`` and ``cost_model/``, which install as ``autotp.passes`` and
``autotp.cost_model`` — top level and inside functions, and names each ``from autotp... import _name``
(relative imports included) and each ``autotp.x._name`` attribute read on another module.
"""

from __future__ import annotations

import ast
from pathlib import Path

from package_modules import ROOT, package_modules
from source_names import dotted_name, is_private


def _package_of(module: str, path: Path) -> str:
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def _imported_from(node: ast.ImportFrom, module: str, path: Path) -> str | None:
    """The absolute module a ``from ... import`` reads from (relative imports resolved)."""
    if not node.level:
        return node.module
    base = _package_of(module, path).split(".")
    base = base[:len(base) - (node.level - 1)]
    return ".".join([*base, *([node.module] if node.module else [])])


class _Finder(ast.NodeVisitor):
    """Private names of other autotp modules that one module imports or reads as attributes."""

    def __init__(self, module: str, path: Path, modules: dict[str, Path]) -> None:
        self.module, self.path, self.modules = module, path, modules
        self.aliases: dict[str, str] = {}  # local name -> the autotp module it is bound to (anywhere in the file)
        self.found: list[str] = []

    def _report(self, node: ast.AST, text: str) -> None:
        self.found.append(f"{self.path.relative_to(ROOT)}:{node.lineno}: {text}")  # type: ignore[attr-defined]

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if alias.name.split(".")[0] != "autotp":
                continue
            self.aliases[alias.asname or "autotp"] = alias.name if alias.asname else "autotp"
            if any(is_private(part) for part in alias.name.split(".")):
                self._report(node, f"import {alias.name} (a private module)")

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        source = _imported_from(node, self.module, self.path)
        if source is None or source.split(".")[0] != "autotp" or source == self.module:
            return
        for alias in node.names:
            if is_private(alias.name) or any(is_private(part) for part in source.split(".")):
                self._report(node, f"from {source} import {alias.name}")
            if f"{source}.{alias.name}" in self.modules:
                self.aliases[alias.asname or alias.name] = f"{source}.{alias.name}"

    def visit_Attribute(self, node: ast.Attribute) -> None:
        owner = dotted_name(node.value)
        if owner is not None and is_private(node.attr):
            head, _, rest = owner.partition(".")
            target = self.aliases.get(head)
            resolved = f"{target}.{rest}" if target and rest else target
            if resolved in self.modules and resolved != self.module:
                self._report(node, f"{owner}.{node.attr} (private to {resolved})")
        self.generic_visit(node)



def _find(module: str, path: Path, tree: ast.Module, modules: dict[str, Path]) -> list[str]:
    """``file:line: what`` of every use of another autotp module's private name in ``tree``."""
    finder = _Finder(module, path, modules)
    for node in ast.walk(tree):  # bind every alias first: a function may use a module imported below it
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            finder.visit(node)
    finder.found = []
    finder.visit(tree)
    return finder.found


def private_imports() -> list[str]:
    """``file:line: what`` of every use of another autotp module's private name, in every module."""
    modules = package_modules()
    return [entry for module, path in modules.items()
            for entry in _find(module, path, ast.parse(path.read_text(), filename=str(path)), modules)]


def test_no_private_names_acrosspackage_modules() -> None:
    """Every autotp module (autotp/, passes/, cost_model/), top level and inside functions: no import of another
    module's ``_name``, no ``autotp.x._name`` read. Fix: make the shared name public in the module that owns it
    (rename it, update its callers, add it to that module's ``__all__``), or move the code where it belongs."""
    found = private_imports()
    assert not found, "private names used across autotp modules:\n  " + "\n  ".join(found)


def test_the_check_sees_each_form() -> None:
    """The finder itself: a private name imported absolutely, relatively, inside a function, or read as an
    attribute of an imported module is named with its line; public names, dunders, a module's own private
    names and a private alias of a public name are not."""
    source = (
        "import autotp.capture.tracing\n"
        "import autotp.runtime.checkpoints.saving as saving\n"
        "from autotp.runtime.checkpoints import loading\n"
        "from autotp.capture.tracing import check_model, _as_if_on\n"  # line 4
        "from .hardware import _private\n"  # line 5
        "from autotp.api import compile as _compile\n"
        "from autotp import __version__\n"
        "def f():\n"
        "    from autotp.runtime.checkpoints.loading import _materialize\n"  # line 9
        "    return autotp.capture.tracing._hidden, saving._chunks, loading.public, _own\n"  # line 10
        "_own = loading._x\n"  # line 11
    )
    found = _find("autotp.cost_model.calibrate", ROOT / "cost_model" / "calibrate.py", ast.parse(source), package_modules())
    lines = [int(entry.split(":")[1]) for entry in found]
    assert lines == [4, 5, 9, 10, 10, 11], found
    assert "from autotp.cost_model.hardware import _private" in found[1], found
