"""PID attention (Nguyen, Uribe, Nguyen and Baraniuk, "PIDformer: Transformer Meets Control Theory", ICML 2024,
eq. 25) as the attention method ``"pid"``: its parameters (:class:`PIDConfig`, with the paper's presets from
``registry/presets.toml``), its update (:func:`pid_update`), its learnable per-layer gains (:class:`PIDGains`) and
its registration. For layer ``l`` of a group (an ordered stack of self-attention layers in one forward pass whose
value tensors share one shape), with ``A^l v^l`` the layer's attention output and ``v^l`` its values (per head, query
positions only)::

    e^l = beta * v^1 - v^l            S^l = S^{l-1} + e^l            (S^0 = 0; beta v^1 formed once, kept in the state)
    u^l = A^l v^l + lambda_p * e^l + lambda_i * S^l + lambda_d * (e^l - e^{l-1})

The derivative term is zero at the first layer (there is no e^0); with ``control_first_layer=False`` the first layer
only records v^1 and the sums start at the second. Every term is per token position, so nothing leaks across
positions and a KV cache needs only the values of the positions being computed. The state is an explicit value
(:class:`PIDState`), passed in and returned, never stored on a module.
"""
from __future__ import annotations

import functools
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
            (softplus of a raw parameter, see :class:`PIDGains`).
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
    """What one PID layer hands to the next within a single forward pass.

    The tensors have the shape of the values in key/value-head space, e.g. ``(B, H_kv, q, D)``,
    restricted to the query positions, in at least float32 (values in float16/bfloat16, e.g. under autocast,
    are accumulated in float32 over depth). After a reference-only
    first layer (``PIDConfig(control_first_layer=False)``) they are ``None``: no error has been formed yet.
    Being a tuple, it can be splatted into checkpointed calls (``block(x, *state)``) and traced by
    ``torch.compile``.
    """

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
    """Apply the PID correction to one layer's attention output.

    One path for every case, in the folded form that launches the fewest kernels::

        e   = beta v^1 - v                    (beta v^1 from the state: one subtraction)
        S   = S_prev + e
        u   = A v + (lP + lD) e + lI S - lD e_prev      (accumulated into one fresh output tensor)

    i.e. five elementwise kernels per layer after the first (fewer where a fixed gain is zero), each error
    tensor broadcast over the query heads of its key/value head through a view (no copies).

    Args:
        attn_out: ``A^l v^l`` per head, shape ``(..., H, q, D)`` (any leading dims).
        value: this layer's values ``v^l`` for the same query positions, shape ``(..., H_kv, q, D)``
            with ``H_kv`` dividing ``H`` (grouped-query attention) or equal to it.
        state: the state returned by the previous layer of the group, or ``None`` at the first layer.
        gains: a :class:`PIDConfig` or ``(lambda_p, lambda_i, lambda_d, beta[, control_first_layer])``
            (floats or scalar / broadcastable tensors, e.g. learnable per-layer gains).
        head_dim: which dimension holds the heads (only used to expand key/value heads).
        scale: the gain warm-up's factor (a 0-dim tensor, :mod:`pid_plugins.core.warmup`), or None. It multiplies
            the PID term: fixed gains stay Python floats and the error tensors are scaled as they are added, so at
            ``scale = 1`` the result is bit for bit the one without a scale (a warmed-up model computes what its
            :func:`~pid_plugins.finish_warmup` model computes). Tensor (learnable) gains are multiplied by it.

    Returns:
        ``(u, new_state)``: the controlled output (same shape and dtype as ``attn_out``) and the state
        for the next layer of the group. In float16/bfloat16 the reference, the error, its sum and the PID
        term are computed in float32 and ``u`` is rounded once.
    """
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


@functools.lru_cache(maxsize=256)
def _folded(config: PIDConfig) -> _Folded:
    lp, li, ld = config.lambda_p, config.lambda_i, config.lambda_d
    return _Folded(lp + li, lp + ld, li, -ld, config.beta, config.beta == 1.0, config.control_first_layer)


def _fixed_update(attn_out: Tensor, value: Tensor, state: Optional[PIDState], g: _Folded,
                  head_dim: int) -> tuple[Tensor, PIDState]:
    """:func:`pid_update` with fixed (Python float) gains and no warm-up scale: the same float operations in the same
    order as the general path below, with the gains folded once per config and no per-call lists."""
    shape = value.shape
    if state is not None and state[0].shape != shape:
        pid_update(attn_out, value, state, (0.0, 0.0, 0.0, 1.0))  # raises the explanatory error
    out_shape = attn_out.shape
    grouped = None if out_shape == shape else _grouped_shapes(out_shape, shape, head_dim)
    if state is None:
        wide = _WIDER.get(value.dtype) or _state_dtype(value.dtype)
        v_ref = value if wide == value.dtype else value.to(wide)
        if not g.beta_is_one:
            v_ref = v_ref * g.beta
        if not g.control_first_layer:
            return attn_out, PIDState(v_ref, None, None)
    else:
        v_ref = state[0]
    e = v_ref - value
    e_prev = None if state is None else state[2]
    if e_prev is None:  # the group's first controlled layer: S = e, no D term
        new_state = PIDState(v_ref, e, e)
        terms: tuple = ((e, g.first),)
    else:
        e_sum = state[1] + e
        new_state = PIDState(v_ref, e_sum, e)
        terms = ((e, g.e), (e_sum, g.e_sum), (e_prev, g.e_prev))
    out = None
    target = attn_out if grouped is None else attn_out.reshape(grouped[0])
    for x, gain in terms:
        if gain != 0.0:  # a zero fixed gain launches nothing
            if grouped is not None:
                x = x.reshape(grouped[2])
            out = torch.add(target, x, alpha=gain) if out is None else out.add_(x, alpha=gain)
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

    Each gain is ``softplus(raw)`` of an unconstrained parameter (``lambda_p_raw`` ...), so it stays
    positive whatever the optimiser does: the stability of PID attention (PIDformer, Proposition 2)
    needs positive gains. A gain initialised at 0 starts at :data:`MIN_INITIAL_GAIN`. ``beta`` and
    ``control_first_layer`` stay fixed. Exclude these parameters from weight decay (weight decay would
    pull the raw value towards 0, i.e. the gain towards log 2), as timm's ``no_weight_decay`` does.

    Each raw parameter has shape ``(1,)``, not ``()``: FSDP2's ``fully_shard`` shards parameters along their
    first dimension and refuses 0-dim ones. State dicts written before the reparametrisation (parameters
    named ``lambda_p`` holding the gain itself) or with 0-dim raw values load: they are converted.
    """

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
    """``gains`` (a :class:`PIDConfig` or ``(lambda_p, lambda_i, lambda_d, beta[, control_first_layer])``) with
    the three gains multiplied by ``scale``; ``gains`` itself when ``scale`` is None (no warm-up: fixed gains stay
    Python floats, so :func:`pid_update` keeps its fast path)."""
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
    """PID attention (PIDformer, ICML 2024, eq. 25): :func:`pid_update` with
    :class:`PIDConfig` gains, optionally learnable per layer (:class:`PIDGains`) and warmed up."""

    name = "pid"
    config_type = PIDConfig
    state_fields = PIDState._fields
    default_presets = {"timm": "deit", "mmseg": "segmenter", "hf": "lm", "fairseq": "lm", "*": "deit"}

    def make_learned(self, config: PIDConfig) -> Optional[nn.Module]:
        return PIDGains(config) if config.learnable else None

    def layer_params(self, config: PIDConfig, learned: Optional[nn.Module], layer: Optional[int] = None) -> Any:
        """The config (fixed gains), or the layer's learned ``lambda_p, lambda_i, lambda_d`` with the config's
        ``beta`` and first-layer rule (those are never learned)."""
        if learned is None:
            return config
        lambda_p, lambda_i, lambda_d = learned()[:3]
        return (lambda_p, lambda_i, lambda_d, config.beta, config.control_first_layer)

    def make_state(self, *tensors: Optional[Tensor]) -> PIDState:
        return PIDState(*tensors)

    def update(self, params: Any, out: Tensor, value_q: Tensor, state: Optional[tuple], scale: Optional[Tensor],
               head_dim: int) -> Tuple[Tensor, PIDState]:
        return pid_update(out, value_q, state, params, head_dim=head_dim, scale=scale)


register_method(PIDMethod())
