"""Twicing attention (Abdullaev & Nguyen, "Transformer Meets Twicing", ICLR 2025) as an attention method.

With ``A = softmax(q k^T * scale + mask)`` of one head, a twicing layer outputs::

    u = A v + A (v - A v)        (= (2A - A A) v)

The second product is a second call of the zoo's attention, ``attend(q, v - A v)``: the same ``A`` exactly when no
dropout is drawn, so attention dropout in training is refused. Layers with index ``>= from_layer`` twice, earlier
ones compute the stock attention; nothing is handed between layers. With a KV cache, ``A v`` of past positions is
kept in a :class:`CacheSlot`. No parameter values give the stock attention: that is ``attention="softmax"``.
Sources and the official code's details: docs/methods/siblings.md."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch
from torch import Tensor, nn

from ..config import MethodConfig, registry_presets
from ..heads import expand_heads, move_heads, symbolic
from ..methods import Attend, AttentionContext, AttentionMethod, CacheSlot, register_method

__all__ = ["TwicingConfig", "Twicing", "twicing_rule"]


@dataclass(frozen=True)
class TwicingConfig(MethodConfig):
    """Twicing attention's one parameter.

    Args:
        from_layer: the first layer (0-based, within the group) that twices; 0: every layer."""

    from_layer: int = 0

    PRESETS = registry_presets("twicing")  # registry/presets.toml, each with its source

    def validate(self) -> None:
        if self.from_layer < 0:
            raise ValueError(
                f"TwicingConfig.from_layer must be a layer index >= 0 (0: every layer twices), got {self.from_layer!r}"
            )


def twicing_rule(attend: Attend, query: Tensor, value: Tensor, head_dim: int = -3,
                 slot: Optional[CacheSlot] = None) -> Tensor:
    """``A v + A (v - A v)`` from two calls of ``attend`` (output heads at ``head_dim``; ``value``
    ``(B, H_kv, K, D)``). ``slot``: where a KV cache keeps ``A v`` of past positions (None: no cache); a
    decoding step whose slot offers its past rows makes one call (:func:`_one_call`)."""
    past = getattr(slot, "past", None)  # (a plain callable, or no cache: no past; not read under fx tracing)
    step = past(value.shape[-2]) if past is not None and query.shape[-2] == 1 else None
    if step is not None:
        return _one_call(attend, query, value, head_dim, slot, *step)
    once = attend(query, value)
    rows = once if head_dim in (-3, once.dim() - 3) else once.movedim(head_dim, -3)  # (B, H, q, D)
    smoothed = rows if slot is None else slot(rows)  # (B, H, K, D): A v at every key position
    heads, kv_heads = rows.shape[-3], value.shape[-3]
    traced = symbolic(rows, value)
    if not traced and kv_heads != heads and (kv_heads <= 0 or heads % kv_heads):
        expand_heads(value, heads, -3)  # raises the explanatory error
    if not traced and smoothed.shape != (*value.shape[:-3], heads, *value.shape[-2:]):
        raise ValueError(
            f"twicing attention: A v at the key positions has shape {tuple(smoothed.shape)} but the values (expanded "
            f"to the query heads) {(*value.shape[:-3], heads, *value.shape[-2:])}: with a key/value cache the adapter "
            "must keep A v of the past positions next to it (a CacheSlot); this zoo gave none"
        )
    if traced or kv_heads == heads:
        residual = expand_heads(value, heads, -3) - smoothed
    else:  # v - A v per query head without repeating v: A v grouped (..., H_kv, r, K, D) minus v broadcast over r
        residual = (value.unsqueeze(-3) - smoothed.unflatten(-3, (kv_heads, heads // kv_heads))).flatten(-4, -3)
    return once + attend(query, residual)


def _one_call(attend: Attend, query: Tensor, value: Tensor, head_dim: int, slot: CacheSlot, smoothed: Tensor,
              current: Tensor) -> Tensor:
    """One decoding step in one call: over the values ``[v | v - S | e_t]`` (``S``: ``A v`` of the past positions,
    zero at the query's own ``t``; ``e_t`` its one-hot) the zoo's attention returns ``A v``, ``A (v - S)`` and
    ``A_tt``, and ``A (v - A v) = A (v - S) - A_tt (A v)_t``."""
    heads, size = smoothed.shape[-3], value.shape[-1]
    full = expand_heads(value, heads, -3)
    wide = torch.cat((full, full - smoothed, current.to(full.dtype).expand(*full.shape[:-1], 1)), -1)
    once, second, own = attend(query, wide).split((size, size, 1), -1)
    slot(move_heads(once, head_dim, -3))
    return once + second - own * once


class Twicing(AttentionMethod):
    """Twicing attention, ``A v + A (v - A v)``: two calls of the zoo's attention, no state."""

    name = "twicing"
    config_type = TwicingConfig
    state_fields = ()
    default_presets = {"*": "vision"}
    additive = False
    cache_slot = True

    def check(self, config: TwicingConfig, context: AttentionContext) -> None:
        if context.dropout:
            raise ValueError(
                "attention method 'twicing' calls the attention twice with the same A, which one attention-dropout "
                "draw cannot serve: set the attention dropout to 0 (timm attn_drop_rate, transformers "
                "attention_dropout, mmseg attn_drop_rate, fairseq --attention-dropout) or run the model in eval mode"
            )

    def layer_params(self, config: TwicingConfig, learned: Optional[nn.Module],
                     layer: Optional[int] = None) -> Optional[TwicingConfig]:
        """The config at layers that twice (index ``>= from_layer``; every layer when it is 0), None at earlier ones."""
        if config.from_layer and self.require_layer(layer) < config.from_layer:
            return None
        return config

    def attend(self, params: Optional[TwicingConfig], attend: Attend, query: Tensor, value: Tensor,
               state: Optional[tuple] = None, head_dim: int = -3, slot: Optional[CacheSlot] = None) -> Tensor:
        """``A v + A (v - A v)`` at a layer that twices, ``A v`` before ``from_layer`` (``params`` None)."""
        if params is not None:
            return twicing_rule(attend, query, value, head_dim, slot)
        return attend(query, value)

    def update(self, params: Optional[TwicingConfig], out: Tensor, value_q: Tensor, state: Optional[tuple],
               scale: Optional[Tensor], head_dim: int) -> Tuple[Tensor, tuple]:
        """The output unchanged, and no state."""
        return out, ()


register_method(Twicing())
