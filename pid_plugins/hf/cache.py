"""A method and transformers' KV caches: a static cache's length, the cache a forward would make, and a method's
per-position tensor kept inside each layer's own cache layer (:class:`LayerSlot`).
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import torch
from torch import Tensor

from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer, StaticLayer, StaticSlidingWindowLayer

from ..core import CacheSlot
from .internals import CACHE_LAYERS, STATIC_LAYER

__all__ = ["DynamicSlidingWindowSlotLayer", "DynamicSlotLayer", "LayerSlot", "SlotLayer", "StaticSlotLayer",
           "new_cache", "static_past", "with_slot"]


def static_past(cache: Any, name: str, compiling: Optional[bool] = None) -> Optional[Tensor]:
    """The static cache's length before this forward (a tensor, never synced), None for dynamic caches."""
    layers = getattr(cache, "layers", None)
    if not layers:
        return None
    first = layers[0]
    if torch.compiler.is_compiling() if compiling is None else compiling:  # (no cached function under the trace)
        static = _static_kinds.__wrapped__(type(first), tuple(map(type, layers)), name)
    else:
        static = _static_kinds(type(first), frozenset(map(type, layers)), name)
    if not static:
        return None
    STATIC_LAYER.require()
    length = first.cumulative_length if first.is_initialized else None
    return torch.zeros((), dtype=torch.long) if length is None else length.clone()


@functools.lru_cache(maxsize=64)
def _static_kinds(first: type, kinds: Any, name: str) -> bool:
    """Whether a cache whose layers are ``kinds``, the first a ``first``, is static; refuses static sliding windows."""
    CACHE_LAYERS.require()
    if any(issubclass(x, StaticSlidingWindowLayer) or ("Static" in x.__name__ and "Sliding" in x.__name__)
           for x in kinds):
        raise NotImplementedError(
            f"attention method {name!r} cannot use a static sliding-window cache (a rolling buffer does not keep the "
            "query positions' values where they can be located): use the dynamic cache (the default) for this model"
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

    eager_one_call = False
    """Offer :meth:`past` (Twicing's one-call step) in eager too, not only under torch.compile: eager, the step's
    wider values cost more than the call they save (the CPU's SDPA takes them only in its math kernel)."""

    def __init__(self, cache: Any, layer_idx: int, name: str, wide: bool = True) -> None:
        self.cache, self.layer_idx, self.name, self.wide = cache, layer_idx, name, wide

    def past(self, k_len: int) -> Optional[tuple[Tensor, Tensor]]:
        """The slot's rows for one query (zero at its own position) and that position's one-hot column; None for a
        base attention that takes no values wider than its queries (``wide`` False), or an empty slot."""
        layer = self.cache.layers[self.layer_idx]
        slot = getattr(layer, "slot", None)
        if not self.wide or slot is None or not slot.is_initialized or not (
                self.eager_one_call or torch.compiler.is_compiling()):
            return None
        rows = slot.values
        if isinstance(slot, StaticLayer):  # the buffer: the query's row is at the slot's length
            if rows.shape[-2] != k_len:
                return None
            current = (torch.arange(k_len, device=rows.device) == slot.cumulative_length)[:, None]
            return rows.masked_fill(current, 0), current
        if rows.shape[-2] != k_len - 1:
            return None
        current = torch.arange(k_len, device=rows.device)[:, None] == k_len - 1
        return torch.cat((rows, rows.new_zeros(*rows.shape[:-2], 1, rows.shape[-1])), -2), current

    def __call__(self, rows: Tensor) -> Tensor:
        layers = self.cache.layers
        layer = layers[self.layer_idx]
        if not isinstance(layer, SlotLayer):
            layer = layers[self.layer_idx] = with_slot(layer, self.name)
        return layer.slot_update(rows, self.layer_idx, self.name)


def _in_step(name: str) -> Callable[..., None]:
    """The cache layer's operation ``name``, done to its slot too."""
    def operation(self: Any, *args: Any, **kwargs: Any) -> None:
        getattr(super(SlotLayer, self), name)(*args, **kwargs)
        getattr(self.slot, name)(*args, **kwargs)

    operation.__name__ = operation.__qualname__ = name
    return operation


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

    reset, reorder_cache, crop, offload, prefetch = map(_in_step, ("reset", "reorder_cache", "crop", "offload",
                                                                 "prefetch"))


class _DynamicSlotLayer(SlotLayer):
    """The batch operations of dynamic layers (static layers have none)."""

    batch_repeat_interleave, batch_select_indices = map(_in_step, ("batch_repeat_interleave", "batch_select_indices"))


def _check_filled(layer: Any, slot: Any, q_len: int, layer_idx: int, name: str) -> None:
    """Refuse a layer whose cached positions have no method tensor."""
    if isinstance(layer, StaticLayer):  # a tensor: read (one sync) only while the slot is still empty
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


def with_slot(layer: Any, name: str) -> SlotLayer:
    """``layer``'s state (the same tensors) in the :class:`SlotLayer` of its kind, with an empty slot: a new object."""
    CACHE_LAYERS.require()
    kind = type(layer)
    carrier = _SLOT_CLASSES.get(kind)
    if carrier is None:
        names = ", ".join(k.__name__ for k in _SLOT_CLASSES)
        raise ValueError(
            f"attention method {name!r} keeps a tensor per past position inside each layer of the KV cache; "
            f"{kind.__name__} is not a layer kind it can extend (supported: {names}; not "
            f"{StaticSlidingWindowLayer.__name__}, quantized, indexed or linear-attention layers): use the default "
            "dynamic cache or cache_implementation='static'"
        )
    fresh = carrier.__new__(carrier)
    fresh.__dict__.update(vars(layer))
    if kind is DynamicSlidingWindowLayer:  # the slot: an empty layer of its kind and size
        fresh.slot = DynamicSlidingWindowLayer(sliding_window=layer.sliding_window)
        if getattr(layer, "record_past", False):
            fresh.slot.activate_past_recording()
    else:
        fresh.slot = StaticLayer(max_cache_len=layer.max_cache_len) if kind is StaticLayer else DynamicLayer()
    return fresh


class DynamicSlotLayer(_DynamicSlotLayer, DynamicLayer):
    """A :class:`~transformers.cache_utils.DynamicLayer` carrying a method's per-position tensor."""


class DynamicSlidingWindowSlotLayer(_DynamicSlotLayer, DynamicSlidingWindowLayer):
    """A :class:`~transformers.cache_utils.DynamicSlidingWindowLayer` carrying a method's per-position tensor."""

    activate_past_recording = _in_step("activate_past_recording")


class StaticSlotLayer(SlotLayer, StaticLayer):
    """A :class:`~transformers.cache_utils.StaticLayer` carrying a method's per-position tensor."""


_SLOT_CLASSES = {DynamicLayer: DynamicSlotLayer, DynamicSlidingWindowLayer: DynamicSlidingWindowSlotLayer,
                 StaticLayer: StaticSlotLayer}
