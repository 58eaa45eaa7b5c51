"""timm's own model tests (``tests/test_models.py`` of the installed timm's sdist) over our timm names; none of timm's
code is stored here."""
from __future__ import annotations

import fnmatch
import os
import subprocess
import sys
import tarfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CACHE = REPO / ".cache" / "timm-sdist"

#: the tiny names ``make test-integration`` runs timm's tests over (``make conformance``: ``pid_*,fan_*``)
#: (one per model class: PID ViT/DeiT, PID distilled DeiT, PID FAN; the softmax fan_* only in conformance)
TINY = "pid_deit_tiny_patch16_224,pid_deit_tiny_distilled_patch16_224,pid_fan_tiny_12_p16_224"

_PATCHES = (
    ("NON_STD_FILTERS = [\n", "NON_STD_FILTERS = [\n    'pid_*', 'fan_*',  # pid-plugins\n"),
    ("FEAT_INTER_FILTERS = [\n", "FEAT_INTER_FILTERS = [\n    'fan',  # pid-plugins\n"),
)


def timm_version() -> str:
    from importlib.metadata import version

    return version("timm")


def fetch(version: str | None = None) -> Path:
    """timm's ``tests/`` folder of ``version`` (default: the installed one), downloaded once from PyPI."""
    version = version or timm_version()
    tests = CACHE / f"timm-{version}" / "tests"
    if (tests / "test_models.py").is_file():
        return tests
    CACHE.mkdir(parents=True, exist_ok=True)
    archive = CACHE / f"timm-{version}.tar.gz"
    if not archive.is_file():
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
             f"timm=={version}", "-d", str(CACHE)],
            check=True,
        )
    with tarfile.open(archive) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(f"timm-{version}/tests/") and m.isfile()]
        tar.extractall(CACHE, members=members, filter="data")
    return tests


def patched_test_file(tests: Path) -> Path:
    """``test_models_pid.py``: timm's ``test_models.py`` with our names added to its filter lists."""
    text = (tests / "test_models.py").read_text()
    for old, new in _PATCHES:
        if text.count(old) != 1:
            raise RuntimeError(f"timm's test_models.py changed: {old.strip()!r} found {text.count(old)} times")
        text = text.replace(old, new)
    out = tests / "test_models_pid.py"
    if not out.is_file() or out.read_text() != text:
        out.write_text(text)
    return out


def run(models: str = TINY, *pytest_args: str, timeout: float | None = None) -> subprocess.CompletedProcess:
    """Run timm's (patched) model tests over ``models`` in a fresh interpreter; returns the process."""
    tests = fetch()
    test_file = patched_test_file(tests)
    env = dict(os.environ, PID_TIMM_MODELS=models)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO / "tests"), str(REPO), env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-m", "pytest", "-p", "timm_suite", "-p", "no:cacheprovider", "-q",
           "--rootdir", str(tests), "-c", os.devnull, str(test_file), *pytest_args]
    return subprocess.run(cmd, env=env, cwd=tests, capture_output=True, text=True, timeout=timeout)


def _patterns() -> list[str]:
    return [p.strip() for p in os.environ.get("PID_TIMM_MODELS", TINY).split(",") if p.strip()]


def _ours(name: object) -> bool:
    return isinstance(name, str) and any(fnmatch.fnmatch(name, p) for p in _patterns())


def pytest_configure(config) -> None:  # noqa: D103 - pytest hook
    import timm
    import timm.models

    import pid_plugins.timm  # noqa: F401  registers the models before timm's test module is collected

    original = timm.list_models

    def list_models(*args, **kwargs):
        return [n for n in original(*args, **kwargs) if _ours(n)]

    timm.list_models = timm.models.list_models = list_models


def pytest_collection_modifyitems(config, items) -> None:  # noqa: D103 - pytest hook
    keep, drop = [], []
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        scripted = "torchscript" in item.name or item.get_closest_marker("torchscript") is not None
        (keep if _ours(params.get("model_name")) and not scripted else drop).append(item)
    items[:] = keep
    config.hook.pytest_deselected(items=drop)


if __name__ == "__main__":
    if sys.argv[1:] == ["fetch"]:
        print(fetch())
    elif sys.argv[1:2] == ["run"]:
        proc = run(*(sys.argv[2:3] or [TINY]), *sys.argv[3:])
        sys.stdout.write(proc.stdout[-20000:])
        sys.stderr.write(proc.stderr[-5000:])
        sys.exit(proc.returncode)
    else:
        sys.exit("usage: python tests/timm_suite.py fetch | run [PATTERNS [pytest args...]]")
