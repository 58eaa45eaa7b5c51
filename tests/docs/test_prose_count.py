"""tools/prose_count.py: docstring, comment and code lines of a file, and the docstrings over a limit."""
import importlib.util
from pathlib import Path

spec = importlib.util.spec_from_file_location(
    "prose_count", Path(__file__).resolve().parents[2] / "tools" / "prose_count.py")
prose_count = importlib.util.module_from_spec(spec)
spec.loader.exec_module(prose_count)

SOURCE = '''"""Module docstring,
two lines."""
import os  # a trailing comment is a code line

# a comment line


def f(x):
    """One line."""
    return x


class C:
    """Three
    lines
    long."""

    def g(self):
        return (1,
                2)
'''


def test_counts_docstrings_comments_and_code():
    counts, docs = prose_count.count(SOURCE)
    assert docs == [("<module>", 1, 2), ("f", 9, 1), ("C", 14, 3)]
    # code: import, def f, return x, class C, def g, return (1, 2) over two lines
    assert counts == prose_count.Counts(code=7, docstring=6, comment=1)


def test_lists_the_docstrings_over_the_limit(tmp_path, capsys):
    (tmp_path / "m.py").write_text(SOURCE)
    assert prose_count.main([str(tmp_path), "--over", "2"]) == 0
    out = capsys.readouterr().out
    assert "1 files: 7 code lines, 6 docstring lines, 1 comment lines" in out
    assert "1 docstrings over 2 lines:" in out and f"{tmp_path / 'm.py'}:14 C" in out
