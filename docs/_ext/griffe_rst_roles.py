"""A griffe extension for the API reference: the docstrings are written in reStructuredText habits that markdown
does not know, and each is rewritten into what the site renders:

- Sphinx roles (``:class:`~a.b.C```, ``:func:`f```) become inline code (``~`` keeps the last name, as in Sphinx);
- literal blocks (a paragraph ending in ``::`` and the indented block after it) and ``.. code-block:: lang``
  directives become fenced code blocks (``Then::`` reads ``Then:``; a lone ``::`` line goes);
- the escaped space after inline code (````None``\\ s``) is dropped.

Only the rendered text changes; the sources are read statically, nothing is imported."""
from __future__ import annotations

import re
from typing import Any, List

import griffe

_ROLE = re.compile(r":(?:class|func|meth|mod|data|attr|exc|obj|ref):`(~?)([^`]+)`")
_DIRECTIVE = re.compile(r"^(\s*)\.\. code-block::\s*(\w*)\s*$")
_ESCAPED_SPACE = re.compile(r"(?<=`)\\ ")


def _code(match: re.Match) -> str:
    tilde, target = match.groups()
    return f"`{target.rsplit('.', 1)[-1] if tilde else target}`"


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _language(block: List[str]) -> str:
    try:
        compile("\n".join(block), "<docstring>", "exec")
    except SyntaxError:
        return "text"
    return "python"


def literal_blocks(text: str) -> str:
    """``text`` with its reST literal blocks and code-block directives as markdown fences."""
    lines = text.split("\n")
    out: List[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        directive = _DIRECTIVE.match(line)
        if directive:
            language = directive.group(2) or None
            base = _indent(line)
        elif line.rstrip().endswith("::") and not line.lstrip().startswith(".."):
            language = None
            base = _indent(line)
            head = line.rstrip()[:-2].rstrip()
            if head:
                # "Then::" reads "Then:"; "text ::" reads "text"
                out.append(head if line.rstrip()[-3:-2].isspace() else head + ":")
        else:
            out.append(line)
            i += 1
            continue
        # the block: the indented lines after the marker (blank lines inside it included)
        j = i + 1
        while j < len(lines) and not lines[j].strip():
            j += 1
        block_start = j
        while j < len(lines) and (not lines[j].strip() or _indent(lines[j]) > base):
            j += 1
        while j > block_start and not lines[j - 1].strip():
            j -= 1
        block = lines[block_start:j]
        if not block:  # a marker without a block: leave the text as it was
            if directive:
                out.append(line)
            i += 1
            continue
        strip = min(_indent(b) for b in block if b.strip())
        body = [b[strip:] if b.strip() else "" for b in block]
        pad = " " * base
        out += ["", pad + "```" + (language or _language(body))]
        out += [pad + b if b else "" for b in body]
        out += [pad + "```", ""]
        i = j
    return "\n".join(out)


class RstRoles(griffe.Extension):
    """Rewrites Sphinx roles as inline code and reST literal blocks as fenced code, in every docstring."""

    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            value = _ROLE.sub(_code, obj.docstring.value)
            obj.docstring.value = _ESCAPED_SPACE.sub("", literal_blocks(value))
