"""`import pid_plugins` needs only torch; adapters import their zoo lazily and say what to install; the package
never imports the experiments (the repository's top-level `research/`: demo, reproduce, study)."""
import ast
import subprocess
import sys
from pathlib import Path

import pytest
from pyexec import run_python_c

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "pid_plugins"
RESEARCH = "research"


def run(code):
    """A fresh interpreter: for what holds at interpreter start or depends on which zoos are imported."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


def run_forked(code):
    """``python -c`` in a fork of tests/pyexec.py's zygote (zoos imported, pid_plugins not): for what depends only
    on pid_plugins' own imports."""
    return run_python_c(code, timeout=300)


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


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path) -> set:
    """Every module a file imports (relative imports resolved; `from x import y` also counts x.y)."""
    name = module_name(path)
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            found.add(target)
            found.update(f"{target}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and (
                node.value == RESEARCH or node.value.startswith(RESEARCH + ".")):
            found.add(node.value)  # importlib.import_module("research...") and the like
    return found


def product_files():
    """The product: every module of pid_plugins (its command line and measurement tools included), and the fairseq
    compat hook."""
    return list(PACKAGE.rglob("*.py")) + [REPO / "pid_plugins_fairseq_compat.py"]


def test_product_imports_nothing_from_research():
    files = product_files()
    names = {module_name(p) for p in files}
    assert {"pid_plugins", "pid_plugins.catalogue", "pid_plugins.core.pid", "pid_plugins.timm.fan",
            "pid_plugins.hf.attention", "pid_plugins.mmseg.vit", "pid_plugins.fairseq.model", "pid_plugins.__main__",
            "pid_plugins.cli", "pid_plugins.analysis.run"} <= names
    offending = {module_name(p): sorted(m for m in imported_modules(p) if m == RESEARCH or m.startswith(RESEARCH + "."))
                 for p in files}
    assert not {k: v for k, v in offending.items() if v}, "the package must not import the experiments (research/)"


def test_the_import_scan_resolves_relative_imports():
    """The scan above sees research imports however they are spelled (else it could pass vacuously)."""
    assert "research.experiments" in imported_modules(REPO / "research" / "cli.py")  # from .experiments import
    assert "research.cli" in imported_modules(REPO / "research" / "__main__.py")  # from .cli import main
    assert "pid_plugins.cli" in imported_modules(PACKAGE / "__main__.py")  # from .cli import main
    catalogue_users = imported_modules(PACKAGE / "analysis" / "models.py")  # from ..catalogue import
    assert "pid_plugins.catalogue" in catalogue_users
    assert "pid_plugins.catalogue" in imported_modules(PACKAGE / "hf" / "catalogue.py")  # from .. import catalogue


@pytest.mark.slow
def test_adapters_import_no_research_module_at_run_time():
    proc = run_forked(
        "import sys\n"
        "import pid_plugins.timm, pid_plugins.hf, pid_plugins.mmseg, pid_plugins.fairseq\n"
        "print(sorted(m for m in sys.modules if m == 'research' or m.startswith('research.')))\n"
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.slow
def test_timm_adapter_without_timm_says_what_to_install():
    proc = run_forked("import sys; sys.modules['timm'] = None\nimport pid_plugins.timm\n")
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
