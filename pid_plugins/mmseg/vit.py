"""Attention methods in mmseg's ViT backbone (Segmenter): :class:`PIDTransformerEncoderLayer` replaces each
encoder layer (same parameter names); :class:`PIDVisionTransformer` threads the method's state through them."""
from __future__ import annotations

import math
from functools import partial
from typing import Any, Callable, Dict, Optional, Tuple

import torch
import torch.nn.functional as F
import torch.utils.checkpoint as cp
from torch import Tensor, nn
from mmengine.logging import print_log
from mmengine.model import ModuleList
from mmseg.models.backbones.vit import TransformerEncoderLayer, VisionTransformer
from mmseg.registry import MODELS

from ..core import (AttentionContext, LayerCall, MethodChoice, StockPath, check_keys, resolve_attention,
                   unwrap_state_dict)
from ..core.layer import (
    LAYER_ATTRIBUTES, MethodLayer, MethodModel, number_layers, replace_module, settle_submodule, strip_attributes,
)
from .checkpoint import load_checkpoint

__all__ = ["PIDVisionTransformer", "PIDTransformerEncoderLayer", "timm_vit_to_mmseg", "initial_learned_state"]


def _choose(attention: str, attention_cfg: Any, where: str) -> Optional[MethodChoice]:
    """:func:`~pid_plugins.core.resolve_attention` for mmseg."""
    return resolve_attention(attention, attention_cfg, zoo="mmseg", where=where)


#: how to run an mmseg method layer with its state, named in core's MissingLayerState
STATE_ROUTE = ("With mmseg, run the layers through the backbone's (or the decode head's) own forward, which threads "
               "the state: x, state = layer(x, method_state=state, warmup_scale=scale), state None at the group's "
               "first layer only.")


def _switch_layers(layers: ModuleList, choice: Optional[MethodChoice]) -> None:
    """Switch ``layers`` to ``choice`` in place (mmseg's own layers for softmax)."""
    stock = choice is None or choice.method.is_identity(choice.config)
    for index in range(len(layers)):
        name = str(index)
        if stock:
            if type(layers[index]) is PIDTransformerEncoderLayer:
                strip_attributes(replace_module(layers, name, TransformerEncoderLayer), LAYER_ATTRIBUTES)
        else:
            layer = replace_module(layers, name, PIDTransformerEncoderLayer)
            layer.set_attention(choice, layer.attn.attn.in_proj_weight)
            settle_submodule(layer, "attention_params")
    if not stock:
        number_layers(layers)


def _check_layers(layers: ModuleList, where: str) -> None:
    """Refuse layers :func:`_switch_layers` cannot switch (before anything changes)."""
    for i, layer in enumerate(layers):
        if type(layer) not in (TransformerEncoderLayer, PIDTransformerEncoderLayer):
            raise TypeError(f"{where} layer {i} is {type(layer).__name__}; mmseg's TransformerEncoderLayer (and "
                            "PIDTransformerEncoderLayer) layers switch only")


class PIDTransformerEncoderLayer(MethodLayer, TransformerEncoderLayer):
    """mmseg's encoder layer with an attention method; ``forward(x, state, scale) -> (x, state)``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("PIDTransformerEncoderLayer is not built directly: PIDVisionTransformer and "
                        "PIDSegmenterMaskTransformerHead (type=... in a config) or pid_plugins.mmseg.convert replace "
                        "mmseg's layers with it")

    def _attention(self, x: Tensor, state: Optional[tuple], scale: Optional[Tensor]) -> Tuple[Tensor, tuple]:
        """The layer's attention under its method, projected."""
        a, (B, N, C) = self.attn, x.shape
        mha, heads = a.attn, a.attn.num_heads  # torch.nn.MultiheadAttention
        dropout_p = mha.dropout if self.training else 0.0
        context = AttentionContext(dropout=dropout_p > 0)

        def project_term(term: Tensor) -> Tensor:
            return F.linear(term.transpose(1, 2).reshape(B, N, C), mha.out_proj.weight)

        if scale is not None:
            def stock() -> Tensor:
                q = x.transpose(0, 1) if a.batch_first else x
                out = mha(query=q, key=q, value=q, attn_mask=None, key_padding_mask=None)[0]
                return out.transpose(0, 1) if a.batch_first else out

            v = F.linear(x, mha.in_proj_weight[2 * C:], None if mha.in_proj_bias is None else mha.in_proj_bias[2 * C:])
            call = LayerCall(None, None, None, v.reshape(B, N, heads, C // heads).transpose(1, 2), context=context,
                             scale=scale, stock=StockPath(stock, project_term), layer=self.layer_index,
                             state_route=STATE_ROUTE)
            return self.apply_method(call, state)
        qkv = F.linear(x, mha.in_proj_weight, mha.in_proj_bias)
        q, k, v = qkv.reshape(B, N, 3, heads, C // heads).permute(2, 0, 3, 1, 4).unbind(0)

        def attend(query: Tensor, value: Tensor) -> Tensor:
            return F.scaled_dot_product_attention(query, k, value, attn_mask=None, dropout_p=dropout_p,
                                                  is_causal=False, scale=None)

        def project(out: Tensor) -> Tensor:
            return mha.out_proj(out.transpose(1, 2).reshape(B, N, C))

        return self.apply_method(LayerCall(attend, q, v, v, context=context, project=project, layer=self.layer_index,
                                           state_route=STATE_ROUTE), state)

    def forward(self, x: Tensor, method_state: Optional[tuple] = None,  # type: ignore[override]
                warmup_scale: Optional[Tensor] = None) -> Tuple[Tensor, Optional[tuple]]:
        """``method_state``: the previous layer's (None first); ``warmup_scale``: this forward's (None: no warm-up)."""
        method = self.attention_method

        def inner(x: Tensor, *state_tensors: Optional[Tensor]) -> Tuple[Optional[Tensor], ...]:
            out, new_state = self._attention(self.norm1(x), state_tensors or None, warmup_scale)
            x = x + self.attn.dropout_layer(self.attn.proj_drop(out))
            return (self.ffn(self.norm2(x), identity=x), *new_state)

        args = tuple(method_state) if method_state is not None else ()
        if self.with_cp and x.requires_grad:
            outputs = cp.checkpoint(inner, x, *args, use_reentrant=False)
        else:
            outputs = inner(x, *args)
        return outputs[0], method.make_state(*outputs[1:])

    def extra_repr(self) -> str:
        return f"attention={self.attention_method.name!r}, config={self.attention_config}"


def initial_learned_state(model: nn.Module) -> Dict[str, Tensor]:
    """The learnable method parameters of ``model``'s layers at their initial values, by ``state_dict`` name."""
    out: Dict[str, Tensor] = {}
    for name, layer in model.named_modules():
        gains = getattr(layer, "attention_params", None)
        if isinstance(layer, PIDTransformerEncoderLayer) and gains is not None:
            fresh = layer.attention_method.make_learned(layer.attention_config)
            like = next(gains.parameters(), None)
            for key, value in fresh.state_dict().items():
                if like is not None and value.is_floating_point():
                    value = value.to(device=like.device, dtype=like.dtype)
                out[f"{name}.attention_params.{key}" if name else f"attention_params.{key}"] = value
    return out


def timm_vit_to_mmseg(state_dict: Dict[str, Tensor]) -> Dict[str, Tensor]:
    """timm ViT/DeiT parameter names -> mmseg ``VisionTransformer`` names, as mmseg's ``vit2mmseg``."""
    out: Dict[str, Tensor] = {}
    for key, value in state_dict.items():
        if key.startswith(("head", "fc_norm", "head_dist", "dist_token")):
            continue
        new = key
        if key.startswith("norm."):
            new = "ln1." + key[len("norm."):]
        elif key.startswith("patch_embed.proj"):
            new = key.replace("patch_embed.proj", "patch_embed.projection")
        elif key.startswith("blocks."):
            new = key.replace("blocks.", "layers.", 1)
            new = (new.replace(".norm1.", ".ln1.").replace(".norm2.", ".ln2.")
                   .replace(".mlp.fc1.", ".ffn.layers.0.0.").replace(".mlp.fc2.", ".ffn.layers.1.")
                   .replace(".attn.qkv.", ".attn.attn.in_proj_").replace(".attn.proj.", ".attn.attn.out_proj.")
                   .replace(".attn.attention_params.", ".attention_params."))
        out[new] = value
    return out


@MODELS.register_module()
class PIDVisionTransformer(MethodModel, VisionTransformer):
    """mmseg's ``VisionTransformer`` with an attention method (``attention='pid'``, ``attention_cfg=``) in its
    encoder layers (one group)."""

    def __init__(self, *args: Any, attention: str = "pid", attention_cfg: Any = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        where = "mmseg backbone PIDVisionTransformer"
        self._configure_attention(_choose(attention, attention_cfg, where), where)

    def _configure_attention(self, choice: Optional[MethodChoice], where: str) -> None:
        configure_attention(self, choice, self.pos_embed, where)

    def init_weights(self) -> None:
        cfg = self.init_cfg
        if not (isinstance(cfg, dict) and cfg.get("type") == "Pretrained"):
            return super().init_weights()
        source = f"checkpoint {cfg['checkpoint']!r}"
        state_dict = unwrap_state_dict(load_checkpoint(cfg["checkpoint"], map_location="cpu"), source)
        heads = sorted({k.split(".", 1)[0] for k in state_dict if k.startswith(("decode_head.", "auxiliary_head."))})
        if heads:
            raise ValueError(f"{source} is a whole segmentor (backbone. and {', '.join(heads)}. keys), not a backbone: "
                             "load it with load_from=PATH (or tools/test.py PATH); backbone init_cfg takes a "
                             "backbone, mmseg ViT or timm ViT/DeiT checkpoint")
        state_dict = {k[len("backbone."):] if k.startswith("backbone.") else k: v for k, v in state_dict.items()}
        if any(k.startswith("blocks.") for k in state_dict):
            state_dict = timm_vit_to_mmseg(state_dict)
        # pretrained weights start a new training run: its warm-up starts at t = 0, whatever the checkpoint's was
        state_dict.pop("attention_warmup.step", None)
        if self.attention_warmup is not None:
            state_dict["attention_warmup.step"] = torch.zeros_like(self.attention_warmup.step)
        if "pos_embed" in state_dict and state_dict["pos_embed"].shape != self.pos_embed.shape:
            h, w = self.img_size
            pos_size = int(math.sqrt(state_dict["pos_embed"].shape[1] - 1))
            print_log(f"resize pos_embed {tuple(state_dict['pos_embed'].shape)} -> {tuple(self.pos_embed.shape)}")
            state_dict["pos_embed"] = self.resize_pos_embed(
                state_dict["pos_embed"], (h // self.patch_size, w // self.patch_size), (pos_size, pos_size),
                self.interpolate_mode)
        expected = self.state_dict()
        for name, value in initial_learned_state(self).items():
            state_dict.setdefault(name, value)
        hint = ("mmseg ViT checkpoints and timm ViT/DeiT checkpoints of the same size load; check "
                "embed_dims/num_layers/num_heads")
        if "patch_embed.projection.bias" in set(state_dict) - set(expected):
            hint = ("timm ViT/DeiT checkpoints have a patch-embedding bias and mmseg's ViT default has none: "
                    "set backbone patch_bias=True")
        elif "patch_embed.projection.bias" in set(expected) - set(state_dict):
            hint = "this checkpoint has no patch-embedding bias: set backbone patch_bias=False"
        check_keys(expected, state_dict, f"PIDVisionTransformer ({source})", hint)
        self.load_state_dict(state_dict, strict=True)

    def forward(self, inputs: Tensor) -> Tuple[Any, ...]:
        return method_forward(self, inputs, super().forward)

    def _output(self, x: Tensor, hw_shape: Tuple[int, int]) -> Any:
        return _output(self, x, hw_shape)


def configure_attention(model: nn.Module, choice: Optional[MethodChoice], like: Tensor, where: str) -> None:
    """Hold ``choice`` (None: softmax) on a backbone or head (a stock one too) and switch its layers, in place."""
    MethodModel.set_model_method(model, choice, like, stock_plus_term=True, where=where)
    settle_submodule(model, "attention_warmup")
    _switch_layers(model.layers, choice)


def _output(model: VisionTransformer, x: Tensor, hw_shape: Tuple[int, int]) -> Any:
    out = x[:, 1:] if model.with_cls_token else x
    B, _, C = out.shape
    out = out.reshape(B, hw_shape[0], hw_shape[1], C).permute(0, 3, 1, 2).contiguous()
    return [out, x[:, 0]] if model.output_cls_token else out


def method_forward(model: VisionTransformer, inputs: Tensor, stock_forward: Callable[[Tensor], Tuple[Any, ...]]
                   ) -> Tuple[Any, ...]:
    """The forward of a backbone with a method: the method's state threaded through the layers."""
    scale = MethodModel.method_scale(model)  # one warm-up step per forward (outside the checkpointed layers)
    if not MethodModel.method_active.fget(model):
        return stock_forward(inputs)
    B = inputs.shape[0]
    x, hw_shape = model.patch_embed(inputs)
    x = torch.cat((model.cls_token.expand(B, -1, -1), x), dim=1)
    x = model._pos_embeding(x, hw_shape, model.pos_embed)
    if not model.with_cls_token:
        x = x[:, 1:]
    if model.pre_norm:
        x = model.pre_ln(x)
    outs = []
    if model.out_origin:
        outs.append(_output(model, x, hw_shape))
    state: Optional[tuple] = None
    for i, layer in enumerate(model.layers):
        x, state = layer(x, method_state=state, warmup_scale=scale)
        if i == len(model.layers) - 1 and model.final_norm:
            x = model.norm1(x)
        if i in model.out_indices:
            outs.append(_output(model, x, hw_shape))
    return tuple(outs)


def bare_forward(model: VisionTransformer, inputs: Tensor) -> Tuple[Any, ...]:
    """The forward :func:`~pid_plugins.mmseg.convert` binds to a bare stock backbone: the method backbone's."""
    return method_forward(model, inputs, partial(VisionTransformer.forward, model))
