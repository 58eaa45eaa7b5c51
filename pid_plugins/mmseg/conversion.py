"""``convert(model, attention, attention_cfg)``: switch a built mmseg Segmenter's attention, in place."""
from __future__ import annotations

from functools import partial
from typing import Any, List, Optional, Tuple, TypeVar

from torch import nn
from mmseg.models.backbones.vit import VisionTransformer
from mmseg.models.decode_heads import SegmenterMaskTransformerHead
from mmseg.models.segmentors import BaseSegmentor

from ..core import MethodChoice, method_warmup
from ..core.layer import (
    MODEL_ATTRIBUTES, finish_model_warmup, register_warmup_finisher, replace_module, strip_attributes,
    warn_switch_of_trained_weights,
)
from .head import PIDSegmenterMaskTransformerHead, bare_head_forward
from .vit import PIDVisionTransformer, _check_layers, _choose, _switch_layers, bare_forward, configure_attention

__all__ = ["convert"]

ModelT = TypeVar("ModelT", bound=nn.Module)

#: stock class -> its class with a method
_TO_METHOD = {VisionTransformer: PIDVisionTransformer, SegmenterMaskTransformerHead: PIDSegmenterMaskTransformerHead}
_TO_STOCK = {method_cls: stock_cls for stock_cls, method_cls in _TO_METHOD.items()}


def convert(model: ModelT, attention: str = "pid", attention_cfg: Any = None) -> ModelT:
    """Switch a segmentor with a ``VisionTransformer`` backbone and ``SegmenterMaskTransformerHead`` (or a bare
    one of them, stock or ``PID*``) to ``attention`` with ``attention_cfg``, in place; returns ``model``. The
    backbone and head are each a group; a bare stock part keeps its class."""
    where = f"convert({type(model).__name__})"
    choice = _choose(attention, attention_cfg, where)
    parts = _parts(model, choice)
    for name, _, part in parts:
        _check_layers(part.layers, f"convert: {name}")
        if choice is not None:  # refused for non-additive methods with warm-up (mmseg warms up stock + term)
            method_warmup(choice, None, None, stock_plus_term=True, where=f"{where}: {name}")
    warn_switch_of_trained_weights(model, choice, where, current=parts[0][2])  # one warning for the model
    for name, parent, part in parts:
        if parent is None:  # a bare method backbone/head (or a stock one asked for softmax): keeps its class
            if isinstance(part, (PIDVisionTransformer, PIDSegmenterMaskTransformerHead)):
                part._configure_attention(choice, where)
            else:  # a bare stock backbone or head
                _bare_part(part, choice, where)
        elif choice is None:
            _switch_layers(part.layers, None)
            if type(part) in _TO_STOCK:
                strip_attributes(replace_module(parent, name, _TO_STOCK[type(part)]), MODEL_ATTRIBUTES)
        else:
            replace_module(parent, name, _TO_METHOD.get(type(part), type(part)))._configure_attention(choice, where)
    return model


def _parts(model: nn.Module, choice: Optional[MethodChoice]) -> List[Tuple[str, Optional[nn.Module], nn.Module]]:
    """``(name, parent, module)`` of the modules whose attention layers ``convert`` switches; refuses others."""
    kind = type(model)
    if kind in _TO_STOCK or kind in _TO_METHOD:
        return [(kind.__name__, None, model)]
    if isinstance(model, BaseSegmentor):
        backbone, head = getattr(model, "backbone", None), getattr(model, "decode_head", None)
        if type(backbone) not in (VisionTransformer, PIDVisionTransformer):
            raise TypeError(f"convert: {kind.__name__}'s backbone is {type(backbone).__name__}; convert handles "
                            "mmseg's VisionTransformer (Segmenter, ViT) and PIDVisionTransformer backbones")
        if type(head) not in (SegmenterMaskTransformerHead, PIDSegmenterMaskTransformerHead):
            raise TypeError(f"convert: {kind.__name__}'s decode_head is {type(head).__name__}; convert handles "
                            "Segmenter's SegmenterMaskTransformerHead (and PIDSegmenterMaskTransformerHead). For the "
                            "method in this segmentor's backbone, build it with backbone=dict("
                            "type='PIDVisionTransformer', attention=..., attention_cfg=dict(...))")
        return [("backbone", model, backbone), ("decode_head", model, head)]
    if isinstance(getattr(model, "module", None), nn.Module):
        hint = "; convert the model before wrapping it (DDP, FSDP): convert(wrapper.module, ...) is too late"
    elif hasattr(model, "_orig_mod"):
        hint = "; convert the model before torch.compile"
    else:
        hint = ""
    raise TypeError(f"convert: an mmseg segmentor with a VisionTransformer backbone and a "
                    f"SegmenterMaskTransformerHead, or a PIDVisionTransformer or PIDSegmenterMaskTransformerHead, got "
                    f"{kind.__name__}{hint}")


def _bare_part(model: nn.Module, choice: Optional[MethodChoice], where: str) -> None:
    """Switch a bare stock backbone or head in place, keeping its class; softmax removes it all again."""
    if choice is None:
        _switch_layers(model.layers, None)
        strip_attributes(model, MODEL_ATTRIBUTES + ("forward",))
        return
    backbone = isinstance(model, VisionTransformer)
    configure_attention(model, choice, model.pos_embed if backbone else model.cls_emb, where)
    model.__dict__["forward"] = partial(bare_forward if backbone else bare_head_forward, model)


def _finish(model: nn.Module) -> bool:
    """:func:`~pid_plugins.core.finish_warmup` for bare stock backbones and heads converted in place."""
    found = False
    for name, module in model.named_modules():
        if type(module) in _TO_METHOD and "attention_method" in vars(module):
            found = True
            finish_model_warmup(module, name or type(model).__name__)
    return found


register_warmup_finisher(_finish)
