"""``convert(model, attention, attention_cfg)``: switch a built timm model's attention, in place.

The rule shared by the four zoo adapters: the model given is changed in place (the same parameter tensors, the
same module objects, hooks and train/eval mode kept) and returned, for chaining.

* A stock timm ``VisionTransformer`` / ``VisionTransformerDistilled`` (standard ``Block`` + ``Attention``) becomes
  :class:`~pid_plugins.timm.PIDVisionTransformer` / :class:`~pid_plugins.timm.PIDVisionTransformerDistilled` with
  :class:`~pid_plugins.timm.PIDBlock` / :class:`~pid_plugins.timm.PIDAttention` blocks: each module's class is
  swapped (the PID classes add no parameters of their own) and the attributes the PID classes' ``__init__`` sets
  are set (the method, its config, learnable parameters, the warm-up counter).
* ``attention="softmax"`` turns such a model back into timm's own classes, with every attribute, parameter, buffer
  and submodule pid-plugins added removed: its ``state_dict`` keys are the stock model's and it computes exactly
  what the stock model computes.
* A model with a method is reconfigured in place (another method, other parameters, learnable gains on or off).
* FAN (pid-plugins' own class; its softmax form is what ``timm.create_model("fan_...")`` builds) switches its
  token mixing in place and keeps its class.

Everything is checked before anything changes: an unknown method or bad parameters (core's message), a model
that is not one of those, blocks that are not the standard ones, blocks of different head shapes.
"""
from __future__ import annotations

from typing import Any, Optional, TypeVar

from torch import nn
from timm.layers import Attention
from timm.models.deit import VisionTransformerDistilled
from timm.models.vision_transformer import Block, VisionTransformer

from ..core import MethodChoice
from ..core.layer import LAYER_ATTRIBUTES, MODEL_ATTRIBUTES, number_layers, settle_submodule, strip_attributes
from ._helpers import resolve_timm_attention
from .fan import FAN
from .internals import FAN as FAN_INTERNALS, VIT, require
from .vision_transformer import (
    PIDAttention, PIDBlock, PIDVisionTransformer, PIDVisionTransformerDistilled, _PIDViTMixin,
)

__all__ = ["convert"]

ModelT = TypeVar("ModelT", bound=nn.Module)

#: stock class -> its class with a method, and back
_TO_METHOD = {
    VisionTransformer: PIDVisionTransformer,
    VisionTransformerDistilled: PIDVisionTransformerDistilled,
    Block: PIDBlock,
    Attention: PIDAttention,
}
_TO_STOCK = {method_cls: stock_cls for stock_cls, method_cls in _TO_METHOD.items()}
_VIT_CLASSES = (VisionTransformer, VisionTransformerDistilled, PIDVisionTransformer, PIDVisionTransformerDistilled)



def convert(model: ModelT, attention: str = "pid", attention_cfg: Any = None, *, pid: Any = None) -> ModelT:
    """Switch a timm model's attention to ``attention``, in place; returns ``model``.

    Args:
        model: a timm ``VisionTransformer`` / ``VisionTransformerDistilled`` built with timm's standard ``Block`` +
            ``Attention`` (DeiT, ViT), one converted before or built by a ``pid_*`` name, or a FAN
            (``fan_*`` / ``pid_fan_*``).
        attention: ``"pid"``, another registered method's name (:func:`pid_plugins.list_methods`), or
            ``"softmax"``: timm's stock attention (a ViT/DeiT goes back to timm's own classes).
        attention_cfg: the method's parameters: a config instance, a dict of overrides of its default preset (for
            PID the ``deit`` preset), or a preset name.
        pid: PID's parameters under their historical keyword (the same as ``attention_cfg``; PID only).

    The parameters and buffers are the model's own tensors before and after (nothing is copied or moved); a
    method with learnable parameters (``{"learnable": True}``) adds them, initialised on the model's device and
    dtype, and ``warmup_steps`` adds the warm-up counter (``attention_warmup``): build the optimizer after converting.
    Convert before ``torch.compile`` (a compiled wrapper is refused) and before wrapping the model (DDP, FSDP).

    Raises ``ValueError`` (unknown method, bad parameters, blocks of different head shapes) or ``TypeError`` (a
    model or block this cannot convert) before anything is changed.
    """
    where = type(model).__name__
    choice = resolve_timm_attention(attention, attention_cfg, pid, where=where)
    if isinstance(model, FAN):
        _convert_fan(model, choice)
        return model
    _check_vit(model, choice)
    if choice is None:
        _to_stock(model)
    else:
        _to_method(model, choice)
    return model


# ------------------------------------------------------------------------------------------------------- ViT
def _check_vit(model: nn.Module, choice: Optional[MethodChoice]) -> None:
    """Refuse what cannot be converted, before anything changes."""
    kind = type(model)
    if kind in _VIT_CLASSES:
        require(*VIT)  # what the method classes compute again
    else:
        hint = ("; convert the model before torch.compile" if hasattr(model, "_orig_mod")
                else "; for other architectures build the model by name (pid_plugins.list_models(zoo='timm'))")
        raise TypeError(
            f"convert: timm VisionTransformer / VisionTransformerDistilled (DeiT, ViT), a PID model built by name or "
            f"a FAN, got {kind.__name__}{hint}"
        )
    shapes = set()
    for i, blk in enumerate(model.blocks):
        attn = getattr(blk, "attn", None)
        if (type(blk), type(attn)) not in ((Block, Attention), (PIDBlock, PIDAttention)):
            raise TypeError(
                f"convert: {kind.__name__} needs timm's standard Block + Attention blocks; block {i} is "
                f"{type(blk).__name__} with {type(attn).__name__} attention. Build the model with the default "
                "block_fn and attn_layer"
            )
        shapes.add((attn.num_heads, attn.head_dim))
    if choice is not None and len(shapes) > 1:
        raise ValueError(
            f"convert: attention {choice.method.name!r} hands each layer's values to the next, so all blocks need "
            f"one (num_heads, head_dim); this {kind.__name__}'s blocks have {sorted(shapes)}"
        )


def _to_method(model: nn.Module, choice: MethodChoice) -> None:
    """Stock (or method) ViT -> the PID classes with ``choice``: class swaps, then what the PID ``__init__`` sets."""
    for module in (model, *model.blocks, *(blk.attn for blk in model.blocks)):
        module.__class__ = _TO_METHOD.get(type(module), type(module))
    for blk in model.blocks:
        blk.attn.set_attention(choice, blk.attn.qkv.weight)
        settle_submodule(blk.attn, "attention_params")
    model._set_model_attention(choice)
    settle_submodule(model, "attention_warmup")


def _to_stock(model: nn.Module) -> None:
    """(Method) ViT -> timm's own classes, with everything pid-plugins added removed."""
    for blk in model.blocks:
        strip_attributes(blk.attn, LAYER_ATTRIBUTES)
        blk.attn.__class__ = _TO_STOCK.get(type(blk.attn), type(blk.attn))
        blk.__class__ = _TO_STOCK.get(type(blk), type(blk))
    if isinstance(model, _PIDViTMixin):
        strip_attributes(model, MODEL_ATTRIBUTES)
    model.__class__ = _TO_STOCK.get(type(model), type(model))


# ------------------------------------------------------------------------------------------------------- FAN
def _convert_fan(model: FAN, choice: Optional[MethodChoice]) -> None:
    """FAN keeps its class: every FAN block's token mixing and the model switch to ``choice`` (None: softmax)."""
    require(*FAN_INTERNALS)
    for blk in model.blocks:
        blk.attn.set_attention(choice, blk.attn.q.weight)
        settle_submodule(blk.attn, "attention_params")
    number_layers(blk.attn for blk in model.blocks)
    model.set_model_method(choice, next(model.parameters()), where=type(model).__name__)
    settle_submodule(model, "attention_warmup")

