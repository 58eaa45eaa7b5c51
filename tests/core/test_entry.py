"""``pid_plugins._entry.finding_main``: only ``python -m <adapter package>`` itself makes an adapter's ``__init__``
stop before importing its zoo (so that command prints only its path)."""
import sys

import pytest

from pid_plugins._entry import finding_main


@pytest.mark.parametrize("package", ["pid_plugins.fairseq", "pid_plugins.mmseg"])
@pytest.mark.parametrize("argv0, orig, finding", [
    ("-m", ["python", "-m", "{p}"], True),
    ("-m", ["python", "-X", "dev", "-m{p}", "extra"], True),
    ("-m", ["python", "-m", "{p}.sub"], False),  # a submodule needs the adapter
    ("-m", ["python", "-m", "pid_plugins"], False),  # the parent package's command
    ("-m", ["python", "-m", "research", "demo"], False),  # another command importing the adapter
    ("-c", ["python", "-c", "import {p}"], False),
    ("/work/x/pid_plugins/adapter/__main__.py", ["python", "-m", "{p}"], False),  # __main__ running
])
def test_only_python_m_of_the_package_itself_skips_the_adapter(monkeypatch, package, argv0, orig, finding):
    monkeypatch.setattr(sys, "argv", [argv0])
    monkeypatch.setattr(sys, "orig_argv", [arg.format(p=package) for arg in orig])
    assert finding_main(package) is finding
