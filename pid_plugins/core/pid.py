"""PID attention (PIDformer, ICML 2024, eq. 25) as the attention method ``"pid"``: its parameters
(:class:`PIDConfig`, presets from ``registry/presets.toml``), update (:func:`pid_update`), learnable per-layer gains
(:class:`PIDGains`) and registration. For layer ``l`` of a group, with ``A^l v^l`` its attention output and ``v^l``
its values (per head, query positions only)::

    e^l = beta * v^1 - v^l            S^l = S^{l-1} + e^l            (S^0 = 0)
    u^l = A^l v^l + lambda_p * e^l + lambda_i * S^l + lambda_d * (e^l - e^{l-1})

The D term is zero at the first layer. Every term is per position, so a KV cache needs only the new positions'
values; the state (:class:`PIDState`) is passed in and returned, never stored on a module."""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any, Mapping, NamedTuple, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .config import MethodConfig, registry_presets
from .heads import _WIDER, _grouped_shapes, _kv_head_split, _state_dtype
from .methods import AttentionMethod, register_method

__all__ = ["PIDConfig", "PRESETS", "PIDState", "pid_update", "GainsLike", "PIDGains", "layer_gains", "scaled_gains",
           "PIDMethod"]

_GAIN_FIELDS = ("lambda_p", "lambda_i", "lambda_d")


# ------------------------------------------------------------------------------------------------- parameters
@dataclass(frozen=True)
class PIDConfig(MethodConfig):
    """Gains of the PID attention update (PIDformer, eq. 25); the defaults are the ``deit`` preset.

    Args:
        lambda_p: proportional gain, >= 0.
        lambda_i: integral gain, >= 0.
        lambda_d: derivative gain, >= 0 (zero D term at the group's first layer).
        beta: weight of the reference signal ``v^1``, in (0, 1].
        learnable: every layer gets its own trainable gains (softplus-positive, :class:`PIDGains`), initialised
            from these; off by default, so a softmax checkpoint loads unchanged.
        control_first_layer: True (the paper): the first layer gets the term with ``e^1 = (beta - 1) v^1``.
            False (the NeuTRENO code): the first layer only records ``v^1`` and the sums start at the second.
        warmup_steps: ``N > 0`` scales the PID term by ``min(1, t / N)``, ``t`` the model's training forwards
            (:class:`~pid_plugins.core.warmup.GainWarmup`); 0: off."""

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
        """The paper's gains for ``name`` (``deit``, ``segmenter``, ``lm``), optionally with overrides; the
        presets are loaded once at import, so a lookup reads no file."""
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


# ------------------------------------------------------------------------------------------------- the update
Gain = Union[float, Tensor]
GainsLike = Union[PIDConfig, Sequence[Gain]]


class PIDState(NamedTuple):
    """What one PID layer hands to the next within one forward pass.

    Tensors shaped like the query positions' values in key/value-head space, ``(B, H_kv, q, D)``, in at least
    float32; ``None`` after a reference-only first layer. A tuple, so it splats into checkpointed calls. Between the
    layers of a model with grouped-query attention (:meth:`PIDMethod.update`) the tensors have a size-1 dimension
    after the heads, ``(B, H_kv, 1, q, D)``; :func:`pid_update` takes either."""

    v_first: Tensor  #: beta v^1, the reference: the values of the group's first layer times beta
    e_sum: Optional[Tensor]  #: S^l = e^1 + ... + e^l (from e^2 with a reference-only first layer)
    e_prev: Optional[Tensor]  #: e^l, the error of the layer that produced this state


def _unpack_gains(gains: GainsLike) -> tuple[Gain, Gain, Gain, Gain, bool]:
    if isinstance(gains, PIDConfig):
        return (*gains.gains, gains.control_first_layer)
    values = tuple(gains)
    if len(values) == 4:
        return (*values, True)  # type: ignore[return-value]
    if len(values) == 5:
        return values  # type: ignore[return-value]
    raise ValueError(
        "gains must be a PIDConfig or (lambda_p, lambda_i, lambda_d, beta[, control_first_layer]), "
        f"got {len(values)} values"
    )


def pid_update(
    attn_out: Tensor,
    value: Tensor,
    state: Optional[PIDState],
    gains: GainsLike,
    *,
    head_dim: int = -3,
    scale: Optional[Tensor] = None,
) -> tuple[Tensor, PIDState]:
    """Apply the PID correction to one layer's attention output, in the folded form::

        e = beta v^1 - v        S = S_prev + e        u = A v + (lP + lD) e + lI S - lD e_prev

    Args:
        attn_out: ``A^l v^l`` per head, ``(..., H, q, D)``.
        value: this layer's values ``v^l`` for the same positions, ``(..., H_kv, q, D)``, ``H_kv`` dividing ``H``.
        state: the previous layer's state, or ``None`` at the first layer.
        gains: a :class:`PIDConfig` or ``(lambda_p, lambda_i, lambda_d, beta[, control_first_layer])`` (floats or
            tensors).
        head_dim: which dimension holds the heads.
        scale: the warm-up factor (a 0-dim tensor) multiplying the PID term, or None; ``scale = 1`` gives the
            unscaled result bit for bit.

    Returns:
        ``(u, new_state)``: the output (shape and dtype of ``attn_out``; float16/bfloat16 computed in float32 and
        rounded once) and the state for the next layer."""
    if type(gains) is PIDConfig:  # the common case, fixed gains: no unpacking, no tensor checks
        if scale is None and not torch.jit.is_tracing():
            return _fixed_update(attn_out, value, state, _folded(gains), head_dim)
        lambda_p, lambda_i, lambda_d, beta = gains.lambda_p, gains.lambda_i, gains.lambda_d, gains.beta
        control_first_layer, tensor_gains = gains.control_first_layer, False
    else:
        lambda_p, lambda_i, lambda_d, beta, control_first_layer = _unpack_gains(gains)
        tensor_gains = isinstance(lambda_p, Tensor) or isinstance(lambda_i, Tensor) or isinstance(lambda_d, Tensor)
    if scale is not None and tensor_gains:
        lambda_p, lambda_i, lambda_d, scale = lambda_p * scale, lambda_i * scale, lambda_d * scale, None
    shape = value.shape
    traced = torch.jit.is_tracing()  # TorchScript tracing (torch.onnx's exporter): sizes are traced values
    if state is not None and not traced and state[0].shape != shape and attn_out.shape != shape and \
            state[0].shape == _grouped_shapes(attn_out.shape, shape, head_dim)[2]:  # a model's grouped layout
        state = PIDState(*(None if t is None else t.reshape(shape) for t in state))
    if state is not None and not traced and state[0].shape != shape:
        raise ValueError(
            f"PID layer values have shape {tuple(shape)} but the group's first layer had "
            f"{tuple(state[0].shape)}: every layer of a PID group must have values of one shape "
            "(same heads, head_dim and positions); split the model into groups of equal value shape "
            "or use softmax attention for the odd layers"
        )
    # grouped-query attention: the shape of the attention output viewed as (..., H_kv, r, ...), else None
    if traced:  # no Python branch on traced sizes: the grouped view, exact for r = 1 too (a size-1 dimension)
        dim = head_dim % attn_out.dim()
        grouped: Optional[tuple[tuple[int, ...], int, tuple[int, ...]]] = (
            (*attn_out.shape[:dim], shape[dim], -1, *attn_out.shape[dim + 1:]), dim + 1,
            (*shape[:dim + 1], 1, *shape[dim + 1:]))
    else:
        grouped = None if attn_out.shape == shape else _kv_head_split(attn_out, value, head_dim)

    # The reference beta v^1, formed once at the group's first layer and handed on in the state, in float32 at
    # least (float16/bfloat16 values are upcast: the error and its sum are accumulated in float32 over depth).
    wide = _state_dtype(value.dtype)
    if state is None:
        v_ref = value if wide == value.dtype else value.to(wide)
        v_ref = v_ref if _is_one(beta) else v_ref * beta
        if not control_first_layer:
            # Reference-only first layer: plain attention, the reference recorded, no error yet. Learnable gains
            # join the graph with a zero weight, so DDP sees every parameter used.
            if tensor_gains:
                attn_out = attn_out + 0.0 * (lambda_p + lambda_i + lambda_d)
            return attn_out, PIDState(v_ref, None, None)
    else:
        v_ref = state[0]
    e = v_ref - value  # (the group's first controlled layer: the first, or the second after a reference-only one)
    first = state is None or state[1] is None
    e_sum = e if first else state[1] + e
    new_state = PIDState(v_ref, e_sum, e)
    # u = A v + (lP + lD) e + lI S - lD e_prev; at the first controlled layer S = e and e_prev = 0, so
    # u = A v + (lP + lI) e (a learnable lambda_d joins the graph there with zero gradient, so DDP sees it used).
    terms: list[tuple[Tensor, Gain]]
    if first:
        terms = [(e, lambda_p + lambda_i + 0.0 * lambda_d if isinstance(lambda_d, Tensor) else lambda_p + lambda_i)]
    else:
        terms = [(e, lambda_p + lambda_d), (e_sum, lambda_i), (state[2], -lambda_d)]
    terms = [(x, g) for x, g in terms if isinstance(g, Tensor) or g != 0.0]  # a zero fixed gain launches nothing
    if not terms:  # all fixed gains zero (here): the attention output itself, the stock model bit for bit
        if scale is not None:  # the warm-up's scale joins the graph with the term (a compiled graph keeps one form)
            return attn_out + 0.0 * scale.to(attn_out.dtype), new_state
        return attn_out, new_state

    # Accumulated into one fresh tensor with in-place adds (autograd keeps no input of an add). Grouped-query
    # attention: key/value head j serves query heads j*r .. j*r + r - 1 (as :func:`expand_heads`, i.e.
    # ``repeat_interleave``): each key/value-head tensor is broadcast over its group of r query heads of a view of
    # the attention output, instead of materialising the repeated values.
    out, kv_shape = (attn_out, None) if grouped is None else (attn_out.reshape(grouped[0]), grouped[2])
    fresh = True
    for x, gain in terms:
        if scale is not None:  # warm-up with fixed gains: each error tensor scaled as it is added (exact at 1)
            x = x * scale.to(x.dtype)
        tensor_gain = isinstance(gain, Tensor)
        if tensor_gain:  # learnable gains (any shape that broadcasts in key/value-head space)
            x = x * gain
        if kv_shape is not None:  # (..., H_kv, 1, q, D): inserting a size-1 dimension is always a view
            x = x.reshape(kv_shape)
        if fresh:  # the fresh output (float32 for float16/bfloat16 attention outputs: type promotion)
            out, fresh = (out + x if tensor_gain else torch.add(out, x, alpha=gain)), False
        else:
            out = out.add_(x) if tensor_gain else out.add_(x, alpha=gain)
    if out.dtype != attn_out.dtype:
        out = out.to(attn_out.dtype)  # float16/bfloat16: rounded once
    return (out if grouped is None else out.reshape(attn_out.shape)), new_state


class _Folded(NamedTuple):
    """A fixed-gain config's numbers as the update adds them (folded once per config, not per call)."""

    first: float  #: lambda_p + lambda_i: the first controlled layer's weight of e (S = e, no D term)
    e: float  #: lambda_p + lambda_d
    e_sum: float  #: lambda_i
    e_prev: float  #: -lambda_d
    beta: float
    beta_is_one: bool
    control_first_layer: bool


def _folded(config: PIDConfig) -> _Folded:
    """The config's folded numbers, kept on the (frozen) config after the first call (not part of its fields)."""
    folded = config.__dict__.get("_folded")
    if folded is None:
        lp, li, ld = config.lambda_p, config.lambda_i, config.lambda_d
        folded = _Folded(lp + li, lp + ld, li, -ld, config.beta, config.beta == 1.0, config.control_first_layer)
        if not torch.compiler.is_compiling():
            object.__setattr__(config, "_folded", folded)
    return folded


def _fixed_update(attn_out: Tensor, value: Tensor, state: Optional[PIDState], g: _Folded,
                  head_dim: int, grouped_state: bool = False) -> tuple[Tensor, PIDState]:
    """:func:`pid_update` with fixed float gains and no scale: the same operations in the same order, gains
    folded once per config. Under grouped-query attention the state is computed in the grouped layout ``(..., H_kv,
    1, q, D)`` (heads at ``head_dim``), which broadcasts over the output viewed as ``(..., H_kv, r, q, D)``: one view
    of the values per layer instead of one per term. ``grouped_state``: hand the state on in that layout (the
    method's own state between layers, :meth:`PIDMethod.update`), else in key/value-head space."""
    out_shape, kv_shape = attn_out.shape, value.shape
    grouped = None if out_shape == kv_shape else _grouped_shapes(out_shape, kv_shape, head_dim)
    if grouped is not None:
        value = value.reshape(grouped[2])  # (inserting a size-1 dimension: a view)
    if state is None:
        wide = _WIDER.get(value.dtype) or _state_dtype(value.dtype)
        v_ref = value if wide == value.dtype else value.to(wide)
        if not g.beta_is_one:
            v_ref = v_ref * g.beta
        if not g.control_first_layer:  # a reference-only first layer
            new_state, terms = PIDState(v_ref, None, None), ()
        else:
            e = v_ref - value
            new_state = PIDState(v_ref, e, e)  # the group's first controlled layer: S = e, no D term
            terms = ((e, g.first),)
    else:
        v_ref = state[0]
        if v_ref.shape != value.shape:
            if grouped is None or v_ref.shape != kv_shape:
                pid_update(attn_out, value.reshape(kv_shape), state, (0.0, 0.0, 0.0, 1.0))  # the explanatory error
            # a state in key/value-head space (from pid_update, or handed over between pipeline stages)
            state = tuple(None if t is None else t.reshape(value.shape) for t in state)
            v_ref = state[0]
        e = v_ref - value
        e_prev = state[2]
        if e_prev is None:  # the group's first controlled layer after a reference-only one
            new_state = PIDState(v_ref, e, e)
            terms = ((e, g.first),)
        else:
            e_sum = state[1] + e
            new_state = PIDState(v_ref, e_sum, e)
            terms = ((e, g.e), (e_sum, g.e_sum), (e_prev, g.e_prev))
    out = None
    target = attn_out if grouped is None or not terms else attn_out.reshape(grouped[0])
    for x, gain in terms:
        if gain != 0.0:  # a zero fixed gain launches nothing
            out = torch.add(target, x, alpha=gain) if out is None else out.add_(x, alpha=gain)
    if grouped is not None and not grouped_state:
        new_state = PIDState(*(None if t is None else t.reshape(kv_shape) for t in new_state))
    if out is None:  # all gains zero: the attention output itself, the stock model bit for bit
        return attn_out, new_state
    if out.dtype != attn_out.dtype:
        out = out.to(attn_out.dtype)  # float16/bfloat16: rounded once
    return (out if grouped is None else out.reshape(out_shape)), new_state


def _is_one(x: Gain) -> bool:
    """A fixed (Python) 1: multiplying by it is skipped (``beta = 1``, NeuTRENO's and the segmenter preset's)."""
    return not isinstance(x, Tensor) and x == 1.0


# ------------------------------------------------------------------------------------------------- learnable gains
_GAINS = _GAIN_FIELDS
#: a learnable gain initialised at 0 starts here instead (softplus never reaches 0 exactly)
MIN_INITIAL_GAIN = 1e-4


def _inverse_softplus(gain: float) -> float:
    """``raw`` with ``softplus(raw) == gain`` (gain > 0)."""
    return gain + math.log(-math.expm1(-gain))


class PIDGains(nn.Module):
    """Trainable ``lambda_p, lambda_i, lambda_d`` of one layer, initialised from a :class:`PIDConfig`.

    Each gain is ``softplus(raw)`` of a parameter ``lambda_*_raw`` of shape ``(1,)``, so it stays positive (stability,
    PIDformer Prop. 2); a gain initialised at 0 starts at :data:`MIN_INITIAL_GAIN`. Exclude them from weight decay.
    State dicts with the gains themselves or 0-dim raw values are converted on load."""

    def __init__(self, config: PIDConfig) -> None:
        super().__init__()
        self.beta = config.beta
        self.control_first_layer = config.control_first_layer
        for name in _GAINS:
            raw = _inverse_softplus(max(getattr(config, name), MIN_INITIAL_GAIN))
            setattr(self, f"{name}_raw", nn.Parameter(torch.tensor([raw])))

    def forward(self) -> tuple[Tensor, Tensor, Tensor, float, bool]:
        """``(lambda_p, lambda_i, lambda_d, beta, control_first_layer)`` as :func:`pid_update` takes them."""
        lp, li, ld = (F.softplus(getattr(self, f"{name}_raw")) for name in _GAINS)
        return (lp, li, ld, self.beta, self.control_first_layer)

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any, **kwargs: Any) -> None:
        for name in _GAINS:
            old = state_dict.get(prefix + name)
            if old is not None and prefix + f"{name}_raw" not in state_dict:
                gain = float(old)
                if not gain > 0:
                    raise ValueError(
                        f"{prefix}{name} = {gain} in this checkpoint: learned PID gains must be positive "
                        "(this checkpoint predates the positive parametrisation; a gain <= 0 has no equivalent in it)"
                    )
                state_dict[prefix + f"{name}_raw"] = torch.tensor([_inverse_softplus(gain)], dtype=old.dtype)
                del state_dict[prefix + name]
            raw = state_dict.get(prefix + f"{name}_raw")
            if isinstance(raw, torch.Tensor) and raw.dim() == 0:  # written when the raw gains were 0-dim
                state_dict[prefix + f"{name}_raw"] = raw.reshape(1)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def extra_repr(self) -> str:
        return f"beta={self.beta}, control_first_layer={self.control_first_layer}"


def layer_gains(config: PIDConfig, learned: "PIDGains | None"):
    """The gains to pass to :func:`pid_update`: the learned ones if the layer has them, else the config."""
    return learned() if learned is not None else config


def scaled_gains(gains: Any, scale: Optional[Tensor]) -> Any:
    """``gains`` with the three gains multiplied by ``scale``; ``gains`` itself when ``scale`` is None."""
    if scale is None:
        return gains
    if isinstance(gains, PIDConfig):
        lp, li, ld, beta, first = (*gains.gains, gains.control_first_layer)
    else:
        values = tuple(gains)
        lp, li, ld, beta = values[:4]
        first = values[4] if len(values) > 4 else True
    return (lp * scale, li * scale, ld * scale, beta, first)


# ------------------------------------------------------------------------------------------------- the method
class PIDMethod(AttentionMethod):
    """PID attention: :func:`pid_update` with :class:`PIDConfig` gains, optionally learned per layer and warmed up."""

    name = "pid"
    config_type = PIDConfig
    state_fields = PIDState._fields
    default_presets = {"timm": "deit", "mmseg": "segmenter", "hf": "lm", "fairseq": "lm", "*": "deit"}
    per_head_state = True  # v^1, S^l, e^l: (B, H_kv, q, D); the gains (fixed or learned) are shared by every head

    def make_learned(self, config: PIDConfig) -> Optional[nn.Module]:
        return PIDGains(config) if config.learnable else None

    def layer_params(self, config: PIDConfig, learned: Optional[nn.Module], layer: Optional[int] = None) -> Any:
        """The config, or the layer's learned gains with the config's ``beta`` and first-layer rule."""
        if learned is None:
            return config
        lambda_p, lambda_i, lambda_d = learned()[:3]
        return (lambda_p, lambda_i, lambda_d, config.beta, config.control_first_layer)

    def make_state(self, *tensors: Optional[Tensor]) -> PIDState:
        return PIDState(*tensors)

    def update(self, params: Any, out: Tensor, value_q: Tensor, state: Optional[tuple], scale: Optional[Tensor],
               head_dim: int) -> Tuple[Tensor, PIDState]:
        if scale is None and type(params) is PIDConfig and not torch.jit.is_tracing():  # fixed gains: the hot path
            return _fixed_update(out, value_q, state, _folded(params), head_dim, True)
        return pid_update(out, value_q, state, params, head_dim=head_dim, scale=scale)


register_method(PIDMethod())
