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
state is ``(v^l,)``; the layer's index ``l`` is the one the adapter passes with every call (:attr:`LayerCall.layer
<pid_plugins.core.LayerCall>`, read in :meth:`EllipticalMethod.layer_params`). Facts read from the official code:
the mean runs over the whole sequence (no padding mask, also in ``LRA/PrimalFormer``), the ratio is divided by
``delta`` before the max scaling and has no epsilon (``v^l == v^{l-1}`` in a whole head gives 0/0), the first layer
never rescales (it has no previous values), and ``m`` is computed from detached tensors under ``no_grad`` (here:
from detached tensors only, which keeps checkpointing and ``torch.compile`` exact). With grouped-query attention (transformers) the scaling of a key/value head serves each
query head of its group (the official code has no grouped heads).

Causal models (``mean``). The official rule (``mean="sequence"``, the default) averages over the whole sequence,
so in a causal model every position's scaling reads later tokens. The authors' own language-model code does exactly
that: ``Wikitext/lmtool-fwms/src/mem_transformer.py`` (``W_over_layers``, called with ``delta=1`` from the causal
decoder's attention, ``run_M_small.sh``: 16 layers, ``--M-positions 1..15``, ``--mem_len 0``) takes the mean of
``|v^l - v^{l-1}|`` over all ``tgt_len`` positions under a causal attention mask, and has no KV cache. That is
refused here in a causal model and with a cache. ``mean="prefix"`` is the causal form: query ``i`` averages over
the key positions it attends to (``visible``: positions ``<= i`` that are not padding, left padding included; in a
sliding-window layer, the window), then divides by the max over ``head_dim``::

    m^l[b, h, i, :] = sum_{j visible to i} |v^l_j - v^{l-1}_j| / delta  /  #{j visible to i}
    m^l[b, h, i, :] = m^l[b, h, i, :] / max_d m^l[b, h, i, d]        (a row of zeros stays zero)

With a KV cache both layers' values at every past position are in the cache, so the prefix mean at a decoding step
is computed from them (the state hands on all key positions' values): decoding equals recomputation. Without a mask
and without causality (a bidirectional model without padding) ``"prefix"`` equals ``"sequence"``.

There are no parameter values that give the stock attention (``delta`` cancels in the max scaling): the stock model
is ``attention="softmax"`` with the same weights.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
from torch import Tensor, nn

from ..config import MethodConfig, registry_presets
from ..heads import symbolic
from ..methods import AttentionContext, AttentionMethod, register_method

__all__ = ["EllipticalConfig", "EllipticalMethod", "elliptical_scales", "elliptical_prefix_scales"]

_OFFICIAL = "the official rule averages over the whole sequence"
MEANS = ("sequence", "prefix")


@dataclass(frozen=True)
class EllipticalConfig(MethodConfig):
    """Parameters of elliptical attention.

    Args:
        from_layer: the first layer of the group (1-based) whose queries are rescaled; earlier layers compute the
            stock attention and only hand their values on. At least 2 (the first layer has no previous values).
            The official scripts use ``--M-positions 1 .. depth-1`` (0-based): every layer but the first, 2.
        delta: the step the value difference is divided by (official: 5 for DeiT, FAN and Segmenter, 1 in the
            WikiText and LRA code). It cancels in the max scaling up to rounding; kept to compute the same numbers.
        mean: what ``|v^l - v^{l-1}|`` is averaged over: ``"sequence"`` (the official rule: every position, the
            default; refused in causal models and with a KV cache) or ``"prefix"`` (each query over the key
            positions it attends to: the causal form, padding excluded, exact with a KV cache).
    """

    from_layer: int = 2
    delta: float = 5.0
    mean: str = "sequence"

    PRESETS = registry_presets("elliptical")  # registry/presets.toml, each with its source

    def validate(self) -> None:
        if self.from_layer < 2:
            raise ValueError(
                f"EllipticalConfig.from_layer must be >= 2 (the first layer has no previous layer's values), got "
                f"{self.from_layer!r}; use attention='softmax' for the stock attention"
            )
        if not (math.isfinite(self.delta) and self.delta > 0):
            raise ValueError(f"EllipticalConfig.delta must be a finite number > 0, got {self.delta!r}")
        if self.mean not in MEANS:
            raise ValueError(
                f"EllipticalConfig.mean must be one of {MEANS} ('sequence': the official whole-sequence mean; "
                f"'prefix': the causal form), got {self.mean!r}"
            )


def elliptical_scales(value: Tensor, value_prev: Tensor, delta: float) -> Tensor:
    """The per-dimension scaling ``m`` ``(B, H, D)`` from this layer's and the previous layer's values
    ``(B, H, N, D)``: the mean over positions of ``|v - v_prev| / delta``, divided by its maximum over ``D``.
    No gradient flows through it (computed from detached tensors)."""
    diff = (value.detach() - value_prev.detach()) / delta
    m = diff.abs().mean(dim=-2)
    return m / m.amax(dim=-1, keepdim=True)


def elliptical_prefix_scales(value: Tensor, value_prev: Tensor, delta: float, visible: Optional[Tensor]) -> Tensor:
    """The causal scaling ``m`` ``(B, H, q, D)``: for each query, the mean of ``|v - v_prev| / delta`` over the key
    positions it attends to (``visible``: boolean ``(B or 1, 1, q, K)``; None: every key, then ``q = 1``), divided by
    its max over ``D`` (a row of zeros stays zero). ``value``, ``value_prev``: ``(B, H, K, D)``. No gradient."""
    diff = ((value.detach() - value_prev.detach()) / delta).abs()
    if visible is None:
        m = diff.mean(dim=-2, keepdim=True)
    else:
        weights = visible.to(diff.dtype)
        count = weights.sum(dim=-1, keepdim=True).clamp_min(1.0)
        m = torch.matmul(weights, diff) / count
    top = m.amax(dim=-1, keepdim=True)
    return m / torch.where(top > 0, top, torch.ones_like(top))


class EllipticalMethod(AttentionMethod):
    """Elliptical attention: the queries scaled per dimension by :func:`elliptical_scales` (:meth:`prepare`), one
    call of the zoo's attention, the values handed on (:meth:`update`). State: ``(v_prev,)``, the previous layer's
    values ``(B, H_kv, N, D)`` (detached). Which layers rescale: :meth:`layer_params`, from the layer's index (a
    Python int: a constant for torch.fx and torch.compile)."""

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
            raise ValueError(
                "attention method 'elliptical' with mean='sequence' is not causal: its query scaling averages "
                f"|v^l - v^{{l-1}}| over the whole sequence ({_OFFICIAL}), so earlier positions would read later "
                "tokens. For a causal model set mean='prefix' (each position averages over the positions it attends "
                "to), e.g. the 'lm' preset"
            )
        if context.cached:
            raise ValueError(
                "attention method 'elliptical' with mean='sequence' cannot decode with a KV cache: its query scaling "
                f"averages over the whole sequence ({_OFFICIAL}). Set mean='prefix', or run without a cache "
                "(use_cache=False / no incremental state)"
            )

    def layer_params(self, config: EllipticalConfig, learned: Optional[nn.Module],
                     layer: Optional[int] = None) -> Optional[EllipticalConfig]:
        """The config at the layers that rescale their queries (1-based index ``>= from_layer``: 0-based ``layer +
        1``), None at the earlier ones (they keep their queries and only hand their values on). With
        ``from_layer=2`` that is every layer after the group's first, which the state tells (no index needed)."""
        if config.from_layer > 2 and self.require_layer(layer) + 1 < config.from_layer:
            return None
        return config

    def prepare(self, params: Optional[EllipticalConfig], query: Tensor, value: Tensor, state: Optional[tuple],
                visible: Optional[Tensor] = None) -> Tensor:
        """``q diag(m)`` at a layer that rescales (``params``: :meth:`layer_params`); the queries unchanged before
        ``from_layer`` (``params`` None) and at the group's first layer (``state`` None). ``query`` ``(B, H, q, D)``,
        ``value`` ``(B, H_kv, K, D)``; the previous layer's values (the state) cover the same key positions."""
        if state is None or params is None:
            return query
        value_prev = state[0]
        if not symbolic(value) and value_prev.shape != value.shape:
            raise ValueError(
                f"attention method 'elliptical': this layer's values have shape {tuple(value.shape)} but the previous "
                f"layer's {tuple(value_prev.shape)}: consecutive layers must see the same key positions (a model "
                "mixing sliding-window and full-attention layers with a cache, or layers of different widths, "
                "cannot run it)"
            )
        if params.mean == "sequence":
            m = elliptical_scales(value, value_prev, params.delta).to(query.dtype)[:, :, None, None, :]
        else:
            m = elliptical_prefix_scales(value, value_prev, params.delta, visible).to(query.dtype)[:, :, None]
        # key/value head j serves query heads j*r .. j*r + r - 1 (r = 1 without grouped-query attention)
        grouped = query.unflatten(1, (value.shape[1], -1))
        return (grouped * m).flatten(1, 2)

    def update(self, params: Optional[EllipticalConfig], out: Tensor, value_q: Tensor, state: Optional[tuple],
               scale: Optional[Tensor], head_dim: int) -> Tuple[Tensor, tuple]:
        """The attention output unchanged; the state: this layer's values at every key position (``keys_state``)
        in ``(B, H_kv, K, D)``."""
        return out, (value_q.detach().movedim(head_dim, -3),)


register_method(EllipticalMethod())
