"""`import pid_plugins` needs only torch; adapters import their zoo lazily and say what to install, and import no
experiment (`research/`) at run time (the source's edges: test_import_graph.py)."""
import subprocess
import sys

import pytest
from pyexec import run_python_c

def run(code):
    """A fresh interpreter: for what holds at interpreter start or depends on which zoos are imported."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


def test_import_pid_plugins_imports_no_zoo():
    proc = run(
        "import sys, pid_plugins\n"
        "pid_plugins.PIDConfig.preset('deit'); pid_plugins.list_models()\n"
        "zoos = [m for m in ('timm', 'transformers', 'mmseg', 'mmcv', 'mmengine', 'fairseq', 'matplotlib') if m in sys.modules]\n"
        "print(zoos)\n"
        "print(sorted(m for m in sys.modules if m == 'research' or m.startswith('research.')))\n"
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n")[:2] == ["[]", "[]"], proc.stdout


@pytest.mark.slow
def test_adapters_import_no_research_module_at_run_time():
    proc = run_python_c(
        "import sys\n"
        "import pid_plugins.timm, pid_plugins.hf, pid_plugins.mmseg, pid_plugins.fairseq\n"
        "print(sorted(m for m in sys.modules if m == 'research' or m.startswith('research.')))\n", timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.slow
def test_timm_adapter_without_timm_says_what_to_install():
    proc = run_python_c("import sys; sys.modules['timm'] = None\nimport pid_plugins.timm\n", timeout=300)
    assert proc.returncode != 0
    assert "pid_plugins.timm needs timm: pip install -c constraints.txt 'pid-plugins[timm]'" in proc.stderr


@pytest.mark.slow
def test_fairseq_compat_is_started_by_the_opt_in_pth_file_in_site_packages():
    """fairseq-train (and pytest's hydra plugin) import fairseq before any plugin code: in this environment (the
    fairseq extra, where make runs ``python -m pid_plugins_fairseq_compat install``) the hook is live at start."""
    proc = run("import sys, dataclasses; print('pid_plugins_fairseq_compat' in sys.modules, "
               "getattr(dataclasses._get_field, '_pid_plugins_compat', False))")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["True", "True"]
