"""PID attention (PIDformer, ICML 2024, eq. 25) as the attention method ``"pid"``: its parameters
(:class:`PIDConfig`, presets from ``registry/presets.toml``), update (:func:`pid_update`), learnable per-layer gains
(:class:`PIDGains`) and registration. For layer ``l`` of a group, with ``A^l v^l`` its attention output and ``v^l``
its values (per head, query positions only)::

    e^l = beta * v^1 - v^l            S^l = S^{l-1} + e^l            (S^0 = 0)
    u^l = A^l v^l + lambda_p * e^l + lambda_i * S^l + lambda_d * (e^l - e^{l-1})

The D term is zero at the first layer. Every term is per position, so a KV cache needs only the new positions'
values; the state (:class:`PIDState`) is passed in and returned, never stored on a module."""
from __future__ import annotations

import functools
import math
import numbers
from dataclasses import dataclass
from typing import Any, Callable, Mapping, NamedTuple, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .config import MethodConfig, registry_presets
from .heads import _WIDER, _grouped_shapes, _state_dtype
from .methods import AttentionMethod, register_method

__all__ = ["PIDConfig", "PRESETS", "PIDState", "pid_update", "GainsLike", "PIDGains", "layer_gains", "scaled_gains",
           "PIDMethod", "Folded", "fold"]

_GAIN_FIELDS = ("lambda_p", "lambda_i", "lambda_d")


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
                raise ValueError(f"PIDConfig.{name} must be a real number, got {value!r} ({type(value).__name__})")
            if not math.isfinite(value):
                raise ValueError(f"PIDConfig.{name} must be finite, got {value!r}")
            object.__setattr__(self, name, float(value))
            if name != "beta" and value < 0:
                raise ValueError(f"PIDConfig.{name} must be >= 0 (a gain), got {float(value)!r}; the paper's study "
                                 "uses lambda_p in [0.2, 0.8], lambda_i in [0.3, 0.9], lambda_d in [0.05, 0.6]")
        if not 0.0 < self.beta <= 1.0:
            raise ValueError(f"PIDConfig.beta must be in (0, 1] (beta = 0 drops the reference signal), got "
                             f"{self.beta!r}")
        for name in ("learnable", "control_first_layer"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"PIDConfig.{name} must be True or False, got {getattr(self, name)!r}")
        steps = self.warmup_steps
        if isinstance(steps, bool) or not isinstance(steps, numbers.Integral) or steps < 0:
            raise ValueError(f"PIDConfig.warmup_steps must be a whole number of training forward passes >= 0 (0: no "
                             f"warm-up), got {steps!r} ({type(steps).__name__})")
        object.__setattr__(self, "warmup_steps", int(steps))

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> "PIDConfig":
        """The paper's gains for ``name`` (``deit``, ``segmenter``, ``lm``), optionally with overrides."""
        config = _PRESET_CONFIGS.get(name) if isinstance(name, str) else None
        if config is None:
            raise ValueError(f"unknown PID preset {name!r}; choose one of {sorted(_PRESET_CONFIGS)} "
                             "(declared in registry/presets.toml)")
        return cls.from_dict({**PRESETS[name], **overrides}) if overrides else config

    @property
    def is_zero(self) -> bool:
        """True when all gains are zero and fixed: the update is the identity (stock softmax attention)."""
        return not self.learnable and self.lambda_p == 0.0 and self.lambda_i == 0.0 and self.lambda_d == 0.0

    @property
    def gains(self) -> tuple[float, float, float, float]:
        """``(lambda_p, lambda_i, lambda_d, beta)``."""
        return (self.lambda_p, self.lambda_i, self.lambda_d, self.beta)


PRESETS: Mapping[str, Mapping[str, float]] = {name: {k: gains[k] for k in (*_GAIN_FIELDS, "beta")}
                                             for name, gains in registry_presets("pid").items()}
"""PID's presets as plain data (``registry/presets.toml``): ``{name: {lambda_p, lambda_i, lambda_d, beta}}``."""
PIDConfig.PRESETS = PRESETS
_PRESET_CONFIGS: dict[str, PIDConfig] = {name: PIDConfig(**gains) for name, gains in PRESETS.items()}


Gain = Union[float, Tensor]
GainsLike = Union[PIDConfig, Sequence[Gain]]


class PIDState(NamedTuple):
    """What one PID layer hands to the next within one forward pass: tensors shaped like the query positions'
    values, ``(B, H_kv, q, D)`` (``(B, H_kv, 1, q, D)`` between the layers of a grouped-query model), in float32 at
    least; ``None`` after a reference-only first layer."""

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
        gains: a :class:`PIDConfig` or ``(lambda_p, lambda_i, lambda_d, beta[, control_first_layer])``.
        head_dim: which dimension holds the heads.
        scale: the warm-up factor (a 0-dim tensor) multiplying the PID term, or None.

    Returns:
        ``(u, new_state)``: the output (shape and dtype of ``attn_out``) and the next layer's state."""
    return _update(attn_out, value, state, fold(gains, scale), head_dim, False, scale)


class Folded(NamedTuple):
    """PID's gains as the update reads them (:func:`fold`); ``weights``: ``(lambda_p + lambda_i, lambda_p + lambda_d,
    lambda_i, -lambda_d)`` for fixed gains, None for learned ones."""

    lambda_p: Gain
    lambda_i: Gain
    lambda_d: Gain
    beta: Gain
    control_first_layer: bool
    weights: Optional[Tuple[float, float, float, float]] = None


def fold(gains: GainsLike, scale: Optional[Tensor] = None) -> Folded:
    """The gains :func:`pid_update` reads (cached on a :class:`PIDConfig`); tensor gains times the warm-up ``scale``."""
    if type(gains) is PIDConfig:
        folded = gains.__dict__.get("_folded")
        if folded is None:
            lp, li, ld = gains.lambda_p, gains.lambda_i, gains.lambda_d
            folded = Folded(lp, li, ld, gains.beta, gains.control_first_layer, (lp + li, lp + ld, li, -ld))
            if not torch.compiler.is_compiling():
                object.__setattr__(gains, "_folded", folded)
        return folded
    g = Folded(*_unpack_gains(gains))
    if scale is not None and _tensor_gains(g):  # (fixed gains scale each term as it is added)
        g = g._replace(lambda_p=g.lambda_p * scale, lambda_i=g.lambda_i * scale, lambda_d=g.lambda_d * scale)
    return g


def _tensor_gains(g: Folded) -> bool:
    return isinstance(g.lambda_p, Tensor) or isinstance(g.lambda_i, Tensor) or isinstance(g.lambda_d, Tensor)


def _update(attn_out: Tensor, value: Tensor, state: Optional[tuple], g: Folded, head_dim: int,
            grouped_state: bool, scale: Optional[Tensor]) -> tuple[Tensor, PIDState]:
    """The rule for every caller. Under grouped-query attention the values are viewed as ``(..., H_kv, 1, q, D)``,
    broadcasting over the output viewed as ``(..., H_kv, r, q, D)``; ``grouped_state`` hands the state on so."""
    out_shape, kv_shape = attn_out.shape, value.shape
    # TorchScript tracing (torch.onnx): sizes are traced values (dynamo before torch 2.15 does not fold _is_tracing)
    compiling = torch.compiler.is_compiling()
    traced = not compiling and torch._C._is_tracing()
    if traced:  # no Python branch on traced sizes: the grouped view, exact for r = 1 too (a size-1 dimension)
        dim = head_dim % attn_out.dim()
        grouped: Optional[tuple] = ((*out_shape[:dim], kv_shape[dim], -1, *out_shape[dim + 1:]), dim + 1,
                                    (*kv_shape[:dim + 1], 1, *kv_shape[dim + 1:]))
    else:
        grouped = None if out_shape == kv_shape else (
            _grouped_shapes.__wrapped__ if compiling else _grouped_shapes)(out_shape, kv_shape, head_dim)
    if grouped is not None:  # (inserting a size-1 dimension: a view)
        value = value.reshape(grouped[2]) if traced else value.unsqueeze(grouped[1])
    # the reference beta v^1, formed at the group's first layer, in float32 at least (the sums accumulate over depth)
    if state is None:
        wide = _WIDER.get(value.dtype) or _state_dtype(value.dtype)
        v_ref = value if wide == value.dtype else value.to(wide)
        if not _is_one(g.beta):
            v_ref = v_ref * g.beta
        if not g.control_first_layer:
            # reference-only first layer; learned gains join the graph with a zero weight (DDP sees them used)
            if _tensor_gains(g):
                attn_out = attn_out + 0.0 * (g.lambda_p + g.lambda_i + g.lambda_d)
            return attn_out, PIDState(v_ref if grouped is None or grouped_state else v_ref.reshape(kv_shape), None,
                                      None)
        e = v_ref - value
        new_state = PIDState(v_ref, e, e)  # the group's first controlled layer: S = e, no D term
        terms = ((e, _first_weight(g)),)
    else:
        v_ref = state[0]
        if traced or v_ref.shape != value.shape:
            if not traced and (grouped is None or v_ref.shape != kv_shape):
                raise ValueError(
                    f"PID layer values have shape {tuple(kv_shape)} but the group's first layer had "
                    f"{tuple(v_ref.shape)}: every layer of a PID group must have values of one shape "
                    "(same heads, head_dim and positions); split the model into groups of equal value shape "
                    "or use softmax attention for the odd layers"
                )
            # a state in key/value-head space (from pid_update, or handed over between pipeline stages)
            state = tuple(None if t is None else t.reshape(value.shape) for t in state)
            v_ref = state[0]
        e = v_ref - value
        e_prev = state[2]
        if e_prev is None:  # the group's first controlled layer after a reference-only one
            new_state = PIDState(v_ref, e, e)
            terms = ((e, _first_weight(g)),)
        else:
            e_sum = state[1] + e
            new_state = PIDState(v_ref, e_sum, e)
            w = g.weights
            terms = ((e, w[1]), (e_sum, w[2]), (e_prev, w[3])) if w is not None else \
                ((e, g.lambda_p + g.lambda_d), (e_sum, g.lambda_i), (e_prev, -g.lambda_d))
    if grouped is not None and not grouped_state:
        new_state = PIDState(*(None if t is None else t.reshape(kv_shape) for t in new_state))
    # u = A v + (lP + lD) e + lI S - lD e_prev: one fresh tensor, in-place adds (autograd keeps no input of an add)
    out = None
    if grouped is None or not terms:
        target = attn_out
    else:  # (the heads split into (H_kv, r): a view of the fresh or contiguous output)
        dim = grouped[1] - 1
        target = attn_out.reshape(grouped[0]) if traced else attn_out.view(grouped[0])  # (a split: always a view)
    for x, gain in terms:
        tensor_gain = isinstance(gain, Tensor)
        if not tensor_gain and gain == 0.0:  # a zero fixed gain launches nothing
            continue
        if scale is not None and not tensor_gain:  # warm-up with fixed gains: each term scaled as it is added
            x = x * scale.to(x.dtype)
        if tensor_gain:  # learned gains (any shape that broadcasts in key/value-head space)
            x = x * gain if grouped is None or gain.dim() < 2 else (x.reshape(kv_shape) * gain).reshape(grouped[2])
            out = target + x if out is None else out.add_(x)
        else:  # the fresh output (float32 for float16/bfloat16 attention outputs: type promotion)
            out = torch.add(target, x, alpha=gain) if out is None else out.add_(x, alpha=gain)
    if out is None:  # all fixed gains zero: the attention output itself, the stock model bit for bit
        if scale is not None:  # the warm-up's scale joins the graph with the term (a compiled graph keeps one form)
            return attn_out + 0.0 * scale.to(attn_out.dtype), new_state
        return attn_out, new_state
    if out.dtype != attn_out.dtype:
        out = out.to(attn_out.dtype)  # float16/bfloat16: rounded once
    return (out if grouped is None else out.reshape(out_shape) if traced else out.flatten(dim, dim + 1)), new_state


def _first_weight(g: Folded) -> Gain:
    """e's weight at the first controlled layer (S = e, no D term); a learned lambda_d joins with weight 0 (DDP)."""
    if g.weights is not None:
        return g.weights[0]
    if isinstance(g.lambda_d, Tensor):
        return g.lambda_p + g.lambda_i + 0.0 * g.lambda_d
    return g.lambda_p + g.lambda_i


def _is_one(x: Gain) -> bool:
    """A fixed (Python) 1: multiplying by it is skipped."""
    return not isinstance(x, Tensor) and x == 1.0


#: a learnable gain initialised at 0 starts here instead (softplus never reaches 0 exactly)
MIN_INITIAL_GAIN = 1e-4


def _inverse_softplus(gain: float) -> float:
    return gain + math.log(-math.expm1(-gain))


class PIDGains(nn.Module):
    """Trainable ``lambda_p, lambda_i, lambda_d`` of one layer, initialised from a :class:`PIDConfig`: each is
    ``softplus(lambda_*_raw)``, a ``(1,)`` parameter, so it stays positive (PIDformer Prop. 2; an initial 0 starts at
    :data:`MIN_INITIAL_GAIN`). Exclude them from weight decay."""

    def __init__(self, config: PIDConfig) -> None:
        super().__init__()
        self.beta = config.beta
        self.control_first_layer = config.control_first_layer
        for name in _GAIN_FIELDS:
            raw = _inverse_softplus(max(getattr(config, name), MIN_INITIAL_GAIN))
            setattr(self, f"{name}_raw", nn.Parameter(torch.tensor([raw])))

    def forward(self) -> tuple[Tensor, Tensor, Tensor, float, bool]:
        """``(lambda_p, lambda_i, lambda_d, beta, control_first_layer)`` as :func:`pid_update` takes them."""
        lp, li, ld = (F.softplus(getattr(self, f"{name}_raw")) for name in _GAIN_FIELDS)
        return (lp, li, ld, self.beta, self.control_first_layer)

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any, **kwargs: Any) -> None:
        for name in _GAIN_FIELDS:
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
    lp, li, ld, beta, first = _unpack_gains(gains)
    return (lp * scale, li * scale, ld * scale, beta, first)


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
        return config if learned is None else (*learned()[:3], config.beta, config.control_first_layer)

    def bind_update(self, config: PIDConfig, head_dim: int) -> Optional[Callable[..., Tuple[Tensor, PIDState]]]:
        """:meth:`update` of fixed gains without warm-up (:meth:`layer_params` gives every layer the config)."""
        if type(self).layer_params is not PIDMethod.layer_params:  # a subclass's own per-layer parameters
            return None
        if type(self).update is not _PID_UPDATE:  # a subclass's (or a wrapped) update: called as it is
            return functools.partial(self.update, config, scale=None, head_dim=head_dim)
        return _bound(fold(config), head_dim)

    def make_state(self, *tensors: Optional[Tensor]) -> PIDState:
        return PIDState(*tensors)

    def update(self, params: Any, out: Tensor, value_q: Tensor, state: Optional[tuple], scale: Optional[Tensor],
               head_dim: int) -> Tuple[Tensor, PIDState]:
        """:func:`pid_update`, the state handed on in the grouped layout under grouped-query attention."""
        if scale is None and type(params) is PIDConfig and not torch.compiler.is_compiling() and \
                not torch._C._is_tracing():  # fixed gains, eager: the bound update (made once per head layout)
            bound = _BOUND.get(id(params))  # (kept beside the config, which stays picklable)
            if bound is None or bound[0] is not params or bound[1] != head_dim:
                if len(_BOUND) > 256:
                    _BOUND.clear()
                bound = _BOUND[id(params)] = (params, head_dim, _bound(fold(params), head_dim))
            return bound[2](out, value_q, state)
        return _update(out, value_q, state, fold(params, scale), head_dim, True, scale)


_PID_UPDATE = PIDMethod.update
_LEAN_DTYPES = (torch.float32, torch.float64)  # values whose state keeps their dtype (no upcast)
_BOUND: dict = {}  # id(config) -> (config, head_dim, its bound update)


def _bound(g: Folded, head_dim: int) -> Callable[..., Tuple[Tensor, PIDState]]:
    """PID's update of fixed gains for every layer (not under TorchScript tracing): for float32/float64 values, the ops
    a hand-written function makes (bit for bit :func:`_update`'s, which takes every other case)."""
    w_first, w_e, w_sum, w_prev = g.weights
    beta = None if _is_one(g.beta) else g.beta
    make = tuple.__new__  # a PIDState without its Python __new__
    lean = head_dim <= -2 and g.control_first_layer
    after = head_dim + 1

    def update(out: Tensor, value_q: Tensor, state: Optional[tuple]) -> Tuple[Tensor, PIDState]:
        shape, kv_shape = out.shape, value_q.shape
        grouped = shape != kv_shape
        if not lean or value_q.dtype not in _LEAN_DTYPES or grouped and (
                len(shape) != len(kv_shape) or shape[:head_dim] != kv_shape[:head_dim]
                or shape[after:] != kv_shape[after:] or shape[head_dim] % kv_shape[head_dim]):
            return _update(out, value_q, state, g, head_dim, True, None)
        # key/value heads (..., H_kv, 1, ...) broadcast over the output viewed as (..., H_kv, r, ...)
        value = value_q.unsqueeze(head_dim) if grouped else value_q
        if state is not None and (state[2] is None or state[0].shape != value.shape):
            return _update(out, value_q, state, g, head_dim, True, None)
        if state is None:
            v_ref = value if beta is None else value * beta
            e = v_ref - value
            new = make(PIDState, (v_ref, e, e))
            terms = ((e, w_first),)
        else:
            v_ref, e_sum, e_prev = state
            e = v_ref - value
            e_sum = e_sum + e
            new = make(PIDState, (v_ref, e_sum, e))
            terms = ((e, w_e), (e_sum, w_sum), (e_prev, w_prev))
        u = out.view(*shape[:head_dim], kv_shape[head_dim], -1, *shape[after:]) if grouped else out
        fresh = False
        for x, w in terms:
            if w != 0.0:  # (a zero gain launches nothing)
                u = u.add_(x, alpha=w) if fresh else torch.add(u, x, alpha=w)
                fresh = True
        if not fresh:
            return out, new
        return (u.flatten(head_dim - 1, head_dim) if grouped else u), new

    return update
register_method(PIDMethod())
