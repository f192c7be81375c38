"""Progress lines for ``progress=True``: one format for every stage (``[autotp] ...`` on stderr)."""

from __future__ import annotations

import sys

__all__ = ["log_progress"]


def log_progress(progress: bool, message: str) -> None:
    """Print ``[autotp] message`` to stderr when ``progress`` is true (flushed, so it shows as it happens)."""
    if progress:
        print(f"[autotp] {message}", file=sys.stderr, flush=True)
