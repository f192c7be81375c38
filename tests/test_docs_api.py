"""The API reference (docs/api.md) is generated from the code by mkdocstrings; these tests check that it covers
the public API: every name in ``autotp.__all__`` is rendered from its own definition (a ``::: module.name``
directive, or one for the module that defines it), so a signature or docstring change reaches the page with no
hand edit. ``mkdocs build --strict`` (.ci/run) then fails on any name the directives cannot find."""

from __future__ import annotations

import re
from pathlib import Path

import autotp

API_PAGE = Path(__file__).resolve().parents[1] / "docs" / "api.md"
RE_EXPORTED = {"Partial", "Replicate", "Shard"}
"""``torch.distributed.tensor``'s placement types, re-exported: named in the page's prose, documented by torch."""


def _directives() -> set[str]:
    return set(re.findall(r"^::: ([\w.]+)\s*$", API_PAGE.read_text(), flags=re.MULTILINE))


def test_api_page_renders_every_public_name_from_its_definition() -> None:
    """No process group: each name of autotp.__all__ has a mkdocstrings directive for it or its module."""
    directives = _directives()
    missing = []
    for name in autotp.__all__:
        if name in RE_EXPORTED:
            continue
        value = getattr(autotp, name)
        module = value.__module__
        if f"{module}.{value.__qualname__}" not in directives and module not in directives:
            missing.append(f"{name} (add '::: {module}.{value.__qualname__}')")
    assert not missing, f"docs/api.md does not render these public names: {missing}"
    assert all(re.search(rf"`{name}\b", API_PAGE.read_text()) for name in RE_EXPORTED), (
        f"docs/api.md should name the re-exported placements {sorted(RE_EXPORTED)}")


def test_api_page_has_no_hand_written_signatures() -> None:
    """A signature restated by hand drifts: the page holds none (mkdocstrings renders them)."""
    hand_written = re.findall(r"^#+ .*`autotp\.\w+\(.*\)`", API_PAGE.read_text(), flags=re.MULTILINE)
    assert not hand_written, f"expected no hand-written signatures in docs/api.md, found {hand_written}"
