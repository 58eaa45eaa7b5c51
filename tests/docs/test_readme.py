"""Every ```python example of the README and the docs pages runs as written in an empty directory (as ``python -c``,
forked from tests/pyexec.py's zygote); the README stays short and talks to users first."""
import re
from pathlib import Path

import pytest
from pyexec import run_python_c

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").rglob("*.md"))]


def python_blocks(pages=PAGES):
    """One pytest param per ```python block: id ``<page>-<section>-<index>`` (the section is the ``## `` heading
    above the block, or ``top`` before the first one)."""
    blocks = []
    for page in pages:
        name = page.relative_to(ROOT).as_posix()
        sections = re.split(r"^## ", page.read_text(), flags=re.M)
        for n, section in enumerate(sections):
            title = section.splitlines()[0].strip() if n else "top"
            for i, code in enumerate(re.findall(r"^```python\n(.*?)^```", section, flags=re.S | re.M)):
                blocks.append(pytest.param(code, id=f"{name}-{title}-{i}"))
    return blocks


@pytest.mark.integration  # each example in a process of its own
@pytest.mark.slow
@pytest.mark.parametrize("code", python_blocks())
def test_docs_example_runs(code, tmp_path):
    proc = run_python_c(code, cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_readme_has_an_example_per_zoo():
    ids = [p.id for p in python_blocks([README])]
    for zoo in ("timm", "transformers", "mmsegmentation", "fairseq", "The core alone"):
        assert any(i.startswith(f"README.md-{zoo}-") for i in ids), (zoo, ids)


def test_docs_pages_keep_their_examples():
    ids = [p.id for p in python_blocks()]
    for page, section in (("docs/index.md", "Using the core"), ("docs/timm.md", "top"),
                          ("docs/transformers.md", "top"), ("docs/methods/custom.md", "An example"),
                          ("docs/methods/siblings.md", "top"), ("docs/finetuning.md", "Fine-tune with peft"),
                          ("docs/scaling.md", "FSDP2"), ("docs/export.md", "top"), ("docs/analysis.md", "Collapse")):
        assert any(i.startswith(f"{page}-{section}") for i in ids), (page, section)


def test_readme_is_short_and_talks_to_users_first():
    """The first screen: what it is and buys, `pip install` into an existing environment; the repository's two
    commands further down; nothing about this project's CI or sessions."""
    text = README.read_text()
    lines = text.splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines; the limit is 300 (move text to docs/)"
    head = "\n".join(lines[:40])
    assert 'pip install "pid-plugins[timm]"' in head and "What it buys, and what it does not" in head
    assert "make demo" in text and "make test" in text
    for internal in ("fresh-ci", "../shared", "landed", ".ci/run"):
        assert internal not in text, f"README.md mentions {internal!r}: CI internals go to CONTRIBUTING.md"
