"""Names in Python source, for the tests that scan the library's files (private imports, torch internals)."""

from __future__ import annotations

import ast


def is_private(name: str) -> bool:
    """A leading underscore that is not a dunder: private by Python's convention."""
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def dotted_name(node: ast.expr) -> str | None:
    """``a.b.c`` of a chain of names and attributes, else None."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        owner = dotted_name(node.value)
        return None if owner is None else f"{owner}.{node.attr}"
    return None
