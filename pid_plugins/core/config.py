"""Method parameters: :class:`MethodConfig` (a frozen value with presets, validation and a dict round trip) and
:func:`registry_presets`, the built-in methods' presets from ``registry/presets.toml``."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar, Dict, List, Mapping

__all__ = ["MethodConfig", "fx_constant", "registry_presets"]


def fx_constant(value: Any, tracer: Any) -> Any:
    """torch.fx's ``__fx_create_arg__`` for a method or its config: stored once on the traced root, read by a
    ``get_attr`` node."""
    stored = tracer.__dict__.setdefault("_pid_plugins_constants", {})
    name = stored.get(id(value))
    if name is None:
        name = tracer.get_fresh_qualname("_pid_plugins_constant")
        setattr(tracer.root, name, value)
        stored[id(value)] = name
    return tracer.create_node("get_attr", name, (), {})


@dataclass(frozen=True)
class MethodConfig:
    """Base for a method's parameters, a frozen dataclass of float/int/bool/str fields: ``PRESETS`` (``{name:
    {field: value}}``), ``validate()`` and ``ZERO`` (the fields with which it computes the stock attention)."""

    PRESETS: ClassVar[Mapping[str, Mapping[str, Any]]] = {}
    ZERO: ClassVar[Mapping[str, Any]] = {}

    def __fx_create_arg__(self, tracer: Any) -> Any:  # a constant of a torch.fx graph (see fx_constant)
        return fx_constant(self, tracer)

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            kind = f.type if isinstance(f.type, type) else _KINDS.get(str(f.type))
            if kind is float and isinstance(value, int) and not isinstance(value, bool):
                object.__setattr__(self, f.name, float(value))
            elif kind is not None and (not isinstance(value, kind) or (kind is not bool and isinstance(value, bool))):
                raise ValueError(f"{type(self).__name__}.{f.name} must be {kind.__name__}, got {value!r}")
        self.validate()

    def validate(self) -> None:
        """Raise ``ValueError`` naming the field and what to change."""

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> "MethodConfig":
        """The preset ``name`` with ``overrides`` applied, validated."""
        if not isinstance(name, str) or name not in cls.PRESETS:
            raise ValueError(f"unknown {cls.__name__} preset {name!r}; choose one of {sorted(cls.PRESETS)}")
        return cls.from_dict({**cls.PRESETS[name], **overrides})

    @classmethod
    def preset_names(cls) -> List[str]:
        """The names :meth:`preset` accepts, sorted."""
        return sorted(cls.PRESETS)

    def to_dict(self) -> Dict[str, Any]:
        """Every field as a plain dict (what configs and checkpoints store); ``from_dict(c.to_dict()) == c``."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "MethodConfig":
        """A config from a dict of fields (a ``"preset"`` key starts from that preset); an instance as is."""
        if isinstance(data, cls):
            return data
        if not isinstance(data, Mapping):
            raise ValueError(f"{cls.__name__}: parameters must be given as a dict or {cls.__name__}, got "
                             f"{type(data).__name__}")
        data = dict(data)
        if "preset" in data:
            return cls.preset(data.pop("preset"), **data)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown {cls.__name__} field(s) {unknown}; allowed: {sorted(known)} and 'preset'")
        return cls(**data)

    @classmethod
    def coerce(cls, value: Any, default: Any = None) -> "MethodConfig":
        """A config from what a user passes: ``None`` (``default``), an instance, a preset name, or a dict of
        overrides of ``default``."""
        base = default if isinstance(default, cls) else (cls.preset(default) if default is not None else cls())
        if value is None:
            return base
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            return cls.preset(value)
        if isinstance(value, Mapping):
            data = dict(value)
            return cls.from_dict(data) if "preset" in data else cls.from_dict({**base.to_dict(), **data})
        raise ValueError(f"{cls.__name__}: parameters must be a {cls.__name__}, a dict, a preset name or None, got "
                         f"{type(value).__name__}")

    def replace(self, **changes: Any) -> "MethodConfig":
        """A copy with ``changes`` applied (validated like a new config)."""
        return dataclasses.replace(self, **changes)

    @property
    def is_zero(self) -> bool:
        """True when the fields equal ``ZERO``: the method then computes the stock attention."""
        return bool(self.ZERO) and all(getattr(self, k) == v for k, v in self.ZERO.items())


_KINDS = {"float": float, "int": int, "bool": bool, "str": str}
_DOC_KEYS = ("description", "source")


def _load_registry() -> dict[str, dict[str, dict[str, Any]]]:
    """``{method: {preset: {field: value}}}`` from ``registry/presets.toml``."""
    import tomllib
    from importlib import resources

    text = resources.files("pid_plugins.registry").joinpath("presets.toml").read_text(encoding="utf-8")
    registry: dict[str, dict[str, dict[str, Any]]] = {}
    for method, presets in tomllib.loads(text).items():
        for name, table in presets.items():
            if not isinstance(table, dict) or not table.get("source"):
                raise ValueError(f"registry/presets.toml: [{method}.{name}] must be a table with a source")
            registry.setdefault(method, {})[name] = {k: v for k, v in table.items() if k not in _DOC_KEYS}
    return registry


_REGISTRY = _load_registry()


def registry_presets(method: str) -> Mapping[str, Mapping[str, Any]]:
    """A built-in method's presets, ``{preset: {field: value}}``, read once at import."""
    if method not in _REGISTRY:
        raise ValueError(f"registry/presets.toml declares no presets for {method!r}; it has {sorted(_REGISTRY)}")
    return _REGISTRY[method]
