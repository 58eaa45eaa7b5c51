"""Elliptical (``mean="prefix"``): one more paged ``Attention`` per rescaling layer caches ``d = |v^l - v^{l-1}| /
delta`` as its values; with zero queries and keys its softmax is uniform over the keys each query sees, so it gives
their mean of ``d`` (docs/serving-vllm.md). The state: the previous layer's values of this step's tokens."""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence, Tuple

import torch
from torch import Tensor
from vllm.config import get_current_vllm_config
from vllm.model_executor.layers.attention import Attention

from ..core import MethodChoice
from ..core.siblings.elliptical import max_normalised

__all__ = ["add_means", "elliptical_step"]


def add_means(choice: MethodChoice, attentions: Sequence[Attention]) -> None:
    """Give each layer that rescales (after the first) ``method_means``: the paged attention of ``d``."""
    cache = get_current_vllm_config().cache_config
    for index, attention in enumerate(attentions):
        if index and choice.method.layer_params(choice.config, None, index) is not None:
            heads, dim = attention.num_kv_heads, attention.head_size
            attention.method_means = Attention(heads, dim, 1.0, num_kv_heads=heads, cache_config=cache,
                                               per_layer_sliding_window=attention.sliding_window,
                                               prefix=f"{attention.layer_name}_means")


def elliptical_step(choice: MethodChoice, state: Optional[tuple], query: Tensor, key: Tensor, value: Tensor,
                    attention: Attention, own: Optional[Callable[..., Tensor]] = None) -> Tuple[Tensor, tuple]:
    """The layer's attention, its queries scaled where it rescales; the state: its values."""
    means: Any = getattr(attention, "method_means", None)
    if means is not None and state is not None:
        d = ((value - state[0]) / choice.config.delta).abs()
        m = means(torch.zeros_like(d), torch.zeros_like(d), d)
        m = max_normalised(m.view(query.shape[0], attention.num_kv_heads, 1, -1))
        query = (query.view(*m.shape[:2], -1, m.shape[-1]) * m).reshape(query.shape)
    return (own or attention)(query, key, value), (value,)
