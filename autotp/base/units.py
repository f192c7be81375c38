"""How autotp prints seconds and bytes: one format for the plan's text and every report."""

from __future__ import annotations

__all__ = ["format_bytes", "format_seconds"]


def format_seconds(seconds: float, *, signed: bool = False) -> str:
    """``1.234 ms`` / ``12.3 us`` (``+``/``-`` with ``signed``)."""
    sign = ("+" if seconds >= 0 else "-") if signed else ("-" if seconds < 0 else "")
    value = abs(seconds)
    if value >= 1.0:
        return f"{sign}{value:.3f} s"
    if value >= 1e-3:
        return f"{sign}{value * 1e3:.3f} ms"
    return f"{sign}{value * 1e6:.1f} us"


def format_bytes(nbytes: float, *, signed: bool = False) -> str:
    """``1.50 MiB`` (``+``/``-`` with ``signed``)."""
    sign = ("+" if nbytes >= 0 else "-") if signed else ("-" if nbytes < 0 else "")
    value = abs(nbytes)
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if value >= size:
            return f"{sign}{value / size:.2f} {unit}"
    return f"{sign}{int(value)} B"
