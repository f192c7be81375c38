"""The library's docstrings name other code with Sphinx roles (``:func:`autotp.runtime.execution.applying.apply_plan```);
the API reference renders them (docs/griffe_roles.py). A function that moves leaves such a reference naming a
place where it no longer lives, so every ``autotp.`` reference must resolve to a module or an object."""

from __future__ import annotations

import dataclasses
import importlib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("autotp", "passes", "cost_model")
"""The folders of the library (``passes/`` and ``cost_model/`` install as ``autotp.passes``, ``autotp.cost_model``)."""

_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|data|attr|exc|obj|const):`~?(autotp\.[\w.]+)`")


def _resolves(name: str) -> bool:
    parts = name.split(".")
    for stop in range(len(parts), 0, -1):
        try:
            value = importlib.import_module(".".join(parts[:stop]))
        except ImportError:
            continue
        for index, part in enumerate(parts[stop:]):
            if hasattr(value, part):
                value = getattr(value, part)
            elif dataclasses.is_dataclass(value) and index == len(parts[stop:]) - 1:
                return part in {field.name for field in dataclasses.fields(value)}  # a field without a default
            else:
                return False
        return True
    return False


def test_every_docstring_reference_resolves() -> None:
    """No process group: each ``autotp.`` target of a Sphinx role in the library imports or is an attribute."""
    stale: dict[str, set[str]] = {}
    for folder in SOURCES:
        for path in sorted((ROOT / folder).rglob("*.py")):
            for match in _ROLE.finditer(path.read_text()):
                if not _resolves(match.group(1)):
                    stale.setdefault(match.group(1), set()).add(str(path.relative_to(ROOT)))
    assert not stale, f"expected every autotp.* reference in a docstring to resolve; these do not: {stale}"
