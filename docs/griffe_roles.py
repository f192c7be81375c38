"""A griffe extension for the API reference (mkdocs.yml): the docstrings cross-reference with Sphinx roles
(``:class:`~autotp.Plan```, ``:func:`autotp.plan```, ``:mod:`autotp.capture.trace_cache```), which Markdown
would print as they are; each becomes inline code of the name (the last part where the role says ``~``),
as Sphinx would show it. The text of the docstrings in the code is left as it is."""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|data|attr|exc|obj|const):`(~?)([^`]+)`")


def _name(match: re.Match[str]) -> str:
    short, target = match.group(1), match.group(2)
    return f"`{target.rsplit('.', 1)[-1] if short else target}`"


class SphinxRoles(griffe.Extension):
    """Rewrites Sphinx roles in every loaded docstring as inline code."""

    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _ROLE.sub(_name, obj.docstring.value)
