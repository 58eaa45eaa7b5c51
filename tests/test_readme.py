"""Every ```python example in the README and on every docs page (docs/**/*.md) runs as written, in an empty
directory; the README stays short (at most 300 lines, `make demo` and `make test` in its first 80)."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
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


@pytest.mark.slow  # make test-fast leaves the examples out
@pytest.mark.parametrize("code", python_blocks())
def test_docs_example_runs(code, tmp_path):
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_readme_has_an_example_per_zoo():
    ids = [p.id for p in python_blocks([README])]
    for zoo in ("timm", "transformers", "mmsegmentation", "fairseq", "The core alone"):
        assert any(i.startswith(f"README.md-{zoo}-") for i in ids), (zoo, ids)


def test_docs_pages_keep_their_examples():
    ids = [p.id for p in python_blocks()]
    for page, section in (("docs/index.md", "Using the core"), ("docs/timm.md", "top"),
                          ("docs/transformers.md", "top"), ("docs/methods/custom.md", "top"),
                          ("docs/methods/siblings.md", "top"), ("docs/finetuning.md", "Fine-tune with peft"),
                          ("docs/scaling.md", "FSDP2"), ("docs/export.md", "top"), ("docs/analysis.md", "Collapse")):
        assert any(i.startswith(f"{page}-{section}") for i in ids), (page, section)


def test_readme_is_short_with_the_two_commands_first():
    lines = README.read_text().splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines; the limit is 300 (move text to docs/)"
    head = "\n".join(lines[:80])
    assert "make demo" in head and "make test" in head, "`make demo` and `make test` must be in the first 80 lines"
