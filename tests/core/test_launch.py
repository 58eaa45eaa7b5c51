"""``pid-plugins run`` (pid_plugins.launch and its sitecustomize): what reaches the command's processes, bad input,
and that nothing else changes. The real tools through it: tests/zoos/*/test_tools_*.py."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from pid_plugins import launch as L
from tool_cases import check, env, launch

PY = sys.executable

#: the tests that run ``pid-plugins run`` (or the bare command beside it) in processes of their own: the launcher's
#: whole job is what reaches a new interpreter and its children, so they are process tests (make test-integration,
#: CONTRIBUTING.md's tiers); the in-process ones (main up to the exec, bad input, the environment) stay in make test
def PROCESSES(test):
    return pytest.mark.integration(pytest.mark.slow(test))

#: prints which zoos and adapters this process holds, then runs itself again in a child (one level)
PROBE = """
import json, os, subprocess, sys
import timm
mods = sorted(m for m in ("timm", "transformers", "pid_plugins.timm", "pid_plugins.hf") if m in sys.modules)
report = {"mods": mods, "sitecustomize": getattr(sys.modules.get("sitecustomize"), "__file__", None),
          "on_path": any(p.endswith("launch_site") for p in sys.path), "names": timm.list_models("pid_deit_tiny_p*")}
if len(sys.argv) > 1:
    report["child"] = json.loads(subprocess.run([sys.executable, __file__], capture_output=True, text=True,
                                                check=True).stdout.splitlines()[0])
print(json.dumps(report))
"""


@PROCESSES
def test_adapters_reach_the_command_and_its_children_lazily(tmp_path):
    """The adapter of a zoo the process imports is there (in the command and in a child it starts), the others are
    not imported; the environment's own sitecustomize still runs, and the launcher's folder leaves sys.path."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import os\nos.environ['THEIRS'] = 'ran'\n")
    (tmp_path / "probe.py").write_text(PROBE + "print(os.environ.get('THEIRS'))\n")
    proc = check(launch([PY, "probe.py", "nest"], tmp_path, PYTHONPATH=f"{site}{os.pathsep}{L.SITE_DIR.rsplit(os.sep, 2)[0]}"))
    lines = proc.stdout.splitlines()
    report = json.loads(lines[0])
    assert lines[-1] == "ran"
    for level in (report, report["child"]):
        assert level["mods"] == ["pid_plugins.timm", "timm"], level  # transformers never imported: no hf adapter
        assert level["names"] == ["pid_deit_tiny_patch16_224"] and not level["on_path"]
        assert Path(level["sitecustomize"]).parent == site  # the environment's own, chained


@PROCESSES
def test_without_the_launcher_nothing_is_there(tmp_path):
    (tmp_path / "probe.py").write_text(PROBE)
    report = json.loads(check(launch([PY, "probe.py"], tmp_path, launcher=False, PYTHONPATH=str(tmp_path))).stdout)
    assert report["names"] == [] and report["mods"] == ["timm"]


@PROCESSES
def test_a_find_spec_does_not_use_up_the_hook(tmp_path):
    code = ("import importlib.util, sys; assert importlib.util.find_spec('timm'); import timm; "
            "print('pid_plugins.timm' in sys.modules)")
    assert check(launch([PY, "-c", code], tmp_path, adapters="timm")).stdout.strip() == "True"


@PROCESSES
def test_an_adapter_that_fails_to_import_is_named(tmp_path):
    """A zoo the adapter cannot work with (here a fake ``timm`` first on the path): the zoo's import fails with
    one error naming the adapter, never a process without it."""
    fake = tmp_path / "fake"
    (fake / "timm").mkdir(parents=True)
    (fake / "timm" / "__init__.py").write_text("")
    proc = launch([PY, "-c", "import timm"], tmp_path, adapters="timm",
                  PYTHONPATH=f"{fake}{os.pathsep}{env()['PYTHONPATH']}")
    assert proc.returncode == 1
    assert "pid-plugins run: the timm adapter (pid_plugins.timm) failed to import in" in proc.stderr, proc.stderr


def test_the_launcher_imports_no_zoo_and_sets_only_the_command_environment(monkeypatch):
    """``main`` up to the exec, in a clean interpreter: no zoo imported, the environment handed to the command."""
    code = f"""
import json, os, sys
from pid_plugins import launch
seen = {{}}
def fake_exec(program, argv, environ):
    seen.update(program=program, argv=argv, path=environ["PYTHONPATH"], names=environ["{L.ENV_VAR}"],
                zoos=[m for m in ("timm", "transformers", "mmseg", "fairseq") if m in sys.modules],
                ours="{L.ENV_VAR}" in os.environ)
    print(json.dumps(seen)); sys.exit(0)
os.execve = fake_exec
launch.main(["--adapters", "timm,hf", "--", "python", "-c", "pass"])
"""
    proc = check(launch([PY, "-c", code], Path.cwd(), launcher=False))
    seen = json.loads(proc.stdout)
    assert seen["zoos"] == [] and not seen["ours"]
    assert seen["names"] == "timm,hf" and seen["path"].split(os.pathsep)[0] == L.SITE_DIR
    assert seen["argv"] == ["python", "-c", "pass"] and os.path.basename(seen["program"]).startswith("python")


BAD_INPUT = [
    ([], "no command to run"),
    (["--"], "no command to run"),
    (["--adapters", "hf,nope", "--", "python"], "unknown adapter 'nope' in --adapters (known: hf, timm, mmseg, fairseq)"),
    (["--adapters"], "--adapters needs a value"),
    (["--adapters", ","], "--adapters needs at least one of hf, timm, mmseg, fairseq"),
    (["--", "no-such-command-here"], "command not found: no-such-command-here (not on PATH)"),
    (["--", "./no/such/file"], "command not found: ./no/such/file (no executable file there)"),
    (["--verbose", "--", "python"], "unknown option '--verbose'"),
]


def one_error_line(returncode: int, stdout: str, stderr: str, message: str) -> None:
    assert returncode == 2 and stdout == ""
    assert stderr.startswith("pid-plugins run: error: ") and message in stderr, stderr
    assert len(stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("argv, message", BAD_INPUT)
def test_bad_input_is_one_clear_error(argv, message, tmp_path, monkeypatch, capsys):
    """In this process, through the function ``python -m pid_plugins`` and the console script call
    (``pid_plugins.cli.main``); a command that would start instead fails the test (``os.execve`` is replaced)."""
    from pid_plugins.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(os, "execve", lambda *args: pytest.fail(f"{argv} was accepted: it would run {args[:2]}"))
    returncode = main(["run", *argv])
    one_error_line(returncode, *capsys.readouterr(), message)


@PROCESSES
def test_bad_input_is_one_clear_error_in_a_process_of_its_own(tmp_path):
    """The same as a user's shell sees it (the exit status, and nothing else on either stream): ``python -m
    pid_plugins run`` and the console script's code, each with a case of BAD_INPUT."""
    console = ["-c", "from pid_plugins.cli import main; raise SystemExit(main())", "run"]
    for prefix, (argv, message) in ((["-m", "pid_plugins", "run"], BAD_INPUT[2]), (console, BAD_INPUT[0])):
        proc = launch([PY, *prefix, *argv], tmp_path, launcher=False)
        one_error_line(proc.returncode, proc.stdout, proc.stderr, message)


@PROCESSES
def test_help_and_the_cli_listing(tmp_path):
    proc = check(launch([PY, "-m", "pid_plugins", "run", "--help"], tmp_path, launcher=False))
    assert proc.stdout.startswith("usage: pid-plugins run [--adapters") and "accelerate launch" in proc.stdout
    listing = check(launch([PY, "-m", "pid_plugins", "--help"], tmp_path, launcher=False)).stdout
    assert "run a command with the zoo adapters" in listing


@PROCESSES
def test_exit_code_and_arguments_pass_through(tmp_path):
    proc = launch([PY, "-c", "import sys; print(sys.argv[1:]); sys.exit(3)", "--model", "a b", "--"], tmp_path,
                  adapters="hf")
    assert proc.returncode == 3 and proc.stdout.strip() == "['--model', 'a b', '--']"


def test_environment_puts_the_folder_first_once():
    base = {"PYTHONPATH": os.pathsep.join(["/a", L.SITE_DIR, "/b"]), "PATH": "/bin"}
    out = L.environment(["hf"], base)
    assert out["PYTHONPATH"].split(os.pathsep) == [L.SITE_DIR, "/a", "/b"] and out[L.ENV_VAR] == "hf"
    assert base["PYTHONPATH"].startswith("/a")  # the caller's mapping is not changed
    assert L.default_adapters() == [n for n in L.ADAPTERS if __import__("importlib").util.find_spec(L.ADAPTERS[n][1])]
