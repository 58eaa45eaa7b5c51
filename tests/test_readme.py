"""Every ```python example in the README runs as written."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # every test here (make test-fast leaves them out)

README = Path(__file__).resolve().parents[1] / "README.md"


def python_blocks():
    text = README.read_text()
    blocks = []
    for section in re.split(r"^## ", text, flags=re.M)[1:]:
        title = section.splitlines()[0].strip()
        for i, code in enumerate(re.findall(r"```python\n(.*?)```", section, flags=re.S)):
            blocks.append(pytest.param(code, id=f"{title}-{i}"))
    return blocks


@pytest.mark.parametrize("code", python_blocks())
def test_readme_example_runs(code, tmp_path):
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_readme_has_the_examples():
    ids = [p.id for p in python_blocks()]
    assert any(i.startswith("Using the core") for i in ids)
    assert any(i.startswith("timm") for i in ids)
