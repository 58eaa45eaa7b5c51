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
(same queries, keys, mask and scale) exactly when no dropout is drawn, so :meth:`Twicing.check` refuses attention
dropout in training (one dropout draw cannot serve two calls), and nothing else. The rule is causal: ``(A v)_j``
reads positions ``<= j``. Two cases the official code does not have (docs/methods/siblings.md):

* grouped-query attention (transformers' Llama, Mistral, Qwen, ...): ``v - A v`` has one tensor per *query* head;
  the second call gets the values expanded to the query heads (``repeat_interleave``, as the model expands them)
  minus ``A v``, and the adapter's ``attend`` expands the keys to the query heads for that call. Exact: every query
  head sees the same keys and mask as in the first call.
* a KV cache: the second product needs ``(A v)_j`` at every past key position ``j``. In a causal model it is fixed
  once computed, so the adapter keeps it next to the layer's cached keys/values (:class:`CacheSlot`: transformers'
  dynamic, static and sliding-window caches, reordered by beam search; fairseq's ``incremental_state``) and the
  method reads it back for every key position. Decoding with the cache equals recomputing the prefix.

Which layers twice: ``from_layer`` (0-based, counted over the layers of a group in order, the way the adapters
thread a method's state): the layers with index ``>= from_layer``; the earlier ones compute the stock attention (one
call of the zoo's attention). The index is the one the adapter passes with every call (:attr:`LayerCall.layer
<pid_plugins.core.LayerCall>`, read in :meth:`Twicing.layer_params`): a Python int, so the choice is a constant for
torch.fx and torch.compile, and the method hands nothing from layer to layer (no ``state_fields``). There is no
strength parameter (no ZERO config): ``attention="softmax"`` with the same weights is the stock model.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

from torch import Tensor, nn

from ..config import MethodConfig, registry_presets
from ..heads import expand_heads, symbolic
from ..methods import Attend, AttentionContext, AttentionMethod, CacheSlot, register_method

__all__ = ["TwicingConfig", "Twicing", "twicing_rule"]


@dataclass(frozen=True)
class TwicingConfig(MethodConfig):
    """Twicing attention's one parameter.

    Args:
        from_layer: the first layer (0-based, within the group of layers a zoo threads the method's state through)
            that twices; earlier layers compute the stock attention. 0: every layer (the vision code).
    """

    from_layer: int = 0

    PRESETS = registry_presets("twicing")  # registry/presets.toml, each with its source

    def validate(self) -> None:
        if self.from_layer < 0:
            raise ValueError(
                f"TwicingConfig.from_layer must be a layer index >= 0 (0: every layer twices), got {self.from_layer!r}"
            )


def twicing_rule(attend: Attend, query: Tensor, value: Tensor, head_dim: int = -3,
                 slot: Optional[CacheSlot] = None) -> Tensor:
    """``A v + A (v - A v)`` from two calls of ``attend`` (``attend(q, v) = A v`` in the output layout, heads at
    ``head_dim``; ``value`` ``(B, H_kv, K, D)`` in the layout ``attend`` takes). With fewer key/value heads than
    query heads, the second call's values are per query head (``attend`` expands the keys). ``slot``: where a KV
    cache keeps ``A v`` of the past key positions (None: no cache, the keys are the query positions)."""
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


class Twicing(AttentionMethod):
    """Twicing attention, ``A v + A (v - A v)`` (see the module docstring): two calls of the zoo's attention.

    :meth:`layer_params` decides from the layer's index whether the layer twices; :meth:`attend` reads the output
    layout from ``head_dim``. No state: nothing is handed from layer to layer.
    """

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
        """The config at the layers that twice (index ``>= from_layer``), None at the earlier ones (they compute the
        stock attention). With ``from_layer=0`` every layer twices, whatever the index (None included)."""
        if config.from_layer and self.require_layer(layer) < config.from_layer:
            return None
        return config

    def attend(self, params: Optional[TwicingConfig], attend: Attend, query: Tensor, value: Tensor,
               state: Optional[tuple] = None, head_dim: int = -3, slot: Optional[CacheSlot] = None) -> Tensor:
        """``A v + A (v - A v)`` at a layer that twices (``params``: :meth:`layer_params`), ``A v`` at one before
        ``from_layer`` (``params`` None)."""
        if params is not None:
            return twicing_rule(attend, query, value, head_dim, slot)
        return attend(query, value)

    def update(self, params: Optional[TwicingConfig], out: Tensor, value_q: Tensor, state: Optional[tuple],
               scale: Optional[Tensor], head_dim: int) -> Tuple[Tensor, tuple]:
        """The output unchanged, and no state."""
        return out, ()


register_method(Twicing())
