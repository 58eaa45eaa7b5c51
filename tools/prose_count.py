"""Count docstring, comment and code lines per Python file, and list the docstrings longer than a limit.

    python tools/prose_count.py                  # pid_plugins/, docstrings over 15 lines
    python tools/prose_count.py pid_plugins/hf --over 10 --files

Docstring lines are the lines a module, class or function docstring spans; comment lines are lines holding only a
comment; code lines are the other non-blank lines. Only the standard library is used (``ast``, ``tokenize``).
"""
from __future__ import annotations

import argparse
import ast
import io
import sys
import tokenize
from pathlib import Path
from typing import Dict, List, NamedTuple, Tuple


class Counts(NamedTuple):
    code: int
    docstring: int
    comment: int


def docstrings(tree: ast.Module) -> List[Tuple[str, int, int]]:
    """(name, first line, number of lines) of every module, class and function docstring in ``tree``."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                doc = body[0]
                name = getattr(node, "name", "<module>")
                found.append((name, doc.lineno, doc.end_lineno - doc.lineno + 1))
    return sorted(found, key=lambda d: d[1])


def count(source: str) -> Tuple[Counts, List[Tuple[str, int, int]]]:
    """The line counts of one file's ``source`` and its docstrings."""
    docs = docstrings(ast.parse(source))
    doc_lines = {line for _, first, n in docs for line in range(first, first + n)}
    comment_lines = set()
    code_lines = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comment_lines.add(tok.start[0])
        elif tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER):
            code_lines.update(range(tok.start[0], tok.end[0] + 1))
    code_lines -= doc_lines
    return Counts(len(code_lines), len(doc_lines), len(comment_lines - code_lines - doc_lines)), docs


def main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="*", default=["pid_plugins"], help="files or folders (default: pid_plugins)")
    parser.add_argument("--over", type=int, default=15, help="list the docstrings longer than this (default: 15)")
    parser.add_argument("--files", action="store_true", help="one line per file")
    args = parser.parse_args(argv)
    files = sorted({f for p in map(Path, args.paths) for f in ([p] if p.is_file() else p.rglob("*.py"))})
    per_file: Dict[Path, Counts] = {}
    long: List[Tuple[Path, str, int, int]] = []
    for f in files:
        per_file[f], docs = count(f.read_text(encoding="utf-8"))
        long += [(f, name, first, n) for name, first, n in docs if n > args.over]
    if args.files:
        print(f"{'code':>6} {'docs':>6} {'comm':>6}  file")
        for f, c in per_file.items():
            print(f"{c.code:6d} {c.docstring:6d} {c.comment:6d}  {f}")
    total = Counts(*(sum(c[i] for c in per_file.values()) for i in range(3)))
    print(f"{len(files)} files: {total.code} code lines, {total.docstring} docstring lines, "
          f"{total.comment} comment lines")
    print(f"{len(long)} docstrings over {args.over} lines:")
    for f, name, first, n in sorted(long, key=lambda d: -d[3]):
        print(f"  {n:4d}  {f}:{first} {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
