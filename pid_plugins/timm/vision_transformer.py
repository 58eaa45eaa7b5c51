"""PID ViT / DeiT for timm (any method): :class:`MethodBlocks` threads the method's state between the blocks."""
from __future__ import annotations

import warnings
from functools import partial
from typing import Any, Dict, List, Optional, Set, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from timm.layers import Attention, maybe_add_mask, resolve_self_attn_mask
from timm.models import build_model_with_cfg, get_pretrained_cfg
from timm.models.deit import VisionTransformerDistilled
from timm.models.vision_transformer import Block, VisionTransformer
from timm.models.vision_transformer import checkpoint_filter_fn as _vit_checkpoint_filter_fn

from .internals import BLOCK, BUILD_MODEL_WITH_CFG, FEATURE_TAKE_INDICES, VIT, VIT_CHECKPOINT_FILTER, require

FEATURE_TAKE_INDICES.require()  # a private module of timm, read from here on
from timm.models._features import feature_take_indices  # noqa: E402

from ..catalogue import ModelEntry  # noqa: E402
from ..core import GainWarmup, MethodChoice, resolve_attention  # noqa: E402
from ..core.layer import MethodModel, number_layers, replace_module  # noqa: E402
from ._helpers import (  # noqa: E402
    MethodLayer, catalogue_entries, check_pretrained_source, entry_choice, finish_state_dict,
    register_entries, run_blocks, state_outputs,
)

__all__ = ["PIDAttention", "PIDBlock", "PIDVisionTransformer", "PIDVisionTransformerDistilled", "MethodBlocks",
           "checkpoint_filter_fn"]

class PIDAttention(MethodLayer, Attention):
    """timm's ``Attention`` with the method's step before ``proj``: ``forward(x, state) -> (y, new_state)``."""

    def __init__(self, *args: Any, choice: Optional[MethodChoice] = None, **kwargs: Any) -> None:
        BLOCK.require()
        super().__init__(*args, **kwargs)
        self.set_attention(choice, self.qkv.weight)

    def _attend(self, q: Tensor, v: Tensor, *, k: Tensor, attn_mask: Optional[Tensor], is_causal: bool) -> Tensor:
        """timm's ``Attention``: ``softmax(q k^T * scale) v`` per head, fused or in timm's order of operations."""
        if self.fused_attn:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal,
                                                  dropout_p=self.attn_drop.p if self.training else 0.0)
        scores = (q * self.scale) @ k.transpose(-2, -1)
        scores = maybe_add_mask(scores, resolve_self_attn_mask(q.shape[-2], scores, attn_mask, is_causal))
        return self.attn_drop(scores.softmax(dim=-1)) @ v

    def forward(self, x: Tensor, state: Optional[Tuple[Any, ...]] = None, attn_mask: Optional[Tensor] = None,
                is_causal: bool = False, warmup_scale: Optional[Tensor] = None) -> Tuple[Tensor, Optional[tuple]]:
        B, N, _ = x.shape
        gate = self.gate(x).sigmoid() if self.gate is not None else None
        q, k, v = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        q, k = self.q_norm(q), self.k_norm(k)
        out, state = self.method_attention(
            partial(self._attend, k=k, attn_mask=attn_mask, is_causal=is_causal), q, v, state, warmup_scale,
            is_causal,
        )
        out = self.norm(out.transpose(1, 2).reshape(B, N, self.attn_dim))
        if gate is not None:
            out = out * gate
        return self.proj_drop(self.proj(out)), state


class PIDBlock(Block):
    """timm's pre-norm ``Block`` with :class:`PIDAttention`: ``forward(x, *state, ...)`` returns ``(x, *new_state)``."""

    attn: PIDAttention

    def __init__(self, *args: Any, choice: Optional[MethodChoice] = None, **kwargs: Any) -> None:
        BLOCK.require()
        kwargs["attn_layer"] = PIDAttention
        super().__init__(*args, **kwargs)
        self.attn.set_attention(choice, self.attn.qkv.weight)

    def forward(
        self, x: Tensor, *state: Tensor, attn_mask: Optional[Tensor] = None, is_causal: bool = False,
        warmup_scale: Optional[Tensor] = None, with_state: bool = False,
    ) -> Union[Tensor, Tuple[Tensor, ...]]:
        y, new_state = self.attn(self.norm1(x), state if state else None, attn_mask=attn_mask, is_causal=is_causal,
                                 warmup_scale=warmup_scale)
        state = state_outputs(new_state, self.attn.state_size)
        x = x + self.drop_path1(self.ls1(y))
        x = x + self.drop_path2(self.ls2(self.mlp(self.norm2(x))))
        return (x,) + state if with_state else x


class MethodBlocks(nn.Sequential):
    """``model.blocks`` of a ViT/DeiT with a method: the same blocks and keys, threading the method's state."""

    warmup_counter: Optional[GainWarmup]

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.hold_warmup(None)

    def hold_warmup(self, counter: Optional[GainWarmup]) -> None:
        """Read the warm-up scale from ``counter`` (None: no warm-up), held as a plain reference."""
        self.__dict__["warmup_counter"] = counter

    def __getitem__(self, idx: Union[slice, int]) -> Any:
        out = super().__getitem__(idx)
        if isinstance(out, MethodBlocks):  # a slice (timm's stop_early, prune_intermediate_layers): the same counter
            out.hold_warmup(self.warmup_counter)
        return out

    def run(self, x: Tensor, attn_mask: Optional[Tensor] = None, is_causal: bool = False, checkpointed: bool = False,
            take_indices: Optional[List[int]] = None, norm: Optional[nn.Module] = None) -> Tuple[Tensor, List[Tensor]]:
        if isinstance(is_causal, Tensor):  # the bool SDPA takes, read once under torch.onnx's TorchScript exporter
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", torch.jit.TracerWarning)
                is_causal = bool(is_causal)
        use_checkpoint = checkpointed and attn_mask is None and not is_causal
        kwargs: Dict[str, Any] = dict(with_state=True)
        if not use_checkpoint:
            kwargs.update(attn_mask=attn_mask, is_causal=is_causal)
        counter = self.warmup_counter  # one warm-up step per forward of the model, outside any checkpointed block
        return run_blocks(self, x, (), use_checkpoint, take_indices, norm,
                          warmup_scale=counter() if counter is not None else None, **kwargs)

    def forward(self, x: Tensor, attn_mask: Optional[Tensor] = None, is_causal: bool = False,
                checkpointed: bool = False) -> Tensor:
        return self.run(x, attn_mask=attn_mask, is_causal=is_causal, checkpointed=checkpointed)[0]


class _MethodViTMixin(MethodModel):
    """Overrides of ``VisionTransformer`` that run every path through :class:`MethodBlocks`."""

    blocks: MethodBlocks
    grad_checkpointing: bool

    def __init__(self, *args: Any, attention: str = "pid", attention_cfg: Any = None, **kwargs: Any) -> None:
        require(*VIT)
        choice = resolve_attention(attention, attention_cfg, zoo="timm", where=type(self).__name__)
        block_fn = kwargs.pop("block_fn", None)
        if block_fn not in (None, Block, PIDBlock):
            raise ValueError(f"PID ViT builds its own blocks (PIDBlock); block_fn={block_fn!r} is not supported")
        attn_layer = kwargs.pop("attn_layer", None)
        if attn_layer not in (None, "attn", Attention, PIDAttention):
            raise ValueError(f"PID ViT computes its attention with PIDAttention (timm's Attention plus the method's "
                             f"step); attn_layer={attn_layer!r} is not supported. Use attention='softmax' for the "
                             "stock model, or build the stock timm model with that attn_layer")
        super().__init__(*args, block_fn=partial(PIDBlock, choice=choice), **kwargs)
        replace_module(self, "blocks", MethodBlocks)  # timm's nn.Sequential of the blocks, as the method's group
        self.set_vit_method(choice)

    def set_vit_method(self, choice: Optional[MethodChoice]) -> None:
        self.set_model_method(choice, next(self.parameters()), where=type(self).__name__)
        self.blocks.hold_warmup(self.attention_warmup)
        number_layers(blk.attn for blk in self.blocks)

    @torch.jit.ignore
    def no_weight_decay(self) -> Set[str]:
        names = set(super().no_weight_decay())
        names.update(n for n, _ in self.named_parameters() if ".attention_params." in n)
        return names

    def forward_features(self, x: Tensor, attn_mask: Optional[Tensor] = None, is_causal: bool = False) -> Tensor:
        x = self.norm_pre(self.patch_drop(self._pos_embed(self.patch_embed(x))))
        x = self.blocks(x, attn_mask=attn_mask, is_causal=is_causal, checkpointed=self.grad_checkpointing)
        return self.norm(x)

    def forward_intermediates(
        self, x: Tensor, indices: Optional[Union[int, List[int]]] = None, return_prefix_tokens: bool = False,
        norm: bool = False, stop_early: bool = False, output_fmt: str = "NCHW", intermediates_only: bool = False,
        output_dict: bool = False, attn_mask: Optional[Tensor] = None, is_causal: bool = False,
    ) -> Union[List[Tensor], Tuple[Tensor, List[Tensor]], Dict[str, Any]]:
        if output_fmt not in ("NCHW", "NLC"):
            raise ValueError(f"output_fmt must be 'NCHW' or 'NLC', got {output_fmt!r}")
        take_indices, max_index = feature_take_indices(len(self.blocks), indices)
        B, _, height, width = x.shape
        x = self.norm_pre(self.patch_drop(self._pos_embed(self.patch_embed(x))))
        blocks = self.blocks[: max_index + 1] if stop_early else self.blocks
        x, intermediates = blocks.run(x, attn_mask=attn_mask, is_causal=is_causal,
                                      checkpointed=self.grad_checkpointing, take_indices=take_indices,
                                      norm=self.norm if norm else None)
        prefix_tokens: Optional[List[Tensor]] = None
        if self.num_prefix_tokens:
            prefix_tokens = [y[:, : self.num_prefix_tokens] for y in intermediates]
            intermediates = [y[:, self.num_prefix_tokens:] for y in intermediates]
        if output_fmt == "NCHW":
            H, W = self.patch_embed.dynamic_feat_size((height, width))
            intermediates = [y.reshape(B, H, W, -1).permute(0, 3, 1, 2).contiguous() for y in intermediates]
        if output_dict:
            result: Dict[str, Any] = {"image_intermediates": intermediates}
            if prefix_tokens is not None and return_prefix_tokens:
                result["image_intermediates_prefix"] = prefix_tokens
            if not intermediates_only:
                result["image_features"] = self.norm(x)
            return result
        if return_prefix_tokens and prefix_tokens is not None:
            intermediates = list(zip(intermediates, prefix_tokens))
        if intermediates_only:
            return intermediates
        return self.norm(x), intermediates


class PIDVisionTransformer(_MethodViTMixin, VisionTransformer):
    """timm ``VisionTransformer`` with a method in every block (``attention=``, ``attention_cfg=``)."""


class PIDVisionTransformerDistilled(_MethodViTMixin, VisionTransformerDistilled):
    """DeiT's distilled ``VisionTransformerDistilled`` (class + distillation token) with PID attention."""


_MODEL_CLASSES = {"vit": PIDVisionTransformer, "vit_distilled": PIDVisionTransformerDistilled}


def checkpoint_filter_fn(state_dict: Dict[str, Tensor], model: VisionTransformer, **kwargs: Any) -> Dict[str, Tensor]:
    """Adapt a (softmax or PID) ViT/DeiT checkpoint to ``model``, filling in learnable gains it lacks."""
    VIT_CHECKPOINT_FILTER.require()
    out = _vit_checkpoint_filter_fn(state_dict, model, **kwargs)
    return finish_state_dict(
        out, model, "A softmax checkpoint of the same timm architecture (e.g. deit_tiny_patch16_224 for "
        "pid_deit_tiny_patch16_224) loads unchanged; a distilled checkpoint needs a *_distilled_* model",
    )


def _create(entry: ModelEntry, name: str, default_attention: str, pretrained: bool = False,
            **kwargs: Any) -> VisionTransformer:
    if pretrained:  # refused before anything is built
        check_pretrained_source(name, entry.base, kwargs)
    require(BUILD_MODEL_WITH_CFG, VIT_CHECKPOINT_FILTER, *VIT)
    choice = entry_choice(entry, default_attention, kwargs, name)
    out_indices = kwargs.pop("out_indices", 3)
    model_args = {**entry.kwargs, **kwargs}
    return build_model_with_cfg(
        _MODEL_CLASSES[entry.arch], name, pretrained,
        pretrained_filter_fn=partial(checkpoint_filter_fn, adapt_layer_scale=True),
        feature_cfg=dict(out_indices=out_indices, feature_cls="getter"),
        attention=choice.method.name if choice is not None else "softmax",
        attention_cfg=choice.config if choice is not None else None,
        **model_args,
    )


def _pretrained_cfg(entry: ModelEntry) -> Dict[str, Any]:
    base = get_pretrained_cfg(entry.base)
    cfg = base.to_dict() if base is not None else {}
    for key in ("url", "hf_hub_id", "hf_hub_filename", "file", "state_dict", "source", "architecture", "tag"):
        cfg.pop(key, None)
    if entry.arch == "vit_distilled":
        cfg["classifier"] = ("head", "head_dist")
    cfg.update(notes=(f"PID variant of {entry.base}; no bundled weights: set `file` to a local checkpoint",))
    return cfg


register_entries(__name__, catalogue_entries(_MODEL_CLASSES), _create, _pretrained_cfg)
