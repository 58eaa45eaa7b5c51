"""Reads the registry (``pid_plugins.registry``: presets, one TOML file of variants per zoo) for every adapter, and
loads the attention methods other installed packages declare (entry-point group ``pid_plugins.methods``)."""
from __future__ import annotations

import difflib
import fnmatch
import functools
import logging
import tomllib
import warnings
from dataclasses import dataclass, field
from importlib import metadata, resources
from typing import Any, Iterable, Optional

from .core.methods import AttentionMethod, find_method, get_method, register_method

__all__ = ["ModelEntry", "load_presets", "load_catalogue", "list_models", "get_model_entry", "ZOOS",
           "METHODS_GROUP", "load_installed_methods"]

#: the entry-point group of attention methods from other packages: ``name = "module"`` (registers on import) or
#: ``name = "module:attribute"`` (an :class:`~pid_plugins.core.AttentionMethod` instance, registered if it is not)
METHODS_GROUP = "pid_plugins.methods"
_LOADED: set[str] = set()


def load_installed_methods() -> list[str]:
    """Load every ``pid_plugins.methods`` entry point not loaded yet in this process (each adapter calls this where it
    registers with its zoo); one that fails is skipped with a warning naming it. Returns the entry points loaded."""
    loaded = []
    for point in metadata.entry_points(group=METHODS_GROUP):
        key = f"{point.name} = {point.value}"
        if key in _LOADED:
            continue
        _LOADED.add(key)
        try:
            found = point.load()
            if isinstance(found, AttentionMethod) and find_method(found.name) is not found:
                register_method(found)
        except Exception as exc:  # a broken package must not stop the zoo: its method is then unknown by name
            logging.getLogger(__name__).warning("pid-plugins: the attention method entry point %r of group %s "
                                                "failed to load: %s: %s", key, METHODS_GROUP, type(exc).__name__, exc)
            continue
        loaded.append(point.name)
    return loaded

ZOOS = ("timm", "hf", "mmseg", "fairseq")
_ENTRY_KEYS = {"name", "base", "arch", "method", "preset", "gains", "description", "paper", "kwargs"}


@dataclass(frozen=True)
class ModelEntry:
    """One method variant: its name, zoo, stock architecture, method and its parameters, hyperparameters
    (``kwargs``) and paper numbers."""

    name: str
    zoo: str
    base: str
    #: a preset of the method's config ("": the method's default preset for this zoo, its ``default_presets``)
    preset: str = ""
    arch: str = ""  #: the model family inside the zoo (e.g. ``vit``, ``vit_distilled``, ``fan``)
    method: str = "pid"  #: the attention method the variant runs (its ``preset`` and ``gains`` are that method's)
    gains: dict[str, Any] = field(default_factory=dict)  #: overrides of the preset's fields (the method's parameters)
    description: str = ""
    paper: dict[str, Any] = field(default_factory=dict)
    kwargs: dict[str, Any] = field(default_factory=dict)

    def default_config(self) -> Any:
        """The variant's parameters: its method's config (``get_method(method).configure``) from the entry's preset,
        or the method's default preset for the entry's zoo, with the entry's overrides (``gains``)."""
        return get_method(self.method).configure(dict(self.gains), self.zoo, default=self.preset or None)

    def configure(self, overrides: Any = None) -> Any:
        """The variant's parameters with a user's ``overrides`` (None, a config, a preset name or a dict)."""
        return get_method(self.method).configure(overrides, self.zoo, default=self.default_config())


def _registry_files() -> Iterable[tuple[str, str]]:
    root = resources.files("pid_plugins.registry")
    for item in sorted(root.iterdir(), key=lambda p: p.name):
        if item.name.endswith(".toml"):
            yield item.name, item.read_text(encoding="utf-8")


def load_presets(method: str = "pid") -> dict[str, dict[str, Any]]:
    """``{preset name: {field: value}}`` of ``method``'s config (the built-in methods': ``registry/presets.toml``),
    a copy."""
    presets = getattr(get_method(method).config_type, "PRESETS", {})
    return {name: dict(fields) for name, fields in presets.items()}


def parse_catalogue(files: Iterable[tuple[str, str]]) -> dict[str, ModelEntry]:
    """Parse catalogue files ``(file name, TOML text)``; each file is ``<zoo>.toml`` with ``[[model]]`` tables."""
    entries: dict[str, ModelEntry] = {}
    for file_name, text in files:
        if file_name == "presets.toml":
            continue
        zoo = file_name.removesuffix(".toml")
        if zoo not in ZOOS:
            raise ValueError(f"registry/{file_name}: unknown zoo {zoo!r}; catalogue files are {list(ZOOS)}")
        raw = tomllib.loads(text)
        extra = set(raw) - {"model"}
        if extra:
            raise ValueError(f"registry/{file_name}: unexpected top-level keys {sorted(extra)}; use [[model]]")
        for table in raw.get("model", []):
            unknown = set(table) - _ENTRY_KEYS
            if unknown:
                raise ValueError(
                    f"registry/{file_name}: model {table.get('name')!r} has unknown keys {sorted(unknown)}; "
                    f"allowed: {sorted(_ENTRY_KEYS)}"
                )
            for key in ("name", "base"):
                if key not in table:
                    raise ValueError(f"registry/{file_name}: a model entry lacks {key!r}: {table}")
            entry = ModelEntry(zoo=zoo, **table)
            try:  # the method's config validates the preset and the overrides
                entry.default_config()
            except ValueError as exc:
                raise ValueError(f"registry/{file_name}: model {entry.name!r} (attention method {entry.method!r}): "
                                 f"{exc}") from None
            if entry.name in entries:
                raise ValueError(f"registry/{file_name}: model {entry.name!r} is declared twice")
            entries[entry.name] = entry
    return entries


@functools.lru_cache(maxsize=None)
def load_catalogue() -> dict[str, ModelEntry]:
    """Every method variant declared in the registry, by name."""
    return parse_catalogue(_registry_files())


def list_models(pattern: str = "*", zoo: Optional[str] = None) -> list[str]:
    """Names of the PID variants across zoos, sorted; filter by a glob ``pattern`` and/or ``zoo``."""
    if zoo is not None and zoo not in ZOOS:
        raise ValueError(f"unknown zoo {zoo!r}; choose one of {list(ZOOS)}")
    return sorted(
        name for name, e in load_catalogue().items()
        if fnmatch.fnmatch(name, pattern) and (zoo is None or e.zoo == zoo)
    )


def get_model_entry(name: str) -> ModelEntry:
    """The catalogue entry for ``name``; an unknown name raises ``ValueError`` with close matches."""
    catalogue = load_catalogue()
    if name not in catalogue:
        close = difflib.get_close_matches(name, list(catalogue), n=3)
        hint = f"; did you mean {close}?" if close else "; `pid-plugins list` shows every name"
        raise ValueError(f"unknown PID model {name!r}{hint}")
    return catalogue[name]
