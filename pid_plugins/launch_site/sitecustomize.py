"""The start-up hook of ``pid-plugins run``, imported by Python as ``sitecustomize`` (standard library only): a
finder that imports a zoo's adapter right after the zoo, then the ``sitecustomize`` Python would have run."""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from typing import Dict, Optional, Sequence, Tuple

#: the environment variable that names the adapters to load (a comma list of :data:`ADAPTERS` keys)
ENV_VAR = "PID_PLUGINS_ADAPTERS"

#: adapter name -> (the adapter's module, the zoo's top-level module whose import triggers it)
ADAPTERS: Dict[str, Tuple[str, str]] = {"hf": ("pid_plugins.hf", "transformers"), "timm": ("pid_plugins.timm", "timm"),
                                        "mmseg": ("pid_plugins.mmseg", "mmseg"),
                                        "fairseq": ("pid_plugins.fairseq", "fairseq")}

HERE = os.path.dirname(os.path.abspath(__file__))


def _import_adapter(name: str) -> None:
    """Import one adapter by its :data:`ADAPTERS` name."""
    # each module name spelled out: the package's import graph is read from the source (test_import_graph.py)
    if name == "hf":
        importlib.import_module("pid_plugins.hf")
    elif name == "timm":
        importlib.import_module("pid_plugins.timm")
    elif name == "mmseg":
        importlib.import_module("pid_plugins.mmseg")
    elif name == "fairseq":
        importlib.import_module("pid_plugins.fairseq")
    else:  # pragma: no cover - the launcher checks the names
        raise ImportError(f"pid-plugins run: unknown adapter {name!r} in {ENV_VAR} (known: {', '.join(ADAPTERS)})")
    importlib.import_module("pid_plugins.catalogue").load_installed_methods()


class AdapterLoader(importlib.abc.Loader):
    """The zoo's own loader, then the adapter's import, once per process (a ``find_spec`` alone imports nothing)."""

    def __init__(self, loader: importlib.abc.Loader, finder: "AdapterFinder", zoo: str) -> None:
        self.loader, self.finder, self.zoo = loader, finder, zoo
        self.create_module = loader.create_module

    def exec_module(self, module) -> None:  # type: ignore[override]
        module.__loader__ = module.__spec__.loader = self.loader
        self.loader.exec_module(module)
        adapter = self.finder.pending.pop(self.zoo, None)
        try:
            adapter is None or _import_adapter(adapter)
        except Exception as exc:
            raise ImportError(f"pid-plugins run: the {adapter} adapter ({ADAPTERS[adapter][0]}) failed to import in "
                              f"{sys.executable}: {type(exc).__name__}: {exc}") from exc


class AdapterFinder(importlib.abc.MetaPathFinder):
    """Finds each zoo with the other finders and hands it out with an :class:`AdapterLoader`, until it has run once."""

    def __init__(self, adapters: Sequence[str]) -> None:
        self.pending = {ADAPTERS[name][1]: name for name in adapters}

    def find_spec(self, fullname: str, path: Optional[Sequence[str]] = None,  # type: ignore[override]
                  target=None) -> Optional[importlib.machinery.ModuleSpec]:
        if fullname not in self.pending:
            return None
        others = (f for f in sys.meta_path if f is not self and hasattr(f, "find_spec"))
        spec = next((s for s in (f.find_spec(fullname, path, target) for f in others) if s is not None), None)
        if spec is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = AdapterLoader(spec.loader, self, fullname)
        return spec


def install(adapters: Sequence[str]) -> None:
    """Import each adapter whose zoo is already imported; hook the others' zoos."""
    later = [n for n in adapters if ADAPTERS[n][1] not in sys.modules]
    for name in (n for n in adapters if n not in later):
        _import_adapter(name)
    if later:
        sys.meta_path.insert(0, AdapterFinder(later))


def _chain() -> None:
    """Run the ``sitecustomize`` Python would have found without this folder, as ``sitecustomize``."""
    here = os.path.normcase(HERE)
    path = [p for p in sys.path if os.path.normcase(os.path.abspath(p or os.curdir)) != here]
    sys.path[:] = path
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)


def _main() -> None:
    names = [n.strip() for n in os.environ.get(ENV_VAR, "").split(",") if n.strip()]
    unknown = [n for n in names if n not in ADAPTERS]
    if unknown:
        raise ImportError(f"pid-plugins run: unknown adapter(s) {', '.join(unknown)} in {ENV_VAR} "
                          f"(known: {', '.join(ADAPTERS)})")
    install(names)
    _chain()


if __name__ == "sitecustomize":
    _main()
