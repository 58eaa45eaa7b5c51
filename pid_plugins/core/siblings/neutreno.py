"""NeuTRENO attention (Nguyen, Nguyen and Baraniuk, NeurIPS 2023) as the attention method ``"neutreno"``.

For the layers ``l = 1 .. L`` of one group, with ``A^l`` the layer's attention matrix and ``v^l`` its values::

    u^1 = A^1 v^1                              (the first layer only records v^1)
    u^l = A^l v^l + alpha * (v^1 - v^l)        (l >= 2)

It is PID with gains ``(alpha, 0, 0, 1)`` threading only ``v^1``; every term is per position (causal models and KV
caches need no refusal). Sources: docs/methods/siblings.md."""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Callable, Optional, Tuple

import torch
from torch import Tensor

from ..config import MethodConfig, registry_presets
from ..heads import _grouped_shapes, expand_heads
from ..methods import AttentionMethod, register_method

__all__ = ["NeuTRENOConfig", "NeuTRENOMethod", "neutreno_update"]

_LOW_PRECISION = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class NeuTRENOConfig(MethodConfig):
    """Parameters of NeuTRENO attention.

    Args:
        alpha: weight of the fidelity term ``v^1 - v^l``, >= 0 (0: the stock attention).
        warmup_steps: ``N > 0`` scales alpha by ``min(1, t / N)`` (:mod:`pid_plugins.core.warmup`); 0: off."""

    alpha: float = 0.6
    warmup_steps: int = 0

    PRESETS = registry_presets("neutreno")  # registry/presets.toml, each with its source
    ZERO = {"alpha": 0.0}

    def validate(self) -> None:
        if not math.isfinite(self.alpha) or self.alpha < 0.0:
            raise ValueError(
                f"NeuTRENOConfig.alpha must be a finite number >= 0 (0: the stock attention; the official code "
                f"uses 0.6 for DeiT and Segmenter, 0.4 for the WikiText-103 language model), got {self.alpha!r}"
            )
        if self.warmup_steps < 0:  # (an int: MethodConfig checks the type)
            raise ValueError("NeuTRENOConfig.warmup_steps must be a whole number of training forward passes >= 0 "
                             f"(0: no warm-up), got {self.warmup_steps!r}")


def neutreno_update(attn_out: Tensor, value: Tensor, v_first: Optional[Tensor], alpha: Any,
                    head_dim: int = -3, scale: Optional[Tensor] = None) -> Tensor:
    """One layer's output: ``attn_out`` at the first layer (``v_first`` None), else
    ``attn_out + alpha * (v_first - value)`` expanded to the query heads. ``scale``: the warm-up factor, or None."""
    if v_first is None:
        return attn_out
    # TorchScript tracing (torch.onnx): sizes are traced values; under torch.compile the shape cache is bypassed
    compiling = torch.compiler.is_compiling()
    traced = not compiling and torch._C._is_tracing()
    if not traced and v_first.shape != value.shape:
        raise ValueError(
            f"NeuTRENO layer values have shape {tuple(value.shape)} but the group's first layer had "
            f"{tuple(v_first.shape)}: every layer of a group must have values of one shape (same heads, head_dim "
            "and positions); use softmax attention for the odd layers"
        )
    # (v^1 - v) in key/value-head space, broadcast over each group of r query heads; float16/bfloat16 in float32
    grouped = None if traced or attn_out.shape == value.shape else (
        _grouped_shapes.__wrapped__ if compiling else _grouped_shapes)(attn_out.shape, value.shape, head_dim)
    wide = attn_out.dtype in _LOW_PRECISION
    diff = (v_first.float() if wide else v_first) - value  # (type promotion: value is upcast exactly)
    target = attn_out
    if traced:
        diff = expand_heads(diff, attn_out.shape[head_dim], head_dim)
    elif grouped is not None:
        target, diff = attn_out.view(grouped[0]), diff.unsqueeze(grouped[1])
    if scale is not None:
        diff = diff * scale.to(diff.dtype)
    out = target + diff * alpha.to(diff.dtype) if isinstance(alpha, Tensor) else torch.add(target, diff, alpha=alpha)
    if wide:
        out = out.to(attn_out.dtype)
    return out if grouped is None else out.flatten(grouped[1] - 1, grouped[1])


class NeuTRENOMethod(AttentionMethod):
    """NeuTRENO: ``A v + alpha (v^1 - v)`` from a group's second layer on (the first records ``v^1``)."""

    name = "neutreno"
    config_type = NeuTRENOConfig
    state_fields = ("v_first",)
    default_presets = {"timm": "deit", "mmseg": "segmenter", "hf": "lm", "fairseq": "lm", "*": "deit"}
    per_head_state = True  # v^1: (B, H_kv, q, D); alpha is one number for every head

    def update(self, params: NeuTRENOConfig, out: Tensor, value_q: Tensor, state: Optional[tuple],
               scale: Optional[Tensor], head_dim: int) -> Tuple[Tensor, tuple]:
        if scale is None and not torch.compiler.is_compiling() and not torch._C._is_tracing():
            return _lean(out, value_q, state, params.alpha, head_dim)
        return _layer(out, value_q, state, params.alpha, head_dim, scale)

    def bind_update(self, config: NeuTRENOConfig, head_dim: int) -> Optional[Callable[..., Tuple[Tensor, tuple]]]:
        """:meth:`update` of a fixed ``alpha`` without warm-up (eager or compiled; not TorchScript-traced)."""
        if type(self).update is not _NEUTRENO_UPDATE or type(self).layer_params is not AttentionMethod.layer_params:
            return super().bind_update(config, head_dim)  # a subclass's own update (called as it is) or parameters
        return functools.partial(_lean, alpha=config.alpha, head_dim=head_dim)


def _layer(out: Tensor, value_q: Tensor, state: Optional[tuple], alpha: Any, head_dim: int,
           scale: Optional[Tensor]) -> Tuple[Tensor, tuple]:
    if state is None:
        return out, (value_q,)
    return neutreno_update(out, value_q, state[0], alpha, head_dim, scale), (state[0],)


def _lean(out: Tensor, value_q: Tensor, state: Optional[tuple], alpha: Any, head_dim: int) -> Tuple[Tensor, tuple]:
    """:func:`_layer` without warm-up, lean for float32/float64 values with heads at ``head_dim <= -2``."""
    if state is None:
        return out, (value_q,)
    v_first, shape, kv_shape = state[0], out.shape, value_q.shape
    after = head_dim + 1
    if head_dim > -2 or isinstance(alpha, Tensor) or value_q.dtype not in _LEAN_DTYPES or \
            v_first.shape != kv_shape or len(shape) != len(kv_shape) or shape[:head_dim] != kv_shape[:head_dim] or \
            shape[after:] != kv_shape[after:] or shape[head_dim] % kv_shape[head_dim]:
        return _layer(out, value_q, state, alpha, head_dim, None)
    diff = v_first - value_q
    if shape == kv_shape:
        return torch.add(out, diff, alpha=alpha), state
    target = out.view(*shape[:head_dim], kv_shape[head_dim], -1, *shape[after:])
    return torch.add(target, diff.unsqueeze(head_dim), alpha=alpha).flatten(head_dim - 1, head_dim), state


_NEUTRENO_UPDATE = NeuTRENOMethod.update
_LEAN_DTYPES = (torch.float32, torch.float64)
register_method(NeuTRENOMethod())
