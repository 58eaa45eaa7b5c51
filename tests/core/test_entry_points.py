"""A method from another installed package (entry-point group ``pid_plugins.methods``) is registered where
pid-plugins registers with a zoo: :func:`pid_plugins.catalogue.load_installed_methods`."""
import sys
import textwrap

import pytest

from pid_plugins import list_methods
from pid_plugins.catalogue import METHODS_GROUP, load_installed_methods
from pid_plugins.core.methods import _METHODS

METHOD = """
from pid_plugins import AttentionMethod, register_method
from pid_plugins.core.siblings.twicing import TwicingConfig


class Toy(AttentionMethod):
    name = "{name}"
    config_type = TwicingConfig
    state_fields = ()

    def update(self, params, out, value_q, state, scale, head_dim):
        return out, ()


TOY = Toy()
{register}
"""


def _install(root, package, entry, name, register=""):
    """A distribution in ``root`` (a folder on sys.path): the package and its .dist-info with one entry point."""
    (root / package).mkdir()
    (root / package / "__init__.py").write_text(METHOD.format(name=name, register=register))
    info = root / f"{package}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {package}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(textwrap.dedent(f"[{METHODS_GROUP}]\n{name} = {entry}\n"))


def _transformers_tables() -> list:
    """transformers' attention and mask tables, where pid_plugins.hf registers every method's name (none without it)."""
    if "pid_plugins.hf" not in sys.modules:
        return []
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    return [AttentionInterface._global_mapping, AttentionMaskInterface._global_mapping]


def test_an_installed_packages_method_is_registered_once(tmp_path, monkeypatch, caplog):
    _install(tmp_path, "toy_module", "toy_module", "toy_on_import", "register_method(TOY)")  # registers itself
    _install(tmp_path, "toy_object", "toy_object:TOY", "toy_object")  # names the method object
    _install(tmp_path, "toy_broken", "toy_broken:MISSING", "toy_broken")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "toy_on_import" not in list_methods()
    tables = _transformers_tables()
    saved = [dict(table) for table in tables]
    try:
        loaded = load_installed_methods()
        assert {"toy_on_import", "toy_object"} <= set(loaded) and "toy_broken" not in loaded
        assert {"toy_on_import", "toy_object"} <= set(list_methods())
        assert "toy_broken" in caplog.text and METHODS_GROUP in caplog.text
        assert load_installed_methods() == []  # once per process
    finally:  # the process's registry and transformers' tables as before (other tests read both)
        for name in ("toy_on_import", "toy_object"):
            _METHODS.pop(name, None)
        for table, before in zip(tables, saved):
            table.clear()
            table.update(before)
        for module in ("toy_module", "toy_object", "toy_broken"):
            sys.modules.pop(module, None)


#: where pid-plugins registers with a zoo, in a fresh process: what the user runs, with no import of the method
ZOO_ENTRIES = {
    "mmseg custom_imports": "import pid_plugins.mmseg",
    "fairseq --user-dir": "import sys; sys.path.insert(0, {user_dir!r}); import pid_fairseq",
    "pid-plugins run": "from pid_plugins.launch_site.sitecustomize import _import_adapter; _import_adapter('timm')",
}


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize("where", list(ZOO_ENTRIES))
def test_each_zoos_registration_loads_the_installed_methods(where, tmp_path):
    import os
    import subprocess

    import pid_plugins

    _install(tmp_path, "toy_module", "toy_module", "toy_on_import", "register_method(TOY)")
    user_dir = os.path.join(os.path.dirname(pid_plugins.__file__), "fairseq", "user_dir")
    code = ZOO_ENTRIES[where].format(user_dir=user_dir)
    code += "; from pid_plugins import list_methods; print('toy_on_import' in list_methods())"
    path = os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))
    out = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=path), capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0 and out.stdout.strip().splitlines()[-1] == "True", out.stderr[-3000:]
