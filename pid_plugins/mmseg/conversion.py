"""``convert(model, attention, attention_cfg)``: switch a built mmseg model's attention, in place.

The rule shared by the four zoo adapters: the model given is changed in place (the same parameter tensors, the same
module objects, hooks and train/eval mode kept) and returned, for chaining.

* A segmentor (mmseg's ``EncoderDecoder``, or any ``BaseSegmentor`` with one ``backbone`` and one ``decode_head``)
  whose backbone is mmseg's ``VisionTransformer`` and whose decode head is ``SegmenterMaskTransformerHead`` (Segmenter):
  both switch, each its own group (what a config with ``PIDVisionTransformer`` and ``PIDSegmenterMaskTransformerHead``
  of that method builds). A bare backbone or head switches alone: ``convert(segmentor.backbone, ...)`` gives the
  shipped configs' layout (the method in the backbone, the decoder stock).
* Each module's class is swapped (``VisionTransformer`` <-> :class:`~pid_plugins.mmseg.PIDVisionTransformer`,
  ``SegmenterMaskTransformerHead`` <-> :class:`~pid_plugins.mmseg.PIDSegmenterMaskTransformerHead`,
  ``TransformerEncoderLayer`` <-> :class:`~pid_plugins.mmseg.PIDTransformerEncoderLayer`; the PID classes add no
  parameters of their own) and the attributes their ``__init__`` sets are set: the method, its config, learnable
  parameters (``attention_params``), the warm-up counter (``attention_warmup``).
* ``attention="softmax"`` turns the model back into mmseg's own classes with every attribute, parameter, buffer and
  submodule pid-plugins added removed: its ``state_dict`` keys are the stock model's and it computes exactly what
  the stock model computes.
* A model with a method is reconfigured in place (another method, other parameters, learnable parameters on/off).

Everything is checked before anything changes: an unknown method or bad parameters (core's message), a model that is
not one of those, layers that are not mmseg's ``TransformerEncoderLayer``.
"""
from __future__ import annotations

from typing import Any, List, Tuple, TypeVar

from torch import nn
from mmseg.models.backbones.vit import TransformerEncoderLayer, VisionTransformer
from mmseg.models.decode_heads import SegmenterMaskTransformerHead
from mmseg.models.segmentors import BaseSegmentor

from ..core import MethodChoice, method_warmup
from ..core.layer import MODEL_ATTRIBUTES, settle_submodule, strip_attributes
from .head import PIDSegmenterMaskTransformerHead
from .internals import BACKBONE, HEAD, require
from .vit import PIDTransformerEncoderLayer, PIDVisionTransformer, choose_attention, method_layers

__all__ = ["convert"]

ModelT = TypeVar("ModelT", bound=nn.Module)

#: stock class -> its class with a method, and back
_TO_METHOD = {VisionTransformer: PIDVisionTransformer, SegmenterMaskTransformerHead: PIDSegmenterMaskTransformerHead}
_TO_STOCK = {method_cls: stock_cls for stock_cls, method_cls in _TO_METHOD.items()}
_BACKBONES = (VisionTransformer, PIDVisionTransformer)
_HEADS = (SegmenterMaskTransformerHead, PIDSegmenterMaskTransformerHead)
_LAYERS = (TransformerEncoderLayer, PIDTransformerEncoderLayer)



def convert(model: ModelT, attention: str = "pid", attention_cfg: Any = None, *, pid: Any = None) -> ModelT:
    """Switch an mmseg model's attention to ``attention``, in place; returns ``model``.

    Args:
        model: a segmentor with mmseg's ``VisionTransformer`` backbone and ``SegmenterMaskTransformerHead`` (both
            switch, each its own group), or a bare backbone or head; stock, built with pid-plugins' types or
            converted before.
        attention: ``"pid"``, another registered method's name (:func:`pid_plugins.list_methods`), or
            ``"softmax"``: mmseg's stock attention (mmseg's own classes again).
        attention_cfg: the method's parameters: a config instance, a dict of overrides of its ``mmseg`` preset (for
            PID the paper's ``segmenter``), or a preset name; ``{"learnable": True}`` gives every layer its own
            trainable parameters (``attention_params``), ``warmup_steps`` the warm-up counter (``attention_warmup``).
        pid: PID's parameters under their historical keyword (the same as ``attention_cfg``; PID only).

    The parameters and buffers are the model's own tensors before and after (nothing is copied or moved); learnable
    parameters are made at their initial values on the layer's device and dtype and in its train/eval mode: build
    the optimizer (mmengine's ``build_optim_wrapper``) after converting. Convert before wrapping the model (DDP,
    FSDP) and before ``torch.compile``.

    Raises ``ValueError`` (unknown method, bad parameters) or ``TypeError`` (a model, head or layer this cannot
    convert) before anything is changed.
    """
    where = f"convert({type(model).__name__})"
    choice = choose_attention(attention, attention_cfg, pid, where)
    parts = _parts(model)
    for name, part in parts:
        require(*(BACKBONE if isinstance(part, VisionTransformer) else HEAD))  # what the method classes compute again
        _check_layers(part, name)
        if choice is not None:  # refused for non-additive methods with warm-up (mmseg warms up stock + term)
            method_warmup(choice, None, None, stock_plus_term=True, where=f"{where}: {name}")
    for _, part in parts:
        if choice is None:
            _to_stock(part)
        else:
            _to_method(part, choice, where)
    return model


def _parts(model: nn.Module) -> List[Tuple[str, nn.Module]]:
    """The modules holding attention layers that ``convert`` switches (each its own group); refuses anything else."""
    kind = type(model)
    if kind in _BACKBONES or kind in _HEADS:
        return [(kind.__name__, model)]
    if isinstance(model, BaseSegmentor):
        backbone, head = getattr(model, "backbone", None), getattr(model, "decode_head", None)
        if type(backbone) not in _BACKBONES:
            raise TypeError(
                f"convert: {kind.__name__}'s backbone is {type(backbone).__name__}; convert handles mmseg's "
                "VisionTransformer (Segmenter, ViT) and PIDVisionTransformer backbones"
            )
        if type(head) not in _HEADS:
            raise TypeError(
                f"convert: {kind.__name__}'s decode_head is {type(head).__name__}; convert handles Segmenter's "
                "SegmenterMaskTransformerHead (and PIDSegmenterMaskTransformerHead). To switch the backbone alone, "
                "convert(model.backbone, ...)"
            )
        return [("backbone", backbone), ("decode_head", head)]
    if isinstance(getattr(model, "module", None), nn.Module):
        hint = "; convert the model before wrapping it (DDP, FSDP): convert(wrapper.module, ...) is too late"
    elif hasattr(model, "_orig_mod"):
        hint = "; convert the model before torch.compile"
    else:
        hint = ""
    raise TypeError(
        f"convert: an mmseg segmentor with a VisionTransformer backbone and a SegmenterMaskTransformerHead, or such a "
        f"backbone or head, got {kind.__name__}{hint}"
    )


def _check_layers(part: nn.Module, name: str) -> None:
    for i, layer in enumerate(part.layers):
        if type(layer) not in _LAYERS:
            raise TypeError(
                f"convert: {name} layer {i} is {type(layer).__name__}; convert switches mmseg's "
                "TransformerEncoderLayer (and PIDTransformerEncoderLayer) layers only"
            )


def _to_method(part: nn.Module, choice: MethodChoice, where: str) -> None:
    """Stock (or method) backbone/head -> the PID class with ``choice``: the class swap, then what its ``__init__``
    sets (the method and warm-up counter on the part, the layers switched as :func:`method_layers` does)."""
    part.__class__ = _TO_METHOD.get(type(part), type(part))
    like = part.pos_embed if isinstance(part, VisionTransformer) else part.cls_emb
    part.set_model_method(choice, like, stock_plus_term=True, where=where)
    settle_submodule(part, "attention_warmup")
    method_layers(part.layers, choice)


def _to_stock(part: nn.Module) -> None:
    """(Method) backbone/head -> mmseg's own classes, with everything pid-plugins added removed."""
    method_layers(part.layers, None)
    if type(part) in _TO_STOCK:
        strip_attributes(part, MODEL_ATTRIBUTES)
        part.__class__ = _TO_STOCK[type(part)]

