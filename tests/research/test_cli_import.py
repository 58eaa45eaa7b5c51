"""``--import MODULE`` for ``diagnose``, ``attack`` and ``study``: a method the user's module registers is selectable by
``--attention NAME`` / a study arm, the module found in the cwd or by its path, in a process of its own (tests/ not on
its path); without ``--import`` the name is refused with core's message."""
import json
import os
import sys
from pathlib import Path

import pytest
from pyexec import run_python_m

pytest.importorskip("timm")
import research.cli  # noqa: E402
from pid_plugins.cli import main  # noqa: E402

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent
SMALL = json.dumps(dict(img_size=8, patch_size=2, in_chans=1, num_classes=10, embed_dim=32, depth=3, num_heads=2))
MODEL = ["--model", "pid_deit_tiny_patch16_224", "--model", "pid_deit_tiny_patch16_224", "--model-kwargs", SMALL]
TOY = ["--attention", "scaled_reference", "--attention", "softmax", "--attention-cfg", '{"gamma": 2}',
       "--attention-cfg", "null"]
STUDY = ["--seeds", "0", "--depths", "2", "--parts", "vision", "--data", "digits", "--train-limit", "32",
         "--test-limit", "8", "--pgd-steps", "1", "--vision-epochs", "0.5"]
CORE_MESSAGE = "unknown attention method 'scaled_reference': choose 'softmax' or one of ["


def cli(*argv, cwd):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = run_python_m("research" if argv[0] == "study" else "pid_plugins", *argv, cwd=cwd, env=env, timeout=900)
    return proc


def records(out, command):
    return json.loads((out / f"{command}.json").read_text())["models"]


@pytest.mark.integration
@pytest.mark.slow
def test_diagnose_imports_a_module_from_the_current_directory(tmp_path):
    out = tmp_path / "d"
    proc = cli("diagnose", *MODEL, "--import", "toy_method", *TOY, "--data", "digits", "--num-samples", "8",
               "--passes", "0", "--out", str(out), cwd=TESTS)
    assert proc.returncode == 0, proc.stderr[-2000:]
    toy, soft = records(out, "diagnose").values()
    assert (toy["method"], toy["attention_cfg"]) == ("scaled_reference", {"gamma": 2.0})
    assert soft["method"] == "softmax"
    assert toy["mean_cosine"] != soft["mean_cosine"]


@pytest.mark.integration
@pytest.mark.slow
def test_attack_imports_a_module_by_file_path(tmp_path):
    out = tmp_path / "a"
    proc = cli("attack", *MODEL, "--import", str(TESTS / "toy_method.py"), *TOY, "--attacks", "fgsm",
               "--corruptions", "none", "--noise", "0.1,0.3", "--data", "digits", "--num-samples", "64",
               "--out", str(out), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    toy, soft = records(out, "attack").values()
    assert (toy["method"], toy["attention_cfg"]) == ("scaled_reference", {"gamma": 2.0})
    assert soft["method"] == "softmax"
    measured = ("clean", "fgsm", "noise")
    assert [toy[k] for k in measured] != [soft[k] for k in measured]
    assert "(scaled_reference): clean" in proc.stdout


@pytest.mark.integration
@pytest.mark.slow
def test_study_arm_names_an_imported_method(tmp_path):
    out = tmp_path / "s"
    proc = cli("study", "--out", str(out), "--import", "toy_method", "--arms",
               'softmax,sr=scaled_reference:{"gamma": 2}', *STUDY, cwd=TESTS)
    assert proc.returncode == 0, proc.stderr[-2000:]
    setting = json.loads((out / "study.json").read_text())["settings"]["vision_depth2"]
    assert setting["methods"]["sr"] == {"method": "scaled_reference", "attention_cfg": {"gamma": 2.0}}
    models = json.loads((out / "vision_depth2" / "seed0" / "results.json").read_text())["models"]
    assert models["sr"]["method"] == "scaled_reference"
    assert models["sr"]["collapse"]["mean_cosine"] != models["softmax"]["collapse"]["mean_cosine"]


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize("command", ["diagnose", "attack", "study"])
def test_without_import_the_name_is_refused_with_cores_message(tmp_path, command):
    out = tmp_path / "out"
    if command == "study":
        argv = ["study", "--out", str(out), "--arms", "softmax,scaled_reference", *STUDY]
    else:
        argv = [command, *MODEL, *TOY, "--data", "digits", "--out", str(out)]
    proc = cli(*argv, cwd=TESTS)  # toy_method.py is in the current directory, but nothing imports it
    assert proc.returncode == 2
    assert proc.stderr.startswith(f"{'research' if command == 'study' else 'pid-plugins'}: error: ")
    assert CORE_MESSAGE in proc.stderr
    assert "--import MODULE" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert not out.exists()


BROKEN = "import pid_plugins\nraise RuntimeError('this module is broken')\n"


@pytest.mark.parametrize("spec, message", [
    ("no_such_module_xyz", "--import 'no_such_module_xyz': no module named 'no_such_module_xyz' on the current "
                           "directory or PYTHONPATH"),
    ("no_such_pkg_xyz.methods", "--import 'no_such_pkg_xyz.methods': no module named 'no_such_pkg_xyz'"),
    ("missing/methods.py", "--import 'missing/methods.py': no such .py file"),
    ("not-a-name", "--import 'not-a-name': not a dotted module name"),
    ("broken_methods_xyz.py", "--import 'broken_methods_xyz.py': importing it failed: RuntimeError: this module is "
                              "broken"),
    ("needs_dep_xyz", "--import 'needs_dep_xyz': importing it failed: ModuleNotFoundError: No module named "
                      "'absent_dependency_xyz'"),
])
@pytest.mark.parametrize("command", ["diagnose", "study"])
def test_a_module_that_cannot_be_imported_is_named_in_one_line(tmp_path, monkeypatch, capsys, command, spec, message):
    (tmp_path / "broken_methods_xyz.py").write_text(BROKEN)
    (tmp_path / "needs_dep_xyz.py").write_text("import absent_dependency_xyz\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the current directory is added for the dotted names
    out = tmp_path / "out"
    if command == "study":
        argv = ["study", "--out", str(out), "--import", spec, *STUDY]
    else:
        argv = ["diagnose", *MODEL, "--import", spec, "--data", "digits", "--out", str(out)]
    assert (research.cli.main if command == "study" else main)(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"{'research' if command == 'study' else 'pid-plugins'}: error: {message}") and len(err.strip().splitlines()) == 1, err
    assert not out.exists()
    assert "broken_methods_xyz" not in sys.modules and "needs_dep_xyz" not in sys.modules
