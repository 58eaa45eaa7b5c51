"""A griffe extension for the API reference: the docstrings use Sphinx roles (``:class:`~a.b.C```,
``:func:`f```); markdown has none, so each becomes inline code (``~`` keeps the last name, as in Sphinx).
Only the rendered text changes; the sources are read statically, nothing is imported."""
from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:class|func|meth|mod|data|attr|exc|obj|ref):`(~?)([^`]+)`")


def _code(match: re.Match) -> str:
    tilde, target = match.groups()
    return f"`{target.rsplit('.', 1)[-1] if tilde else target}`"


class RstRoles(griffe.Extension):
    """Rewrites Sphinx roles in every docstring as inline code."""

    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _ROLE.sub(_code, obj.docstring.value)
