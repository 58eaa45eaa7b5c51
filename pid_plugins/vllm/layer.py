"""One layer's method step around vLLM's paged attention, shared by the native classes and the Transformers backend.
A further call of the zoo's attention with values of its own (Twicing's ``A (v - A v)``) gets a paged ``Attention`` of
its own (:func:`add_calls`), caching that call's keys and values: exact for causal per-position values."""
from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn
from vllm.config import get_current_vllm_config
from vllm.model_executor.layers.attention import Attention

from ..core import AttentionContext, LayerCall, MethodChoice
from ..core.siblings.elliptical import EllipticalMethod
from .elliptical import add_means, elliptical_step

__all__ = ["STATE_ROUTE", "add_calls", "method_step", "where"]

#: how the method's state reaches every layer here (core's MissingLayerState names it)
STATE_ROUTE = ("pid_plugins.vllm runs every layer of the model in one forward, which hands the state from layer to "
               "layer; pipeline parallelism is refused.")


def where(vllm_config: Any, architecture: str) -> str:
    return f"vLLM serving {getattr(vllm_config.model_config, 'model', 'a checkpoint')!s} ({architecture})"


def _call(choice: MethodChoice, attend: Callable[[Tensor, Tensor], Tensor], query: Tensor, values: Tensor,
          index: int, state: Optional[tuple]) -> Tuple[Tensor, tuple]:
    call = LayerCall(attend, query, values, values, head_dim=-3, layer=index, state_route=STATE_ROUTE,
                     context=AttentionContext(causal=True, cached=True, grouped=values.shape[0] != query.shape[0]))
    return choice.method.apply(choice.config, None, call, state)


def add_calls(choice: MethodChoice, attentions: Sequence[Attention], where: str) -> None:
    """Give each layer's paged attention ``method_calls``: one paged ``Attention`` per further call of the zoo's
    attention the method makes there (found by running the method once on two positions)."""
    if isinstance(choice.method, EllipticalMethod):
        return add_means(choice, attentions)
    config = get_current_vllm_config()
    state: Optional[tuple] = None
    for index, attention in enumerate(attentions):
        heads, kv_heads, dim = attention.num_heads, attention.num_kv_heads, attention.head_size
        given: List[int] = []

        def attend(query: Tensor, value: Tensor) -> Tensor:
            given.append(value.shape[0])
            return torch.zeros_like(query)

        with torch.no_grad():
            _, state = _call(choice, attend, torch.ones(heads, 2, dim), torch.ones(kv_heads, 2, dim), index, state)
        if given[:1] != [kv_heads] or any(count % kv_heads for count in given):
            raise ValueError(f"{where}: attention method {choice.method.name!r} calls the attention with values of "
                             f"{given} heads at layer {index}, where vLLM's paged attention has {kv_heads} key/value "
                             "heads (the first call) or a multiple of them: pid_plugins.vllm cannot cache them.")
        impl = attention.impl
        attention.method_calls = nn.ModuleList(
            Attention(heads, dim, impl.scale, num_kv_heads=count, cache_config=config.cache_config,
                      quant_config=attention.quant_config, logits_soft_cap=getattr(impl, "logits_soft_cap", 0) or None,
                      per_layer_sliding_window=attention.sliding_window, prefix=f"{attention.layer_name}_{call}")
            for call, count in enumerate(given[1:], start=1))


def method_step(choice: MethodChoice, index: int, state: Optional[tuple], query: Tensor, key: Tensor, value: Tensor,
                attention: Attention, own: Optional[Callable[[Tensor, Tensor, Tensor], Tensor]] = None
                ) -> Tuple[Tensor, tuple]:
    """The method's layer ``index`` around ``attention`` (``own``: its call, default ``attention`` itself), with
    vLLM's ``(tokens, heads * head_dim)`` queries, keys and values; the output in that layout and the state."""
    if isinstance(choice.method, EllipticalMethod):
        return elliptical_step(choice, state, query, key, value, attention, own)
    tokens, heads, kv_heads, dim = query.shape[0], attention.num_heads, attention.num_kv_heads, attention.head_size
    further = getattr(attention, "method_calls", ())
    made: List[int] = []

    def attend(q: Tensor, v: Tensor) -> Tensor:  # (H, T, D), (H_v, T, D) -> A v as (H, T, D)
        paged = further[len(made) - 1] if made else None
        made.append(1)
        k = key
        if paged is not None and paged.num_kv_heads != kv_heads:  # key/value head j serves query heads j*r .. j*r+r-1
            repeat = paged.num_kv_heads // kv_heads
            k = key.view(tokens, kv_heads, 1, dim).expand(-1, -1, repeat, -1).reshape(tokens, -1)
        flat_q, flat_v = q.transpose(0, 1).reshape(tokens, heads * dim), v.transpose(0, 1).reshape(tokens, -1)
        out = (own or attention)(flat_q, k, flat_v) if paged is None else paged(flat_q, k, flat_v)
        return out.view(tokens, heads, dim).transpose(0, 1)

    out, state = _call(choice, attend, query.view(tokens, heads, dim).transpose(0, 1),
                       value.view(tokens, kv_heads, dim).transpose(0, 1), index, state)
    return out.transpose(0, 1).reshape(tokens, heads * dim), state
