"""Elliptical attention (Nielsen et al., NeurIPS 2024) as the attention method ``elliptical``.

The rule as the authors' public code computes it (stefvk/Elliptical-Attention: ``ImageNet/models.py``,
``MahalaAttention.W_over_layers`` and ``forward`` with ``over_layers=True``; the same in ``FAN/models/fan.py`` and
``ADE20K/model/deit_elliptical.py``). Per layer ``l`` of a group, with this layer's values ``v^l`` (the value
projection split into heads, before attention) and the previous layer's ``v^{l-1}``::

    m^l[b, h, :]  = mean_n |v^l[b, h, n, :] - v^{l-1}[b, h, n, :]| / delta        (no gradient)
    m^l           = m^l / max_d m^l[b, h, d]                                        (per sample and head)
    u^l           = softmax((q diag(m^l)) k^T * scale + mask) v^l                   (layers l >= from_layer)
    u^l           = softmax(q k^T * scale + mask) v^l                               (layers l <  from_layer)

Every layer hands its values on (the official blocks return them whether or not they rescale their queries), so the
state is ``(v^l, l)``. Facts read from the official code: the mean runs over the whole sequence (no padding mask,
also in ``LRA/PrimalFormer``), the ratio is divided by ``delta`` before the max scaling and has no epsilon (``v^l ==
v^{l-1}`` in a whole head gives 0/0), the first layer never rescales (it has no previous values), and ``m`` is
computed from detached tensors under ``no_grad`` (here: from detached tensors only, which keeps checkpointing and
``torch.compile`` exact). With grouped-query attention (transformers) the scaling of a key/value head serves each
query head of its group (the official code has no grouped heads).

Refused: causal models (the mean over the sequence would let earlier positions read later tokens; the authors'
WikiText code does so) and cached decoding. There are no parameter values that give the stock attention (``delta``
cancels in the max scaling): the stock model is ``attention="softmax"`` with the same weights.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
from torch import Tensor

from ..config import MethodConfig
from ..methods import AttentionContext, AttentionMethod, register_method

__all__ = ["EllipticalConfig", "EllipticalMethod", "elliptical_scales"]

_OFFICIAL = "the official rule averages over the whole sequence"


@dataclass(frozen=True)
class EllipticalConfig(MethodConfig):
    """Parameters of elliptical attention.

    Args:
        from_layer: the first layer of the group (1-based) whose queries are rescaled; earlier layers compute the
            stock attention and only hand their values on. At least 2 (the first layer has no previous values).
            The official scripts use ``--M-positions 1 .. depth-1`` (0-based): every layer but the first, 2.
        delta: the step the value difference is divided by (official: 5 for DeiT, FAN and Segmenter, 1 in the
            WikiText and LRA code). It cancels in the max scaling up to rounding; kept to compute the same numbers.
    """

    from_layer: int = 2
    delta: float = 5.0

    PRESETS = {
        # ImageNet/run_elliptical.sh (--M-positions 1..11) and ImageNet/models.py MahalaAttention.forward (delta=5)
        "deit": {"from_layer": 2, "delta": 5.0},
        # FAN/scripts/fan_vit/run_elliptical_fan.sh (--M-positions 1..11), FAN/models/fan.py (delta=5)
        "fan": {"from_layer": 2, "delta": 5.0},
        # ADE20K/model/factory.py (M_positions=[1..11]), ADE20K/model/deit_elliptical.py (delta=5)
        "segmenter": {"from_layer": 2, "delta": 5.0},
    }

    def validate(self) -> None:
        if self.from_layer < 2:
            raise ValueError(
                f"EllipticalConfig.from_layer must be >= 2 (the first layer has no previous layer's values), got "
                f"{self.from_layer!r}; use attention='softmax' for the stock attention"
            )
        if not (math.isfinite(self.delta) and self.delta > 0):
            raise ValueError(f"EllipticalConfig.delta must be a finite number > 0, got {self.delta!r}")


def elliptical_scales(value: Tensor, value_prev: Tensor, delta: float) -> Tensor:
    """The per-dimension scaling ``m`` ``(B, H, D)`` from this layer's and the previous layer's values
    ``(B, H, N, D)``: the mean over positions of ``|v - v_prev| / delta``, divided by its maximum over ``D``.
    No gradient flows through it (computed from detached tensors)."""
    diff = (value.detach() - value_prev.detach()) / delta
    m = diff.abs().mean(dim=-2)
    return m / m.amax(dim=-1, keepdim=True)


class EllipticalMethod(AttentionMethod):
    """Elliptical attention: the queries scaled per dimension by :func:`elliptical_scales` (:meth:`prepare`), one
    call of the zoo's attention, the values handed on (:meth:`update`). State: ``(v_prev, layer)``, the previous
    layer's values ``(B, H_kv, N, D)`` (detached) and its 1-based index in the group (a 0-dim int64 tensor, so
    ``from_layer`` is applied without Python branching on values: torch.fx and torch.compile trace it)."""

    name = "elliptical"
    config_type = EllipticalConfig
    state_fields = ("v_prev", "layer")
    default_presets = {"timm": "deit", "mmseg": "segmenter", "*": "deit"}
    additive = False

    def check(self, config: EllipticalConfig, context: AttentionContext) -> None:
        if context.causal:
            raise ValueError(
                "attention method 'elliptical' is not causal: its query scaling averages |v^l - v^{l-1}| over the "
                f"whole sequence ({_OFFICIAL}), so earlier positions would read later tokens. Use it in a "
                "bidirectional (encoder) model, or choose attention='softmax' or another method for a causal model"
            )
        if context.cached:
            raise ValueError(
                "attention method 'elliptical' cannot decode with a KV cache: its query scaling averages over the "
                f"whole sequence ({_OFFICIAL}). Run without a cache (use_cache=False / no incremental state)"
            )

    def prepare(self, params: EllipticalConfig, query: Tensor, value: Tensor, state: Optional[tuple]) -> Tensor:
        """``q diag(m)`` from the layer ``from_layer`` on; unchanged (``q * 1``, exact) before, and at the group's
        first layer. ``query`` ``(B, H, N, D)``, ``value`` ``(B, H_kv, N, D)``."""
        if state is None:
            return query
        value_prev, layer = state[0], state[1]
        m = elliptical_scales(value, value_prev, params.delta).to(query.dtype)
        m = torch.where(layer + 1 >= params.from_layer, m, torch.ones_like(m))
        # key/value head j serves query heads j*r .. j*r + r - 1 (r = 1 without grouped-query attention)
        grouped = query.unflatten(1, (m.shape[1], -1))
        return (grouped * m[:, :, None, None, :]).flatten(1, 2)

    def update(self, params: EllipticalConfig, out: Tensor, value_q: Tensor, state: Optional[tuple],
               scale: Optional[Tensor], head_dim: int) -> Tuple[Tensor, tuple]:
        """The attention output unchanged; the state: this layer's values in ``(B, H_kv, N, D)`` and its index."""
        value = value_q.detach().movedim(head_dim, -3)
        layer = torch.ones((), dtype=torch.long, device=value.device) if state is None else state[1] + 1
        return out, (value, layer)


register_method(EllipticalMethod())
