"""Twicing attention (Abdullaev & Nguyen, "Transformer Meets Twicing", ICLR 2025) as an attention method.

With ``A = softmax(q k^T * scale + mask)`` of one head, a twicing layer outputs::

    u = A v + A (v - A v)        (= (2A - A A) v)

with the same ``A`` in both products. The official code (github.com/lazizcodes/twicing_attention) writes it twice:

* ``twicing_attention_vision/models.py``, ``SharpAttention.forward``: ``AV = A @ v``, ``res = v - AV``,
  ``x = AV + A @ res`` (dropout drawn once on ``A``, before both products); ``SharpVisionTransformer`` builds a
  ``SharpBlock`` at every layer (``layer_num=i ... if True else Block``). ``self.alpha = 0.5`` is defined but unused.
* ``twicing_attention_lang/lmtool-fwms/src/mem_transformer.py``, ``MultiHeadAttn.forward``: for
  ``self.layer_num >= 14`` the probabilities become ``2 * A - A @ A`` (dropout after), the other layers keep ``A``;
  ``run_sharp_small.sh`` trains it with ``--n_layer 16 --mem_len 0`` (the last two layers, no memory/cache).

Here the second product is a second call of the zoo's own attention, ``attend(q, v - A v)``: it is the same ``A``
(same queries, keys, mask and scale) exactly when no dropout is drawn, and it needs ``A v`` at every key position.
So :meth:`Twicing.check` refuses attention dropout, cached decoding (the cache would have to hold ``A v`` of past
positions too) and grouped-query attention (the zoo repeats each value head for its query group, so per-query-head
values ``v - A v`` cannot be passed through it). The rule is causal: ``(A v)_j`` reads positions ``<= j``.

Which layers twice: ``from_layer`` (0-based, counted over the layers of a group in order, the way the adapters
thread a method's state): the layers with index ``>= from_layer``; the earlier ones compute the stock attention.
The layer index travels in the state as the *length* of a small boolean tensor (capped at ``from_layer``), so it is
a static shape for ``torch.compile`` and a plain tensor for checkpointed blocks. There is no strength parameter
(no ZERO config): ``attention="softmax"`` with the same weights is the stock model.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch
from torch import Tensor

from ..config import MethodConfig
from ..methods import Attend, AttentionContext, AttentionMethod, register_method

__all__ = ["TwicingConfig", "Twicing", "twicing_rule"]


@dataclass(frozen=True)
class TwicingConfig(MethodConfig):
    """Twicing attention's one parameter.

    Args:
        from_layer: the first layer (0-based, within the group of layers a zoo threads the method's state through)
            that twices; earlier layers compute the stock attention. 0: every layer (the vision code).
    """

    from_layer: int = 0

    PRESETS = {
        # twicing_attention_vision/models.py: SharpVisionTransformer builds SharpBlock at every layer
        "vision": {"from_layer": 0},
        # twicing_attention_lang/lmtool-fwms/src/mem_transformer.py MultiHeadAttn.forward: `layer_num >= 14`,
        # of the 16 layers of run_sharp_small.sh (--n_layer 16): the last two
        "lm": {"from_layer": 14},
    }

    def validate(self) -> None:
        if self.from_layer < 0:
            raise ValueError(
                f"TwicingConfig.from_layer must be a layer index >= 0 (0: every layer twices), got {self.from_layer!r}"
            )


def twicing_rule(attend: Attend, query: Tensor, value: Tensor, head_dim: int = -3) -> Tensor:
    """``A v + A (v - A v)`` from two calls of ``attend`` (``attend(q, v) = A v`` in the output layout, heads at
    ``head_dim``; ``value`` in the layout ``attend`` takes, heads at -3)."""
    once = attend(query, value)
    residual = once if head_dim in (-3, once.dim() - 3) else once.movedim(head_dim, -3)
    if residual.shape != value.shape:
        raise ValueError(
            f"twicing attention: the attention output {tuple(residual.shape)} does not match the values "
            f"{tuple(value.shape)} (grouped-query heads or a key/value cache?): twicing needs as many value heads as "
            "query heads and the keys of the query positions only"
        )
    return once + attend(query, value - residual)


def _layer(state: Optional[tuple]) -> int:
    """This layer's index in its group, from the previous layer's state (see :meth:`Twicing.update`)."""
    if state is None or state[0] is None:
        return 0
    return state[0].shape[0]


class Twicing(AttentionMethod):
    """Twicing attention, ``A v + A (v - A v)`` (see the module docstring): two calls of the zoo's attention.

    :meth:`attend` reads the layer's index from the previous layer's state and the output layout from ``head_dim``.
    """

    name = "twicing"
    config_type = TwicingConfig
    state_fields = ("layer",)
    default_presets = {"*": "vision"}
    additive = False

    def check(self, config: TwicingConfig, context: AttentionContext) -> None:
        if context.dropout:
            raise ValueError(
                "twicing attention calls the attention twice with the same A, which one attention-dropout draw cannot "
                "serve: set the attention dropout to 0 (timm attn_drop_rate, transformers attention_dropout, mmseg "
                "attn_drop_rate, fairseq --attention-dropout) or run the model in eval mode"
            )
        if context.cached:
            raise ValueError(
                "twicing attention needs A v at every key position, which a key/value cache does not hold: decode "
                "without the cache (transformers: use_cache=False; fairseq: no incremental_state), recomputing the "
                "prefix at every step"
            )
        if context.grouped:
            raise ValueError(
                "twicing attention passes v - A v (one per query head) through the attention as values, but "
                "grouped-query attention shares each value head across a group of query heads: use as many "
                "key/value heads as query heads (num_key_value_heads = num_attention_heads)"
            )

    def attend(self, params: TwicingConfig, attend: Attend, query: Tensor, value: Tensor,
               state: Optional[tuple] = None, head_dim: int = -3) -> Tensor:
        """``A v + A (v - A v)`` from layer ``from_layer`` on (the layer's index from the previous layer's state),
        ``A v`` before."""
        if _layer(state) >= params.from_layer:
            return twicing_rule(attend, query, value, head_dim)
        return attend(query, value)

    def update(self, params: TwicingConfig, out: Tensor, value_q: Tensor, state: Optional[tuple],
               scale: Optional[Tensor], head_dim: int) -> Tuple[Tensor, tuple]:
        """The output unchanged; the state: this layer's index + 1 as the length of a boolean tensor
        (capped at ``from_layer``: every later layer twices), or None when every layer twices."""
        if not params.from_layer:
            return out, (None,)
        count = min(_layer(state) + 1, params.from_layer)
        return out, (torch.zeros(count, dtype=torch.bool, device=value_q.device),)


register_method(Twicing())
