"""The modules of the autotp distribution as source files, for tests that read the code (no import).

``passes/`` and ``cost_model/`` install as ``autotp.passes`` and ``autotp.cost_model``
(pyproject.toml's package-dir), so a module's import name is not its path.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["PACKAGES", "ROOT", "package_modules"]

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"autotp": "autotp", "passes": "autotp.passes", "cost_model": "autotp.cost_model"}
"""Source folder -> the import name it installs as (pyproject.toml's package-dir)."""


def package_modules() -> dict[str, Path]:
    """Import name -> source file of every module of the distribution."""
    found = {}
    for folder, name in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join((name, *parts))] = path
    return found
