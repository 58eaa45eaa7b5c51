"""The PID update of PIDformer (Nguyen et al., ICML 2024, eq. 25): the one place the equation lives.

For layer ``l`` of a PID group (an ordered stack of self-attention layers in one forward pass whose value
tensors share one shape), every adapter calls :func:`pid_update` with that layer's attention output
``A^l v^l`` and values ``v^l`` (per head, query positions only) and the state returned by the previous
layer of the group::

    e^l   = beta * v^1 - v^l                                   (v^1: the group's first layer's values;
                                                               beta * v^1 is formed once and kept in the state)
    S^l   = S^{l-1} + e^l                                      (S^0 = 0)
    u^l   = A^l v^l + lambda_p * e^l + lambda_i * S^l + lambda_d * (e^l - e^{l-1})

The derivative term is zero at the first layer (there is no e^0). With
``PIDConfig(control_first_layer=False)`` the first layer only records v^1 (plain attention) and the sums
start at the second layer, whose derivative term is zero. Every term is per token position, so
nothing leaks across positions and a KV cache needs only the values of the positions being computed.
The state is an explicit value (:class:`PIDState`), passed in and returned, never stored on a module.

The code below is the update everywhere: one path (a fused Triton kernel for CUDA was measured on an H200 and was
slower in every row, training and decoding, so it was removed: docs/performance.md, "On an H200").
"""
from __future__ import annotations

import functools
from typing import NamedTuple, Optional, Sequence, Union

import torch
from torch import Tensor

from .config import PIDConfig

__all__ = ["PIDState", "pid_update", "expand_heads", "GainsLike", "symbolic"]

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


def symbolic(*tensors: Tensor) -> bool:
    """Whether sizes are traced values here, so that no Python branch may read them: TorchScript tracing (torch.onnx's
    exporter) or torch.fx symbolic tracing (timm's and torchvision's feature extraction: ``tensors`` are proxies).
    Code under it takes the branch-free form that is exact for every size, and leaves the shape checks out."""
    return torch.jit.is_tracing() or any(isinstance(t, torch.fx.Proxy) for t in tensors)


def expand_heads(x: Tensor, num_heads: int, head_dim: int = -3) -> Tensor:
    """Expand key/value heads to query heads the way grouped-query attention expands the values.

    Key/value head ``j`` serves query heads ``j*r .. j*r + r - 1`` with ``r = num_heads // H_kv``
    (``repeat_interleave``, as transformers' ``repeat_kv`` and SDPA's ``enable_gqa`` do).
    """
    kv_heads = x.shape[head_dim]
    if torch.jit.is_tracing():  # sizes are traced values: no Python branch on them (exact for r = 1 too)
        dim = head_dim % x.dim()
        return x.unsqueeze(dim + 1).expand(*x.shape[:dim + 1], num_heads // kv_heads, *x.shape[dim + 1:]).flatten(
            dim, dim + 1)
    if symbolic(x):  # torch.fx: sizes are proxies (no branch, no unpacking); a copy for r = 1, exact
        return x.repeat_interleave(num_heads // kv_heads, dim=head_dim)
    if kv_heads == num_heads:
        return x
    if kv_heads <= 0 or num_heads % kv_heads != 0:
        raise ValueError(
            f"cannot expand {kv_heads} key/value heads to {num_heads} query heads: "
            "the number of query heads must be a multiple of the number of key/value heads"
        )
    return x.repeat_interleave(num_heads // kv_heads, dim=head_dim)


def _state_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the error and its running sum: float32 at least (float16/bfloat16 values are upcast).
    (A table first: ``torch.promote_types`` is a dispatched op, one more per layer in a profile.)"""
    wide = _WIDER.get(dtype)
    return wide if wide is not None else torch.promote_types(dtype, torch.float32)


_WIDER = {torch.float16: torch.float32, torch.bfloat16: torch.float32, torch.float32: torch.float32,
          torch.float64: torch.float64}


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


def _kv_head_split(attn_out: Tensor, value: Tensor, head_dim: int) -> tuple[tuple[int, ...], int, tuple[int, ...]]:
    """For ``value`` with fewer heads than the attention output, dividing them (grouped-query attention) and
    otherwise matching: the output's shape with its head dimension split into ``(H_kv, r)``, the dimension
    at which a key/value-head tensor broadcasts over the ``r`` query heads of its group, and the shape of such a
    tensor with a size-1 dimension there. Raises otherwise."""
    return _grouped_shapes(attn_out.shape, value.shape, head_dim)


@functools.lru_cache(maxsize=256)  # a function of the shapes only: once per shape, not once per layer
def _grouped_shapes(shape: torch.Size, value_shape: torch.Size,
                    head_dim: int) -> tuple[tuple[int, ...], int, tuple[int, ...]]:
    if -len(shape) <= head_dim < len(shape) and len(shape) == len(value_shape):
        dim = head_dim % len(shape)
        heads, kv_heads = shape[dim], value_shape[dim]
        if kv_heads <= 0 or heads % kv_heads:
            expand_heads(torch.empty(value_shape, device="meta"), heads, dim)  # raises the explanatory error
        if shape[:dim] + (kv_heads,) + shape[dim + 1:] == value_shape:
            return ((*shape[:dim], kv_heads, heads // kv_heads, *shape[dim + 1:]), dim + 1,
                    (*value_shape[:dim + 1], 1, *value_shape[dim + 1:]))
    if len(shape) != len(value_shape):
        raise ValueError(
            f"attention output {tuple(shape)} and values {tuple(value_shape)} must have the same "
            "number of dimensions (..., heads, positions, head_dim)"
        )
    raise ValueError(
        f"attention output {tuple(shape)} does not match values {tuple(value_shape)} "
        "(after expanding key/value heads): pass the values of the query positions only"
    )
