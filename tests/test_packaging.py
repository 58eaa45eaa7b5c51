"""`import pid_plugins` needs only torch; adapters import their zoo lazily and say what to install."""
import subprocess
import sys


def run(code):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


def test_import_pid_plugins_imports_no_zoo():
    proc = run(
        "import sys, pid_plugins\n"
        "pid_plugins.PIDConfig.preset('deit'); pid_plugins.list_models()\n"
        "zoos = [m for m in ('timm', 'transformers', 'mmseg', 'mmcv', 'mmengine', 'fairseq', 'matplotlib') if m in sys.modules]\n"
        "print(zoos)\n"
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_timm_adapter_without_timm_says_what_to_install():
    proc = run("import sys; sys.modules['timm'] = None\nimport pid_plugins.timm\n")
    assert proc.returncode != 0
    assert "pid_plugins.timm needs timm: pip install -c constraints.txt 'pid-plugins[timm]'" in proc.stderr


def test_fairseq_compat_is_started_by_a_pth_file_in_site_packages():
    """fairseq-train (and pytest's hydra plugin) import fairseq before any plugin code: the hook must be live."""
    proc = run("import sys, dataclasses; print('pid_plugins_fairseq_compat' in sys.modules, "
               "getattr(dataclasses._get_field, '_pid_plugins_compat', False))")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["True", "True"]
