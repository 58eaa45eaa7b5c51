"""A method and transformers' KV caches: where the query positions' values are, and a method's own per-position
tensor kept inside the model's cache.

* :func:`static_past`: a static cache's length before this forward, as the cache's own tensor (no ``int()``: compiled
  decoding does not recompile per step); None for dynamic caches (the query rows end the value tensor);
* :func:`new_cache`: the cache a model would make inside its forward, made beforehand so a method with a cache slot
  can reach it;
* :class:`LayerSlot`: a method's per-position tensor (Twicing's ``A v``) as an extra cache layer beside the layer's
  keys and values, reordered, cropped and reset by the cache's own methods.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from ..core import CacheSlot
from .internals import CACHE_LAYERS, STATIC_LAYER

__all__ = ["LayerSlot", "new_cache", "static_past"]

_SLOT_BASE = "_pid_plugins_slot_base"


def static_past(cache: Any, name: str = "pid") -> Optional[Tensor]:
    """The static cache's length before this forward (a tensor, never synced), None for dynamic caches."""
    layers = getattr(cache, "layers", None)
    if not layers:
        return None
    from transformers.cache_utils import StaticLayer, StaticSlidingWindowLayer

    CACHE_LAYERS.require()
    if any(isinstance(x, StaticSlidingWindowLayer) or ("Static" in type(x).__name__ and "Sliding" in type(x).__name__)
           for x in layers):
        raise NotImplementedError(
            f"attention method {name!r} cannot use a static sliding-window cache (a rolling buffer does not keep the query "
            "positions' values where they can be located): use the dynamic cache (the default) for this model"
        )
    first = layers[0]
    if not (isinstance(first, StaticLayer) or "Static" in type(first).__name__):
        return None
    STATIC_LAYER.require()
    length = first.cumulative_length if first.is_initialized else None
    return torch.zeros((), dtype=torch.long) if length is None else length.clone()


def new_cache(config: Any) -> Any:
    """The cache a transformers model makes when ``use_cache`` and no cache is passed: ``DynamicCache(config=...)``,
    in an ``EncoderDecoderCache`` for encoder-decoder models."""
    from transformers import DynamicCache, EncoderDecoderCache

    if getattr(config, "is_encoder_decoder", False):
        return EncoderDecoderCache(DynamicCache(config=config), DynamicCache(config=config))
    return DynamicCache(config=config)


class LayerSlot(CacheSlot):
    """A method's per-position tensor kept in the model's own cache, as an extra cache layer of the same kind as
    layer ``layer_idx``'s (dynamic, sliding-window dynamic or static), at index ``base + layer_idx`` (``base``: the
    model's layer count). Being a layer of the cache, it is reordered by beam search, cropped, reset and kept in a
    static buffer by the cache's own methods, in step with the layer's keys and values."""

    def __init__(self, cache: Any, layer_idx: int, layer_count: int) -> None:
        self.cache, self.layer_idx, self.layer_count = cache, layer_idx, layer_count

    def __call__(self, rows: Tensor) -> Tensor:
        index = _slot_index(self.cache, self.layer_idx, self.layer_count)
        # a cache layer stores a pair: the tensor rides in the values' place, the keys' place holds one column of it
        # (not zero width: cache layers treat an empty key tensor as an empty layer, e.g. when reordering beams)
        _, stored = self.cache.layers[index].update(rows[..., :1], rows)
        return stored


def _slot_index(cache: Any, layer_idx: int, layer_count: int) -> int:
    """The cache layer that holds layer ``layer_idx``'s slot; the slots of every layer are made on first use."""
    base = cache.__dict__.get(_SLOT_BASE)
    if base is None:
        layers = cache.layers
        base = max(len(layers), layer_count, layer_idx + 1)
        replicate = getattr(cache, "layer_class_to_replicate", None)
        while len(layers) < base:  # a lazily grown cache: the model's layers not reached yet
            if replicate is None:
                raise ValueError(f"{type(cache).__name__} has {len(layers)} layers for a model of {base}")
            layers.append(replicate())
        for i in range(base):
            layers.append(_layer_like(layers[i]))
        cache.__dict__[_SLOT_BASE] = base
    return base + layer_idx


def _layer_like(layer: Any) -> Any:
    """An empty cache layer of ``layer``'s kind and size."""
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer, StaticLayer, StaticSlidingWindowLayer

    kind = type(layer)
    if kind is DynamicLayer:
        return DynamicLayer()
    if kind is DynamicSlidingWindowLayer:
        fresh = DynamicSlidingWindowLayer(sliding_window=layer.sliding_window)
        if getattr(layer, "record_past", False):
            fresh.activate_past_recording()
        return fresh
    if kind is StaticLayer:
        return StaticLayer(max_cache_len=layer.max_cache_len)
    names = (DynamicLayer.__name__, DynamicSlidingWindowLayer.__name__, StaticLayer.__name__)
    raise ValueError(
        f"the attention method keeps a tensor per past position beside the KV cache, in a cache layer of the same kind; "
        f"{kind.__name__} is not one it can make (supported: {', '.join(names)}; not {StaticSlidingWindowLayer.__name__}, "
        "quantized or offloaded layers): use the default dynamic cache or cache_implementation='static'"
    )
