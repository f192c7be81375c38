"""Which repeated block a module path lies in: the one notion of "block" (or "layer") autotp uses.

A *block* is a child of a numbered container (``nn.ModuleList`` or ``nn.Sequential``), whatever
the model calls it: the path up to its first all-digit segment. Tying identical layers in the
solver (``passes/tying.py``), folding identical layers in reports (``planning/blocks.py``) and
per-layer estimates (``inspect/estimates.py``) all cut paths here.
"""

from __future__ import annotations

__all__ = ["block_name", "block_of"]


def block_of(path: str) -> tuple[str, int] | None:
    """``(container, index)`` of the block ``path`` (a module FQN or a parameter FQN) lies in.

    ``model.layers.3.mlp.up_proj`` -> ``("model.layers", 3)``; ``0.weight`` (a child of a
    top-level ``Sequential``) -> ``("", 0)``; ``lm_head`` and ``""`` -> ``None``.
    """
    parts = path.split(".") if path else []
    for position, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[:position]), int(part)
    return None


def block_name(path: str) -> str | None:
    """The block's own path: ``model.layers.3`` for ``model.layers.3.mlp.up_proj``, ``0`` for ``0.weight``."""
    parts = path.split(".") if path else []
    for position, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: position + 1])
    return None
