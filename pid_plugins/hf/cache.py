"""A method and transformers' KV caches: :func:`static_past` (a static cache's length as a tensor), :func:`new_cache`
(the cache a forward would make, made beforehand) and :class:`LayerSlot` (a method's per-position tensor kept inside
the layer's own cache layer).
"""
from __future__ import annotations

import functools
from typing import Any, Optional

import torch
from torch import Tensor

from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer, StaticLayer, StaticSlidingWindowLayer

from ..core import CacheSlot
from .internals import CACHE_LAYERS, STATIC_LAYER

__all__ = ["DynamicSlidingWindowSlotLayer", "DynamicSlotLayer", "LayerSlot", "SlotLayer", "StaticSlotLayer",
           "new_cache", "static_past", "with_slot"]


def static_past(cache: Any, name: str, compiling: Optional[bool] = None) -> Optional[Tensor]:
    """The static cache's length before this forward (a tensor, never synced), None for dynamic caches.
    ``compiling``: torch.compiler.is_compiling(), where the caller knows it."""
    layers = getattr(cache, "layers", None)
    if not layers:
        return None
    first = layers[0]
    if torch.compiler.is_compiling() if compiling is None else compiling:  # (no cached function under the trace)
        static = _static_kinds.__wrapped__(type(first), tuple(map(type, layers)), name)
    else:  # once per set of layer types, not once per forward
        static = _static_kinds(type(first), frozenset(map(type, layers)), name)
    if not static:
        return None
    STATIC_LAYER.require()
    length = first.cumulative_length if first.is_initialized else None
    return torch.zeros((), dtype=torch.long) if length is None else length.clone()


@functools.lru_cache(maxsize=64)
def _static_kinds(first: type, kinds: Any, name: str) -> bool:
    """Whether a cache whose first layer is a ``first`` and whose layers are ``kinds`` is static; refuses static
    sliding windows."""
    CACHE_LAYERS.require()
    if any(issubclass(x, StaticSlidingWindowLayer) or ("Static" in x.__name__ and "Sliding" in x.__name__)
           for x in kinds):
        raise NotImplementedError(
            f"attention method {name!r} cannot use a static sliding-window cache (a rolling buffer does not keep the query "
            "positions' values where they can be located): use the dynamic cache (the default) for this model"
        )
    return issubclass(first, StaticLayer) or "Static" in first.__name__


def new_cache(config: Any) -> Any:
    """The cache a transformers model makes when ``use_cache`` and no cache is passed."""
    from transformers import DynamicCache, EncoderDecoderCache

    if getattr(config, "is_encoder_decoder", False):
        return EncoderDecoderCache(DynamicCache(config=config), DynamicCache(config=config))
    return DynamicCache(config=config)


class LayerSlot(CacheSlot):
    """A method's per-position tensor kept in layer ``layer_idx``'s own cache layer (made a :class:`SlotLayer`)."""

    def __init__(self, cache: Any, layer_idx: int, name: str) -> None:
        self.cache, self.layer_idx, self.name = cache, layer_idx, name

    def __call__(self, rows: Tensor) -> Tensor:
        layers = self.cache.layers
        layer = layers[self.layer_idx]
        if not isinstance(layer, SlotLayer):
            layer = layers[self.layer_idx] = with_slot(layer, self.name)
        return layer.slot_update(rows, self.layer_idx, self.name)


class SlotLayer:
    """Mixin of cache layers carrying a method's per-position tensor in ``slot``, an inner layer of their kind."""

    slot: Any

    def slot_update(self, rows: Tensor, layer_idx: int, name: str) -> Tensor:
        """Store ``rows`` (``(B, H, q, D)``) after the cached positions'; return it for every key position."""
        slot = self.slot
        if not torch.compiler.is_compiling():
            _check_filled(self, slot, rows.shape[-2], layer_idx, name)
        _, stored = slot.update(rows[..., :1], rows)
        return stored

    def reset(self) -> None:
        super().reset()
        self.slot.reset()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        self.slot.reorder_cache(beam_idx)

    def crop(self, tokens_to_remove: int) -> None:
        super().crop(tokens_to_remove)
        self.slot.crop(tokens_to_remove)

    def offload(self) -> None:
        super().offload()
        self.slot.offload()

    def prefetch(self) -> None:
        super().prefetch()
        self.slot.prefetch()


class _DynamicSlotLayer(SlotLayer):
    """The batch operations of dynamic layers (static layers have none), in step with the keys."""

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        self.slot.batch_repeat_interleave(repeats)

    def batch_select_indices(self, indices: Tensor) -> None:
        super().batch_select_indices(indices)
        self.slot.batch_select_indices(indices)


def _check_filled(layer: Any, slot: Any, q_len: int, layer_idx: int, name: str) -> None:
    """Refuse a layer whose cached positions have no method tensor."""
    if isinstance(layer, StaticLayer):  # a tensor length: read (one sync) only while the slot is still empty
        if slot.is_initialized:
            return
        past, held = int(layer.get_seq_length()) - q_len, 0
    else:
        past, held = layer.get_seq_length() - q_len, slot.get_seq_length()
    if past != held:
        raise ValueError(
            f"attention method {name!r} keeps a tensor of every cached position (Twicing: A v) inside the KV cache, "
            f"beside the keys and values, but layer {layer_idx} of this cache holds {past} cached positions and the "
            f"method's tensor of {held}: the cache was filled without it -- rebuilt from its (keys, values) tensors "
            "(DynamicCache(ddp_cache_data=...), a gather across ranks, a cache library), or filled by a forward that "
            "ran another attention implementation. Make the cache by running this model on the tokens "
            "(model(input_ids, cache=DynamicCache(config=model.config))), or decode with use_cache=False"
        )


def _slot_classes() -> dict:
    """{layer class: its :class:`SlotLayer` subclass} for the kinds a slot can be made of."""
    return {DynamicLayer: DynamicSlotLayer, DynamicSlidingWindowLayer: DynamicSlidingWindowSlotLayer,
            StaticLayer: StaticSlotLayer}


def with_slot(layer: Any, name: str) -> SlotLayer:
    """``layer``'s state (the same tensors) in the :class:`SlotLayer` of its kind, with an empty slot: a new object."""
    CACHE_LAYERS.require()
    kind = type(layer)
    carrier = _slot_classes().get(kind)
    if carrier is None:
        names = ", ".join(k.__name__ for k in _slot_classes())
        raise ValueError(
            f"attention method {name!r} keeps a tensor per past position inside each layer of the KV cache; "
            f"{kind.__name__} is not a layer kind it can extend (supported: {names}; not "
            f"{StaticSlidingWindowLayer.__name__}, quantized, indexed or linear-attention layers): use the default "
            "dynamic cache or cache_implementation='static'"
        )
    fresh = carrier.__new__(carrier)
    for attribute, value in vars(layer).items():
        setattr(fresh, attribute, value)
    fresh.slot = _layer_like(layer)
    return fresh


def _layer_like(layer: Any) -> Any:
    """An empty cache layer of ``layer``'s kind and size (past recording as ``layer``'s)."""
    kind = type(layer)
    if kind is DynamicSlidingWindowLayer:
        fresh = DynamicSlidingWindowLayer(sliding_window=layer.sliding_window)
        if getattr(layer, "record_past", False):
            fresh.activate_past_recording()
        return fresh
    if kind is StaticLayer:
        return StaticLayer(max_cache_len=layer.max_cache_len)
    return DynamicLayer()


class DynamicSlotLayer(_DynamicSlotLayer, DynamicLayer):
    """A :class:`~transformers.cache_utils.DynamicLayer` carrying a method's per-position tensor."""


class DynamicSlidingWindowSlotLayer(_DynamicSlotLayer, DynamicSlidingWindowLayer):
    """A :class:`~transformers.cache_utils.DynamicSlidingWindowLayer` carrying a method's per-position tensor."""

    def activate_past_recording(self) -> None:
        super().activate_past_recording()
        self.slot.activate_past_recording()


class StaticSlotLayer(SlotLayer, StaticLayer):
    """A :class:`~transformers.cache_utils.StaticLayer` carrying a method's per-position tensor."""
