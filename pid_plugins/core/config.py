"""Method parameters: :class:`MethodConfig` (presets, validation and the dict round trip every attention method's
parameters share) and :class:`PIDConfig`, the four numbers of the PIDformer controller with the paper's presets.

A PIDConfig is a value: frozen, hashable, and round-trips through a plain dict (configs and checkpoints
store it as a dict). The presets are declared once, in the registry (``registry/presets.toml``).
"""
from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass
from typing import Any, ClassVar, Dict, List, Mapping

__all__ = ["MethodConfig", "PIDConfig", "PRESETS", "fx_constant", "registry_presets"]

_GAIN_FIELDS = ("lambda_p", "lambda_i", "lambda_d")


def fx_constant(value: Any, tracer: Any) -> Any:
    """torch.fx's ``__fx_create_arg__`` protocol for a constant that is neither a tensor nor a plain value (a method,
    its frozen config): stored once per trace as an attribute of the traced root, read by a ``get_attr`` node (as fx
    stores constant tensors), so leaf functions such as the method's update step can take it as an argument."""
    stored = tracer.__dict__.setdefault("_pid_plugins_constants", {})
    name = stored.get(id(value))
    if name is None:
        name = tracer.get_fresh_qualname("_pid_plugins_constant")
        setattr(tracer.root, name, value)
        stored[id(value)] = name
    return tracer.create_node("get_attr", name, (), {})


@dataclass(frozen=True)
class MethodConfig:
    """Base for a method's parameters: subclass it as a frozen dataclass of float/int/bool/str fields and list presets.

    ``PRESETS``: ``{name: {field: value}}``. ``validate()`` (override) raises ``ValueError`` for bad values.
    ``ZERO``: the field values (a dict) with which the method computes the stock attention (``is_zero``).
    """

    PRESETS: ClassVar[Mapping[str, Mapping[str, Any]]] = {}
    ZERO: ClassVar[Mapping[str, Any]] = {}

    def __fx_create_arg__(self, tracer: Any) -> Any:  # a constant of a torch.fx graph (see fx_constant)
        return fx_constant(self, tracer)

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            kind = f.type if isinstance(f.type, type) else {"float": float, "int": int, "bool": bool, "str": str}.get(str(f.type))
            if kind is float and isinstance(value, int) and not isinstance(value, bool):
                object.__setattr__(self, f.name, float(value))
            elif kind is not None and (not isinstance(value, kind) or (kind is not bool and isinstance(value, bool))):
                raise ValueError(f"{type(self).__name__}.{f.name} must be {kind.__name__}, got {value!r}")
        self.validate()

    def validate(self) -> None:
        """Raise ``ValueError`` naming the field and what to change."""

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> "MethodConfig":
        """The preset ``name`` (a key of ``PRESETS``) with ``overrides`` applied, validated; ``ValueError`` names
        the presets there are."""
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
        """A config from a dict of fields (an instance is returned as is). A ``"preset"`` key starts from that
        preset and the other keys override it; unknown keys raise ``ValueError`` listing the allowed ones."""
        if isinstance(data, cls):
            return data
        if not isinstance(data, Mapping):
            raise ValueError(f"{cls.__name__}: parameters must be given as a dict or {cls.__name__}, got {type(data).__name__}")
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
        """A config from what a user passes: ``None`` (``default``: a config, a preset name, or the field defaults),
        an instance, a preset name, or a dict of overrides of ``default`` (a dict with ``"preset"`` starts from that
        preset instead). Anything else raises ``ValueError``."""
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
        raise ValueError(
            f"{cls.__name__}: parameters must be a {cls.__name__}, a dict, a preset name or None, got {type(value).__name__}"
        )

    def replace(self, **changes: Any) -> "MethodConfig":
        """A copy with ``changes`` applied (validated like a new config)."""
        return dataclasses.replace(self, **changes)

    @property
    def is_zero(self) -> bool:
        """True when the fields equal ``ZERO``: the method then computes the stock attention."""
        return bool(self.ZERO) and all(getattr(self, k) == v for k, v in self.ZERO.items())



@dataclass(frozen=True)
class PIDConfig(MethodConfig):
    """Gains of the PID attention update (PIDformer, eq. 25).

    For layer l of a PID group, with values v^l and the attention output A^l v^l::

        e^l = beta * v^1 - v^l
        u^l = A^l v^l + lambda_p * e^l + lambda_i * sum_{k<=l} e^k + lambda_d * (e^l - e^{l-1})

    (with ``control_first_layer=False`` the sums start at the second layer, see below).

    Args:
        lambda_p: proportional gain, >= 0.
        lambda_i: integral gain, >= 0.
        lambda_d: derivative gain, >= 0 (the D term is zero at the group's first layer).
        beta: weight of the reference signal ``v^1``, in (0, 1].
        learnable: if True, every PID layer gets its own trainable gains initialised from these values
            (adds three parameters per layer). Off by default: fixed gains add no parameters, so a
            softmax checkpoint loads unchanged. Learned gains stay non-negative by construction
            (softplus of a raw parameter, see :class:`~pid_plugins.core.gains.PIDGains`).
        control_first_layer: what the group's first layer does. True (the paper's eq. 25 read with sums
            from m = 1, the default): the first layer gets the term with ``e^1 = (beta - 1) v^1``. False
            (the convention of the group's public NeuTRENO code): the first layer computes plain attention
            and only records the reference ``v^1``; from the second layer on ``e^l = beta v^1 - v^l``,
            ``S^l = e^2 + ... + e^l`` and the D term is zero at the second layer.
        warmup_steps: gain warm-up for fine-tuning a pretrained model into PID (0, the default: off). With
            ``N > 0`` the PID term is scaled by ``min(1, t / N)``, where ``t`` counts the model's
            training-mode forward passes (a buffer in the model's state_dict, see
            :class:`~pid_plugins.core.warmup.GainWarmup`): at ``t = 0`` the model computes the stock model,
            at ``t = k`` the model with every gain scaled by ``k / N``.

    The defaults are the paper's ``deit`` preset.
    """

    lambda_p: float = 0.8
    lambda_i: float = 0.5
    lambda_d: float = 0.05
    beta: float = 0.1
    learnable: bool = False
    control_first_layer: bool = True
    warmup_steps: int = 0

    def __post_init__(self) -> None:
        for name in (*_GAIN_FIELDS, "beta"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(
                    f"PIDConfig.{name} must be a real number, got {value!r} ({type(value).__name__})"
                )
            if not math.isfinite(value):
                raise ValueError(f"PIDConfig.{name} must be finite, got {value!r}")
            object.__setattr__(self, name, float(value))
        for name in _GAIN_FIELDS:
            if getattr(self, name) < 0:
                raise ValueError(
                    f"PIDConfig.{name} must be >= 0 (a gain), got {getattr(self, name)!r}; "
                    "the paper's study uses lambda_p in [0.2, 0.8], lambda_i in [0.3, 0.9], "
                    "lambda_d in [0.05, 0.6]"
                )
        if not 0.0 < self.beta <= 1.0:
            raise ValueError(
                f"PIDConfig.beta must be in (0, 1] (beta = 0 drops the reference signal), got {self.beta!r}"
            )
        for name in ("learnable", "control_first_layer"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"PIDConfig.{name} must be True or False, got {getattr(self, name)!r}")
        steps = self.warmup_steps
        if isinstance(steps, bool) or not isinstance(steps, numbers.Integral) or steps < 0:
            raise ValueError(
                f"PIDConfig.warmup_steps must be a whole number of training forward passes >= 0 (0: no warm-up), "
                f"got {steps!r} ({type(steps).__name__})"
            )
        object.__setattr__(self, "warmup_steps", int(steps))

    # ----------------------------------------------------------------------------------------- presets
    @classmethod
    def preset(cls, name: str, **overrides: Any) -> "PIDConfig":
        """The paper's gains for ``name`` (``deit``, ``segmenter``, ``lm``), optionally with overrides.

        The presets are plain data loaded once, when this module is imported, so looking one up reads no file
        (``torch.compile`` traces it inside a forward without a graph break).
        """
        config = _PRESET_CONFIGS.get(name) if isinstance(name, str) else None
        if config is None:
            raise ValueError(
                f"unknown PID preset {name!r}; choose one of {sorted(_PRESET_CONFIGS)} "
                "(declared in registry/presets.toml)"
            )
        return cls.from_dict({**PRESETS[name], **overrides}) if overrides else config

    @classmethod
    def preset_names(cls) -> list[str]:
        """The names :meth:`preset` accepts (``registry/presets.toml``), sorted."""
        return sorted(_PRESET_CONFIGS)

    @property
    def is_zero(self) -> bool:
        """True when all gains are zero and fixed: the update is the identity (stock softmax attention)."""
        return not self.learnable and self.lambda_p == 0.0 and self.lambda_i == 0.0 and self.lambda_d == 0.0

    @property
    def gains(self) -> tuple[float, float, float, float]:
        """``(lambda_p, lambda_i, lambda_d, beta)``."""
        return (self.lambda_p, self.lambda_i, self.lambda_d, self.beta)


# ------------------------------------------------------------------------------------------------- presets
_DOC_KEYS = ("description", "source")


def _load_registry() -> dict[str, dict[str, dict[str, Any]]]:
    """``{method: {preset: {field: value}}}`` from ``registry/presets.toml``, the one source of every built-in
    method's presets (``description`` and ``source`` are documentation, left out)."""
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
    """A built-in method's presets from ``registry/presets.toml``: ``{preset: {field: value}}`` (read once, at
    import: looking one up reads no file, so ``torch.compile`` traces it without a graph break)."""
    if method not in _REGISTRY:
        raise ValueError(f"registry/presets.toml declares no presets for {method!r}; it has {sorted(_REGISTRY)}")
    return _REGISTRY[method]


def _pid_presets() -> dict[str, dict[str, float]]:
    presets = {}
    for name, gains in registry_presets("pid").items():
        missing = set(_PRESET_KEYS) - set(gains)
        if missing:
            raise ValueError(f"registry/presets.toml: preset [pid.{name}] lacks {sorted(missing)}")
        presets[name] = {k: gains[k] for k in _PRESET_KEYS}
    return presets


_PRESET_KEYS = ("lambda_p", "lambda_i", "lambda_d", "beta")
#: PID's presets as plain data: ``{name: {lambda_p, lambda_i, lambda_d, beta}}``
PRESETS: Mapping[str, Mapping[str, float]] = _pid_presets()
PIDConfig.PRESETS = PRESETS
_PRESET_CONFIGS: dict[str, PIDConfig] = {name: PIDConfig(**gains) for name, gains in PRESETS.items()}  # validates
