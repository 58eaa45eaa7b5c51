"""The built wheel, installed as a user installs it (not editable, into a fresh venv that sees the pinned stack's
site-packages as a plain path, run from outside the repository), works for every zoo, and writes nothing that runs at
interpreter start (fairseq's hook only after the opt-in ``python -m pid_plugins_fairseq_compat install``)."""
import os
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

# every test here: the wheel built and installed by pip (make test-integration)
pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
STACK = sysconfig.get_paths()["purelib"]  # the pinned stack (torch, timm, transformers, mmseg, fairseq, ...)


@pytest.fixture(scope="module")
def installed(tmp_path_factory, pid_plugins_wheel):
    root = tmp_path_factory.mktemp("wheel")
    wheel = pid_plugins_wheel  # built from a clean copy of the sources (tests/conftest.py)
    names = set(zipfile.ZipFile(wheel).namelist())
    sources = {p.relative_to(REPO).as_posix() for p in (REPO / "pid_plugins").rglob("*.py")}
    assert sources <= names, f"source files missing from the wheel: {sorted(sources - names)}"
    assert "pid_plugins_fairseq_compat.py" in names
    assert not [n for n in names if n.endswith(".pth")], "the wheel must not start code in every interpreter"
    env_dir = root / "env"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--ignore-installed",
                    "-q", str(wheel)], check=True, cwd=root, capture_output=True, env=env)
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    # zz_: after the wheel's own .pth; a plain path line adds the stack without running its .pth files
    Path(purelib, "zz_pinned_stack.pth").write_text(STACK + "\n")
    work = root / "work"
    work.mkdir()
    env["PATH"] = f"{env_dir / 'bin'}:{env['PATH']}"
    return python, Path(purelib), work, env


def run(installed, *args, **kw):
    python, _, work, env = installed
    proc = subprocess.run([str(python), *args], cwd=kw.get("cwd", work), env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, f"{args}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def test_the_installed_wheel_leaves_the_standard_library_alone(installed):
    """``pip install pid-plugins[hf]``: no .pth of ours, and every interpreter's ``dataclasses._get_field`` is the
    standard library's, also after ``import pid_plugins`` and its transformers adapter."""
    _, purelib, _, _ = installed
    assert not list(purelib.glob("pid_plugins*.pth"))
    out = run(installed, "-c", (
        "import dataclasses, inspect, sys\n"
        "print(dataclasses._get_field.__module__, 'pid_plugins_fairseq_compat' in sys.modules)\n"
        "import pid_plugins, pid_plugins.hf\n"
        "print(dataclasses._get_field.__module__, 'pid_plugins_fairseq_compat' in sys.modules)\n"
    ))
    assert out.split() == ["dataclasses", "False", "dataclasses", "False"]


def test_without_the_opt_in_the_fairseq_adapter_patches_nothing_outside_fairseq(installed):
    """``import pid_plugins.fairseq`` without the opt-in: an ImportError naming it; the standard library and numpy are
    left as they were."""
    out = run(installed, "-c", (
        "import dataclasses, sys, numpy\n"
        "try:\n"
        "    import pid_plugins.fairseq\n"
        "except ImportError as exc:\n"
        "    print('refused:', exc)\n"
        "print(dataclasses._get_field.__module__, getattr(dataclasses._get_field, '_pid_plugins_compat', False), "
        "'compat' in vars(numpy))\n"
    )).strip().splitlines()
    assert out[0].startswith("refused: pid_plugins.fairseq: fairseq 0.12.2 does not import on Python 3.")
    assert "python -m pid_plugins_fairseq_compat install" in out[0] and "pid_plugins_fairseq_compat.install()" in out[0]
    assert out[-1].split() == ["dataclasses", "False", "False"]


def test_every_adapter_imports_from_the_wheel(installed):
    _, purelib, _, _ = installed
    out = run(installed, "-c", (
        "import sys, dataclasses, pid_plugins, pid_plugins_fairseq_compat\n"
        "pid_plugins_fairseq_compat.install()  # the fairseq adapter's opt-in, for this process\n"
        # nothing of the repository is importable: no sys.path entry inside it but the stack's site-packages
        # (which lies inside it when the venv is the repository's .venv, as with `make test`)
        f"import os; inside = [p for p in sys.path if p and os.path.abspath(p) != {STACK!r} and "
        f"(os.path.abspath(p) + '/').startswith({str(REPO) + '/'!r})]\n"
        "assert not inside, (inside, sys.path)\n"
        "import pid_plugins.timm, pid_plugins.hf, pid_plugins.mmseg, pid_plugins.fairseq\n"
        "print(pid_plugins.__file__)\n"
        "print(pid_plugins_fairseq_compat.__file__)\n"
        "print(getattr(dataclasses._get_field, '_pid_plugins_compat', False))\n"
    ))
    # the last three lines: the zoos' own imports may print first (deepspeed, which mmengine imports, names its
    # accelerator on stdout where no DS_ACCELERATOR is set, as in a user's environment)
    files = out.strip().splitlines()[-3:]
    assert files[0] == str(purelib / "pid_plugins" / "__init__.py")
    assert files[1] == str(purelib / "pid_plugins_fairseq_compat.py")
    assert files[2] == "True"  # the opt-in's hook, active in this process


def test_cli_and_registry_files_from_the_wheel(installed):
    out = run(installed, "-m", "pid_plugins", "list")
    assert "pid_deit_tiny_patch16_224" in out and "transformer_lm_pid" in out
    env_bin = installed[0].parent
    script = subprocess.run([str(env_bin / "pid-plugins"), "presets"], cwd=installed[2], env=installed[3],
                            capture_output=True, text=True, timeout=300)
    assert script.returncode == 0, script.stderr
    assert "deit" in script.stdout
    out = run(installed, "-c", (
        "import importlib.resources, tomllib\n"
        "files = sorted(f.name for f in importlib.resources.files('pid_plugins.registry').iterdir() if f.name.endswith('.toml'))\n"
        "print(files)\n"
        "for f in files: tomllib.loads(importlib.resources.files('pid_plugins.registry').joinpath(f).read_text())\n"
    ))
    shipped = sorted(p.name for p in (REPO / "registry").glob("*.toml"))
    assert out.strip() == str(shipped)


def test_fairseq_user_dir_from_the_wheel_trains(installed):
    """fairseq's own CLI imports fairseq before --user-dir: it runs after the documented opt-in command."""
    python, purelib, work, _ = installed
    out = run(installed, "-m", "pid_plugins_fairseq_compat", "install")
    assert str(purelib / "pid_plugins_fairseq_compat.pth") in out
    assert "active in this interpreter: True" in run(installed, "-m", "pid_plugins_fairseq_compat", "status")
    user_dir = run(installed, "-m", "pid_plugins.fairseq").strip()
    assert user_dir == str(purelib / "pid_plugins" / "fairseq" / "user_dir" / "pid_fairseq")
    words = [f"w{i}" for i in range(20)]
    lines = [" ".join(words[(7 * i + j) % 20] for j in range(10)) for i in range(200)]
    (work / "train.txt").write_text("\n".join(lines) + "\n")
    (work / "valid.txt").write_text("\n".join(lines[:20]) + "\n")
    run(installed, "-m", "fairseq_cli.preprocess", "--only-source", "--trainpref", "train.txt", "--validpref",
        "valid.txt", "--destdir", "data-bin", "--workers", "1")
    proc = subprocess.run(
        [str(python), "-m", "fairseq_cli.train", "data-bin", "--task", "language_modeling", "--user-dir", user_dir,
         "--arch", "transformer_lm_pid", "--decoder-layers", "2", "--decoder-embed-dim", "32",
         "--decoder-ffn-embed-dim", "64", "--decoder-attention-heads", "4", "--tokens-per-sample", "32",
         "--max-tokens", "256", "--optimizer", "adam", "--lr", "0.002", "--max-update", "4", "--cpu",
         "--num-workers", "0", "--save-dir", "ck", "--no-epoch-checkpoints", "--no-save"],
        cwd=work, env=installed[3], capture_output=True, text=True, timeout=600)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-3000:]
    assert "model: PIDTransformerLanguageModel" in log
    assert "num_updates 4" in log
    run(installed, "-m", "pid_plugins_fairseq_compat", "uninstall")  # the opt-in is undone by one command
    assert not (purelib / "pid_plugins_fairseq_compat.pth").exists()
    assert run(installed, "-c", "import dataclasses; print(dataclasses._get_field.__module__)").strip() == "dataclasses"


def test_the_wheel_carries_the_license_the_type_marker_the_mmseg_configs_and_its_metadata(pid_plugins_wheel):
    archive = zipfile.ZipFile(pid_plugins_wheel)
    names = set(archive.namelist())
    dist_info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA"))
    assert f"{dist_info}/licenses/LICENSE" in names
    assert archive.read(f"{dist_info}/licenses/LICENSE") == (REPO / "LICENSE").read_bytes()
    assert "pid_plugins/py.typed" in names
    configs = {p.name for p in (REPO / "configs" / "mmseg").glob("*.py")}
    assert configs and {f"pid_plugins/mmseg/configs/{name}" for name in configs} <= names
    metadata = archive.read(f"{dist_info}/METADATA").decode()
    fields = [line.split(": ", 1) for line in metadata.split("\n\n", 1)[0].splitlines() if ": " in line]
    values = {}
    for key, value in fields:
        values.setdefault(key, []).append(value)
    assert values["License-Expression"] == ["Apache-2.0"] and values["License-File"] == ["LICENSE"]
    assert values["Requires-Python"] == [">=3.11"] and values["Author"]
    assert "Programming Language :: Python :: 3.11" in values["Classifier"]
    assert {"timm", "transformers", "mmsegmentation", "fairseq"} <= set(values["Keywords"][0].split(","))
    extras = {line.split("; extra == ")[1].strip('"') for line in values["Requires-Dist"] if "; extra ==" in line}
    hf = [line for line in values["Requires-Dist"] if line.endswith('extra == "hf"')]
    assert not any(name in line for line in hf for name in ("peft", "gguf")), hf  # only what the feature needs
    assert {"timm", "hf", "peft", "mmseg", "fairseq"} <= extras


def test_the_wheel_carries_no_experiments(pid_plugins_wheel):
    """``pip install pid-plugins`` installs the plugin and its measurement tools (``pid-plugins diagnose``/``attack``),
    not the demo, reproduction and study: those live beside the package (``research/``, ``python -m research``)."""
    names = zipfile.ZipFile(pid_plugins_wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"pid_plugins", "pid_plugins_fairseq_compat.py"}, tops
    experiments = sorted(p.relative_to(REPO / "research").as_posix() for p in (REPO / "research").glob("*.py"))
    assert {"cli.py", "demo.py", "experiments.py", "study.py"} <= set(experiments)
    stems = {Path(n).stem for n in names if n.endswith(".py")}
    assert not stems & {"demo", "experiments", "study", "reproduce", "weights", "mmseg_data"}, sorted(stems)
    assert not [n for n in names if "research" in n.split("/")], names
    assert "pid_plugins/cli.py" in names and "pid_plugins/analysis/run.py" in names  # the product's tools stay


def test_the_sdist_carries_the_license(tmp_path):
    src = tmp_path / "src"
    import shutil

    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(
        ".git", ".venv", ".venv-*", "build", "dist", "*.egg-info", "__pycache__", "*_out", ".pytest_cache", ".cache",
        "data", "site"))
    subprocess.run([sys.executable, "setup.py", "-q", "sdist", "-d", str(tmp_path / "dist")], cwd=src, check=True,
                   capture_output=True)
    (sdist,) = (tmp_path / "dist").glob("pid_plugins-*.tar.gz")
    import tarfile

    with tarfile.open(sdist) as archive:
        names = archive.getnames()
    assert any(n.endswith("/LICENSE") and n.count("/") == 1 for n in names), names[:20]
    assert any(n.endswith("/configs/mmseg/segmenter_pid-deit-t_mask_8xb1-160k_ade20k-512x512.py") for n in names)


def test_a_pip_user_inherits_a_shipped_mmseg_config(installed):
    """The documented way: ``python -m pid_plugins.mmseg`` prints the configs' folder (only it, as ``"$(...)"`` needs,
    also where deepspeed is installed, no GPU is seen and DS_ACCELERATOR is unset, as here); an absolute ``_base_``."""
    python, purelib, work, env = installed
    proc = subprocess.run([str(python), "-m", "pid_plugins.mmseg"], cwd=work, capture_output=True, text=True,
                          env={k: v for k, v in env.items() if k != "DS_ACCELERATOR"}, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("\n") == 1 and proc.stdout.endswith("\n"), proc.stdout
    folder = proc.stdout[:-1]
    assert Path(folder).resolve() == (purelib / "pid_plugins" / "mmseg" / "configs").resolve()
    mine = work / "my_segmenter.py"
    mine.write_text(f"_base_ = '{folder}/segmenter_pid-deit-t_mask_8xb1-160k_ade20k-512x512.py'\n"
                    "model = dict(backbone=dict(attention='softmax'))\n")
    out = run(installed, "-c", (
        "from mmengine.config import Config\n"
        f"cfg = Config.fromfile({str(mine)!r})\n"
        "print(cfg.model.backbone.type, cfg.model.backbone.attention, cfg.custom_imports.imports)\n"
    )).strip().splitlines()
    assert out[-1] == "PIDVisionTransformer softmax ['pid_plugins.mmseg']"
