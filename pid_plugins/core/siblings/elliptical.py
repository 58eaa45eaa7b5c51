"""Elliptical attention (Nielsen et al., NeurIPS 2024) as the attention method ``elliptical``.

Per layer ``l`` of a group, with this layer's values ``v^l`` (before attention) and the previous layer's ``v^{l-1}``::

    m^l[b, h, :]  = mean_n |v^l[b, h, n, :] - v^{l-1}[b, h, n, :]| / delta        (no gradient)
    m^l           = m^l / max_d m^l[b, h, d]                                        (per sample and head)
    u^l           = softmax((q diag(m^l)) k^T * scale + mask) v^l                   (layers l >= from_layer)
    u^l           = softmax(q k^T * scale + mask) v^l                               (layers l <  from_layer)

The state is ``(v^l,)``. ``mean="sequence"`` (the official rule) averages over the whole sequence and is refused
in causal models and with a cache; ``mean="prefix"`` averages each query over the keys it attends to (the causal
form, exact with a KV cache). No parameter values give the stock attention: that is ``attention="softmax"``.
Sources and the official code's details: docs/methods/siblings.md."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
from torch import Tensor, nn

from ..config import MethodConfig, registry_presets
from ..heads import move_heads, symbolic
from ..methods import AttentionContext, AttentionMethod, register_method

__all__ = ["EllipticalConfig", "EllipticalMethod", "elliptical_scales", "elliptical_prefix_scales"]

_OFFICIAL = "the official rule averages over the whole sequence"
MEANS = ("sequence", "prefix")


@dataclass(frozen=True)
class EllipticalConfig(MethodConfig):
    """Parameters of elliptical attention: the first layer (1-based, >= 2) whose queries are rescaled, the divisor
    ``delta`` of the value difference, and ``mean`` (``"sequence"``, official, or ``"prefix"``, causal)."""

    from_layer: int = 2
    delta: float = 5.0
    mean: str = "sequence"

    PRESETS = registry_presets("elliptical")  # registry/presets.toml, each with its source

    def validate(self) -> None:
        if self.from_layer < 2:
            raise ValueError(f"EllipticalConfig.from_layer must be >= 2 (the first layer has no previous layer's "
                             f"values), got {self.from_layer!r}; use attention='softmax' for the stock attention")
        if not (math.isfinite(self.delta) and self.delta > 0):
            raise ValueError(f"EllipticalConfig.delta must be a finite number > 0, got {self.delta!r}")
        if self.mean not in MEANS:
            raise ValueError(f"EllipticalConfig.mean must be one of {MEANS} ('sequence': the official whole-sequence "
                             f"mean; 'prefix': the causal form), got {self.mean!r}")


def _detached(x: Tensor) -> Tensor:
    """``x`` without gradient (itself when autograd does not track it; ``detach`` under torch.fx)."""
    return x.detach() if isinstance(x, torch.fx.Proxy) or x.requires_grad else x


def elliptical_scales(value: Tensor, value_prev: Tensor, delta: float) -> Tensor:
    """The scaling ``m`` ``(B, H, D)`` from this and the previous layer's values ``(B, H, N, D)``: the mean over
    positions of ``|v - v_prev| / delta``, divided by its maximum over ``D``; no gradient."""
    diff = (_detached(value) - _detached(value_prev)) / delta
    m = diff.abs().mean(dim=-2)
    return m / m.amax(dim=-1, keepdim=True)


def elliptical_prefix_scales(value: Tensor, value_prev: Tensor, delta: float, visible: Optional[Tensor]) -> Tensor:
    """The causal scaling ``m`` ``(B, H, q, D)``: per query, the mean of ``|v - v_prev| / delta`` over the keys
    it attends to (``visible``; None: every key), divided by its max over ``D`` (zeros stay zero). No gradient."""
    diff = ((_detached(value) - _detached(value_prev)) / delta).abs()
    if visible is None:
        m = diff.mean(dim=-2, keepdim=True)
    else:
        weights = visible.to(diff.dtype)
        count = weights.sum(dim=-1, keepdim=True).clamp_min(1.0)
        m = torch.matmul(weights, diff) / count
    return max_normalised(m)


def max_normalised(m: Tensor) -> Tensor:
    """``m`` divided by its maximum over the last dimension; rows whose maximum is 0 stay zero."""
    top = m.amax(dim=-1, keepdim=True)
    return m / torch.where(top > 0, top, torch.ones_like(top))


class EllipticalMethod(AttentionMethod):
    """Elliptical attention: queries scaled per dimension, one call of the zoo's attention, the values handed on."""

    name = "elliptical"
    config_type = EllipticalConfig
    state_fields = ("v_prev",)
    default_presets = {"timm": "deit", "mmseg": "segmenter", "hf": "deit", "fairseq": "lm", "*": "deit"}
    additive = False
    keys_state = True
    reads_visible = True

    def check(self, config: EllipticalConfig, context: AttentionContext) -> None:
        if config.mean != "sequence":
            return
        if context.causal:
            raise ValueError("attention method 'elliptical' with mean='sequence' is not causal: its query scaling "
                             f"averages |v^l - v^{{l-1}}| over the whole sequence ({_OFFICIAL}), so earlier positions "
                             "would read later tokens. For a causal model set mean='prefix' (each position averages "
                             "over the positions it attends to), e.g. the 'lm' preset")
        if context.cached:
            raise ValueError("attention method 'elliptical' with mean='sequence' cannot decode with a KV cache: its "
                             f"query scaling averages over the whole sequence ({_OFFICIAL}). Set mean='prefix', or "
                             "run without a cache (use_cache=False / no incremental state)")

    def layer_params(self, config: EllipticalConfig, learned: Optional[nn.Module],
                     layer: Optional[int] = None) -> Optional[EllipticalConfig]:
        """The config at layers that rescale (``layer + 1 >= from_layer``), None at earlier ones."""
        if config.from_layer > 2 and self.require_layer(layer) + 1 < config.from_layer:
            return None
        return config

    def prepare(self, params: Optional[EllipticalConfig], query: Tensor, value: Tensor, state: Optional[tuple],
                visible: Optional[Tensor] = None) -> Tensor:
        """``q diag(m)`` at a layer that rescales; the queries unchanged elsewhere."""
        if state is None or params is None:
            return query
        value_prev = state[0]
        if not symbolic(value) and value_prev.shape != value.shape:
            raise ValueError(f"attention method 'elliptical': this layer's values have shape {tuple(value.shape)} "
                             f"but the previous layer's {tuple(value_prev.shape)}: consecutive layers must see the "
                             "same key positions (a model mixing sliding-window and full-attention layers with a "
                             "cache, or layers of different widths, cannot run it)")
        sequence = params.mean == "sequence"
        if sequence:  # (B, H_kv, D)
            m = elliptical_scales(value, value_prev, params.delta).to(query.dtype)
        else:  # (B, H_kv, q, D)
            m = elliptical_prefix_scales(value, value_prev, params.delta, visible).to(query.dtype)
        if not symbolic(query, value) and query.shape[1] == value.shape[1]:  # one query head per key/value head
            return query * (m.unsqueeze(-2) if sequence else m)
        # key/value head j serves query heads j*r .. j*r + r - 1 (r = 1 without grouped-query attention)
        grouped = query.unflatten(1, (value.shape[1], -1))
        return (grouped * (m[:, :, None, None, :] if sequence else m[:, :, None])).flatten(1, 2)

    def update(self, params: Optional[EllipticalConfig], out: Tensor, value_q: Tensor, state: Optional[tuple],
               scale: Optional[Tensor], head_dim: int) -> Tuple[Tensor, tuple]:
        """The attention output unchanged; the state: this layer's values at every key position."""
        return out, (move_heads(_detached(value_q), head_dim, -3),)


register_method(EllipticalMethod())
