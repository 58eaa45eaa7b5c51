"""``python -m pid_plugins.mmseg`` prints only the shipped configs' folder, for ``_base_ = "$(...)/<config>.py"``."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mmseg")
import pid_plugins.mmseg as pm  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]


def test_python_m_prints_only_the_configs_folder_and_imports_neither_mmseg_nor_deepspeed():
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "pid_plugins.mmseg"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert len(lines) == 1 and proc.stdout == lines[0] + "\n", proc.stdout
    folder = Path(lines[0])
    assert folder.is_dir() and folder.samefile(pm.CONFIGS)
    shipped = {p.name for p in (ROOT / "configs" / "mmseg").glob("segmenter_*.py")}
    assert shipped and shipped <= {p.name for p in folder.glob("*.py")}
    imported = {m.group(1) for m in re.finditer(r"^import time:[^|]*\|[^|]*\|\s*([\w.]+)\s*$", proc.stderr, re.M)}
    assert "pid_plugins.mmseg" in imported  # -X importtime did list the imports
    assert not {name for name in imported if name.split(".")[0] in ("mmseg", "mmengine", "mmcv", "deepspeed")}


def test_the_public_names_are_there_on_a_plain_import():
    for name in pm.__all__:
        assert getattr(pm, name) is not None, name
    from mmseg.registry import MODELS

    assert MODELS.get("PIDVisionTransformer") is pm.PIDVisionTransformer
