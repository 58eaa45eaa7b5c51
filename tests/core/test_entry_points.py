"""A method from another installed package (entry-point group ``pid_plugins.methods``) is registered where
pid-plugins registers with a zoo: :func:`pid_plugins.catalogue.load_installed_methods`."""
import sys
import textwrap

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


def test_an_installed_packages_method_is_registered_once(tmp_path, monkeypatch, caplog):
    _install(tmp_path, "toy_module", "toy_module", "toy_on_import", "register_method(TOY)")  # registers itself
    _install(tmp_path, "toy_object", "toy_object:TOY", "toy_object")  # names the method object
    _install(tmp_path, "toy_broken", "toy_broken:MISSING", "toy_broken")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "toy_on_import" not in list_methods()
    try:
        loaded = load_installed_methods()
        assert {"toy_on_import", "toy_object"} <= set(loaded) and "toy_broken" not in loaded
        assert {"toy_on_import", "toy_object"} <= set(list_methods())
        assert "toy_broken" in caplog.text and METHODS_GROUP in caplog.text
        assert load_installed_methods() == []  # once per process
    finally:  # the process's registry as before (other tests list the methods)
        for name in ("toy_on_import", "toy_object"):
            _METHODS.pop(name, None)
        for module in ("toy_module", "toy_object", "toy_broken"):
            sys.modules.pop(module, None)
