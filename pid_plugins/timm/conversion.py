"""``convert(model, attention, attention_cfg)``: switch a built timm ViT/DeiT or FAN's attention, in place."""
from __future__ import annotations

from functools import partial
from typing import Any, Optional, TypeVar

from torch import nn
from timm.layers import Attention
from timm.models.deit import VisionTransformerDistilled
from timm.models.vision_transformer import Block, VisionTransformer

from ..core import MethodChoice, method_warmup, resolve_attention
from ..core.record import RECORD, attach_record
from ..core.layer import (
    LAYER_ATTRIBUTES, MethodModel, number_layers, register_warmup_finisher, replace_module, settle_submodule,
    strip_attributes, warn_switch_of_trained_weights, warn_unfinished_warmup,
)
from .fan import FAN
from .internals import FAN as FAN_INTERNALS, VIT, require
from .vision_transformer import MethodBlocks, PIDAttention, PIDBlock, _MethodViTMixin

__all__ = ["convert"]

ModelT = TypeVar("ModelT", bound=nn.Module)


def convert(model: ModelT, attention: str, attention_cfg: Any = None) -> ModelT:
    """Switch a timm ViT/DeiT (standard ``Block`` and ``Attention``) or FAN to ``attention`` (a method's name or
    ``"softmax"``, timm's own classes back) with ``attention_cfg``, in place; returns ``model``. Convert before
    ``torch.compile`` and wrapping; refusals come before anything changes."""
    where = type(model).__name__
    choice = resolve_attention(attention, attention_cfg, zoo="timm", where=where)
    if not isinstance(model, FAN):
        _check_vit(model, choice)
    warn_switch_of_trained_weights(model, choice, where, current=model.blocks[0].attn if len(model.blocks) else None)
    if isinstance(model, FAN):
        _convert_fan(model, choice)
    elif choice is None and not isinstance(model, _MethodViTMixin):
        _to_stock(model)
    else:
        _to_method(model, choice)
    return model


def _check_vit(model: nn.Module, choice: Optional[MethodChoice]) -> None:
    kind = type(model)
    if isinstance(model, (VisionTransformer, VisionTransformerDistilled)) and (
            kind in (VisionTransformer, VisionTransformerDistilled) or isinstance(model, _MethodViTMixin)):
        require(*VIT)
    else:
        hint = ("; convert the model before torch.compile" if hasattr(model, "_orig_mod")
                else "; for other architectures build the model by name (pid_plugins.list_models(zoo='timm'))")
        raise TypeError(f"convert: timm VisionTransformer / VisionTransformerDistilled (DeiT, ViT), a PID model "
                        f"built by name or a FAN, got {kind.__name__}{hint}")
    if type(model.blocks) not in (nn.Sequential, MethodBlocks):
        raise TypeError(f"convert: {kind.__name__}.blocks is a {type(model.blocks).__name__}, not timm's "
                        "nn.Sequential of blocks")
    shapes = set()
    for i, blk in enumerate(model.blocks):
        attn = getattr(blk, "attn", None)
        if (type(blk), type(attn)) not in ((Block, Attention), (PIDBlock, PIDAttention)):
            raise TypeError(f"convert: {kind.__name__} needs timm's standard Block + Attention blocks; block {i} is "
                            f"{type(blk).__name__} with {type(attn).__name__} attention. Build the model with the "
                            "default block_fn and attn_layer")
        shapes.add((attn.num_heads, attn.head_dim))
    if choice is not None and len(shapes) > 1:
        raise ValueError(f"convert: attention {choice.method.name!r} hands each layer's values to the next, so all "
                         f"blocks need one (num_heads, head_dim); this {kind.__name__}'s blocks have {sorted(shapes)}")


def _to_method(model: nn.Module, choice: Optional[MethodChoice]) -> None:
    """(Stock or method) ViT -> :class:`MethodBlocks` of PID blocks with ``choice``; the root keeps its class."""
    blocks = replace_module(model, "blocks", MethodBlocks)
    for key in list(blocks._modules):
        replace_module(blocks._modules[key], "attn", PIDAttention)
        blk = replace_module(blocks, key, PIDBlock)
        blk.attn.set_attention(choice, blk.attn.qkv.weight)
        settle_submodule(blk.attn, "attention_params")
    if isinstance(model, MethodModel):
        model.set_vit_method(choice)
        settle_submodule(model, "attention_warmup")
        return
    number_layers(blk.attn for blk in blocks)
    previous = model._modules.get("attention_warmup")
    counter = method_warmup(choice, next(model.parameters()), previous, where=type(model).__name__)
    strip_attributes(model, ("attention_warmup",))
    if counter is not None:
        counter.train(model.training)
        model.add_module("attention_warmup", counter)
    blocks.hold_warmup(counter)
    attach_record(model, choice, next(model.parameters()))  # what its checkpoints say they are
    for name in ROOT_PATHS:  # the root's loops over the blocks: the method classes' ones
        model.__dict__[name] = partial(getattr(_MethodViTMixin, name), model)


ROOT_PATHS = ("forward_features", "forward_intermediates")


def _to_stock(model: nn.Module) -> None:
    """Converted stock ViT -> timm's own classes, with everything pid-plugins added removed."""
    blocks = model.blocks
    if type(blocks) is MethodBlocks:
        strip_attributes(blocks, ("warmup_counter",))
        blocks = replace_module(model, "blocks", nn.Sequential)
    for key in list(blocks._modules):
        blk = blocks._modules[key]
        strip_attributes(blk.attn, LAYER_ATTRIBUTES)
        replace_module(blk, "attn", Attention)
        replace_module(blocks, key, Block)
    strip_attributes(model, ("attention_warmup", RECORD) + ROOT_PATHS)


def _convert_fan(model: FAN, choice: Optional[MethodChoice]) -> None:
    """FAN keeps its class: every FAN block's token mixing and the model switch to ``choice`` (None: softmax)."""
    require(*FAN_INTERNALS)
    for blk in model.blocks:
        blk.attn.set_attention(choice, blk.attn.q.weight)
        settle_submodule(blk.attn, "attention_params")
    number_layers(blk.attn for blk in model.blocks)
    model.set_model_method(choice, next(model.parameters()), where=type(model).__name__)
    settle_submodule(model, "attention_warmup")


def _finish(model: nn.Module) -> bool:
    """:func:`~pid_plugins.core.finish_warmup` for the blocks containers and a converted stock root."""
    found = False
    for owner in model.modules():
        blocks = owner._modules.get("blocks")
        if not isinstance(blocks, MethodBlocks):
            continue
        found = True
        counter = blocks.warmup_counter
        if counter is None:
            continue
        if not isinstance(owner, MethodModel):  # a converted stock root: the counter is its submodule
            warn_unfinished_warmup(counter, type(owner).__name__)
            strip_attributes(owner, ("attention_warmup",))
        blocks.hold_warmup(None)
    return found


register_warmup_finisher(_finish)
