"""FAN (Fully Attentional Networks, Zhou et al., ICML 2022), ViT variant, as timm models (``fan_*`` softmax,
``pid_fan_*``): the method is the FAN blocks' token mixing; class attention stays softmax."""
from __future__ import annotations

import math
from functools import partial
from typing import Any, Dict, List, Optional, Set, Tuple, Type, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.layers import DropPath, get_act_layer, get_norm_layer, trunc_normal_, use_fused_attn
from timm.models import build_model_with_cfg
from timm.models.xcit import LPI, ClassAttentionBlock, ConvPatchEmbed, PositionalEncodingFourier
from timm.models.xcit import checkpoint_filter_fn as _xcit_checkpoint_filter_fn

from .internals import BUILD_MODEL_WITH_CFG, CHECKPOINT, FAN as FAN_INTERNALS, FEATURE_TAKE_INDICES, XCIT, require

require(FEATURE_TAKE_INDICES, CHECKPOINT)  # private modules of timm, read from here on
from timm.models._features import feature_take_indices  # noqa: E402
from timm.models._manipulate import checkpoint  # noqa: E402

from ..catalogue import ModelEntry  # noqa: E402
from ..core.layer import MethodModel, number_layers  # noqa: E402
from ..core import MethodChoice, resolve_attention, unwrap_state_dict  # noqa: E402
from ._helpers import (  # noqa: E402
    MethodLayer, catalogue_entries, check_pretrained_source, entry_choice, finish_state_dict,
    register_entries, run_blocks, state_outputs,
)

__all__ = ["FAN", "FANBlock", "TokenMixing", "ChannelProcessing", "checkpoint_filter_fn"]


class TokenMixing(MethodLayer, nn.Module):
    """Multi-head self-attention over the tokens, optionally with an attention method."""

    fused_attn: torch.jit.Final[bool]

    def __init__(
        self, dim: int, num_heads: int = 8, qkv_bias: bool = False, attn_drop: float = 0.0,
        proj_drop: float = 0.0, choice: Optional[MethodChoice] = None, device: Any = None, dtype: Any = None,
    ) -> None:
        super().__init__()
        dd = dict(device=device, dtype=dtype)
        if dim % num_heads:
            raise ValueError(f"dim ({dim}) must be divisible by num_heads ({num_heads})")
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.scale = self.head_dim ** -0.5
        self.fused_attn = use_fused_attn()
        self.q = nn.Linear(dim, dim, bias=qkv_bias, **dd)
        self.kv = nn.Linear(dim, dim * 2, bias=qkv_bias, **dd)
        self.attn_drop = nn.Dropout(attn_drop)
        self.proj = nn.Linear(dim, dim, **dd)
        self.proj_drop = nn.Dropout(proj_drop)
        self.set_attention(choice, self.q.weight)

    def _attend(self, q: Tensor, v: Tensor, *, k: Tensor) -> Tensor:
        """``softmax(q k^T * scale) v`` per head, fused or in the official order of operations."""
        if self.fused_attn:
            return F.scaled_dot_product_attention(q, k, v, dropout_p=self.attn_drop.p if self.training else 0.0)
        return self.attn_drop(((q * self.scale) @ k.transpose(-2, -1)).softmax(dim=-1)) @ v

    def forward(self, x: Tensor, state: Optional[Tuple[Any, ...]] = None,
                warmup_scale: Optional[Tensor] = None) -> Tuple[Tensor, Optional[tuple]]:
        B, N, C = x.shape
        q = self.q(x).reshape(B, N, self.num_heads, self.head_dim).transpose(1, 2)
        k, v = self.kv(x).reshape(B, N, 2, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        out, state = self.method_attention(partial(self._attend, k=k), q, v, state, warmup_scale)
        return self.proj_drop(self.proj(out.transpose(1, 2).reshape(B, N, C))), state


class ChannelMlp(nn.Module):
    """``fc1 -> x + gamma * DWConv(x) -> fc2``: an MLP whose hidden features get a depthwise-convolution branch."""

    def __init__(self, in_features: int, hidden_features: int, drop: float = 0.0,
                 device: Any = None, dtype: Any = None) -> None:
        super().__init__()
        dd = dict(device=device, dtype=dtype)
        self.fc1 = nn.Linear(in_features, hidden_features, **dd)
        self.dwconv = LPI(hidden_features, act_layer=nn.GELU, **dd)
        self.gamma = nn.Parameter(torch.ones(hidden_features, **dd))
        self.drop = nn.Dropout(drop)
        self.fc2 = nn.Linear(hidden_features, in_features, **dd)

    def forward(self, x: Tensor, H: int, W: int) -> Tensor:
        x = self.fc1(x)
        x = x + self.drop(self.gamma * self.dwconv(x, H, W))
        return self.drop(self.fc2(x))


class ChannelProcessing(nn.Module):
    """Attention over channels: ``a * LayerNorm(ChannelMlp(x))`` with
    ``a = sigmoid(softmax_N(q)^T @ mean_C(softmax_N(k))) * temperature`` per head.
    """

    def __init__(self, dim: int, num_heads: int = 8, qkv_bias: bool = False, attn_drop: float = 0.0,
                 mlp_hidden_dim: Optional[int] = None, drop: float = 0.0,
                 device: Any = None, dtype: Any = None) -> None:
        super().__init__()
        dd = dict(device=device, dtype=dtype)
        self.num_heads = num_heads
        self.temperature = nn.Parameter(torch.ones(num_heads, 1, 1, **dd))
        self.q = nn.Linear(dim, dim, bias=qkv_bias, **dd)
        self.mlp_v = ChannelMlp(dim, mlp_hidden_dim or dim * 4, drop=drop, **dd)
        self.norm_v = nn.LayerNorm(dim, **dd)
        self.attn_drop = nn.Dropout(attn_drop)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):  # the official init of these (depthwise) convolutions
                fan_out = m.kernel_size[0] * m.kernel_size[1] * m.out_channels // m.groups
                nn.init.normal_(m.weight, 0.0, math.sqrt(2.0 / fan_out))
                if m.bias is not None:
                    nn.init.zeros_(m.bias)

    def forward(self, x: Tensor, H: int, W: int) -> Tensor:
        B, N, C = x.shape
        hd = C // self.num_heads
        q = self.q(x).reshape(B, N, self.num_heads, hd).transpose(1, 2)          # B, h, N, hd
        k = x.reshape(B, N, self.num_heads, hd).transpose(1, 2)
        k_weights = k.softmax(dim=-2).mean(dim=-1, keepdim=True)                  # B, h, N, 1
        attn = torch.sigmoid(q.softmax(dim=-2).transpose(-1, -2) @ k_weights)    # B, h, hd, 1
        attn = self.attn_drop(attn * self.temperature)
        v = self.norm_v(self.mlp_v(x, H, W)).reshape(B, N, self.num_heads, hd).permute(0, 2, 3, 1)  # B, h, hd, N
        return (attn * v).permute(0, 3, 1, 2).reshape(B, N, C)

    @torch.jit.ignore
    def no_weight_decay(self) -> Set[str]:
        return {"temperature"}


class FANBlock(nn.Module):
    """``x += gamma1 * TokenMixing(norm1(x)); x += gamma2 * ChannelProcessing(norm2(x))``."""

    def __init__(self, dim: int, num_heads: int, mlp_ratio: float = 4.0, qkv_bias: bool = False,
                 proj_drop: float = 0.0, attn_drop: float = 0.0, drop_path: float = 0.0,
                 norm_layer: Type[nn.Module] = nn.LayerNorm, eta: float = 1.0, choice: Optional[MethodChoice] = None,
                 device: Any = None, dtype: Any = None) -> None:
        super().__init__()
        dd = dict(device=device, dtype=dtype)
        self.norm1 = norm_layer(dim, **dd)
        self.attn = TokenMixing(dim, num_heads, qkv_bias=qkv_bias, attn_drop=attn_drop, proj_drop=proj_drop,
                                choice=choice, **dd)
        self.drop_path = DropPath(drop_path) if drop_path > 0.0 else nn.Identity()
        self.norm2 = norm_layer(dim, **dd)
        self.mlp = ChannelProcessing(dim, num_heads, qkv_bias=qkv_bias, attn_drop=attn_drop,
                                     mlp_hidden_dim=int(dim * mlp_ratio), drop=proj_drop, **dd)
        self.gamma1 = nn.Parameter(eta * torch.ones(dim, **dd))
        self.gamma2 = nn.Parameter(eta * torch.ones(dim, **dd))

    def forward(self, x: Tensor, H: int, W: int, *state: Tensor,
                warmup_scale: Optional[Tensor] = None) -> Tuple[Tensor, ...]:
        y, new_state = self.attn(self.norm1(x), state if state else None, warmup_scale)
        state = state_outputs(new_state, self.attn.state_size)
        x = x + self.drop_path(self.gamma1 * y)
        x = x + self.drop_path(self.gamma2 * self.mlp(self.norm2(x), H, W))
        return (x,) + state


class FAN(MethodModel, nn.Module):
    """FAN-ViT: convolutional stem, Fourier positions, FAN blocks (token mixing: ``attention``), class attention."""

    def __init__(
        self, img_size: Union[int, Tuple[int, int]] = 224, patch_size: int = 16, in_chans: int = 3,
        num_classes: int = 1000, global_pool: str = "token", embed_dim: int = 192, depth: int = 12,
        num_heads: int = 4, mlp_ratio: float = 4.0, qkv_bias: bool = True, drop_rate: float = 0.0,
        pos_drop_rate: float = 0.0, proj_drop_rate: float = 0.0, attn_drop_rate: float = 0.0,
        drop_path_rate: float = 0.0, act_layer: Optional[Type[nn.Module]] = None,
        norm_layer: Optional[Type[nn.Module]] = None, cls_attn_layers: int = 2, use_pos_embed: bool = True,
        eta: float = 1.0, tokens_norm: bool = True, attention: str = "softmax", attention_cfg: Any = None,
        device: Any = None, dtype: Any = None,
    ) -> None:
        require(*FAN_INTERNALS)
        super().__init__()
        dd = dict(device=device, dtype=dtype)
        if global_pool not in ("", "avg", "token"):
            raise ValueError(f"global_pool must be '', 'avg' or 'token', got {global_pool!r}")
        norm_layer = get_norm_layer(norm_layer) or partial(nn.LayerNorm, eps=1e-6)
        act_layer = get_act_layer(act_layer) or nn.GELU
        choice = resolve_attention(attention, attention_cfg, zoo="timm", where=type(self).__name__)
        self.set_model_method(choice, torch.empty(0, device=device), where=type(self).__name__)
        self.num_classes = num_classes
        self.global_pool = global_pool
        self.num_features = self.head_hidden_size = self.embed_dim = embed_dim
        self.num_prefix_tokens = 1
        self.grad_checkpointing = False
        self.in_chans = in_chans
        self.patch_embed = ConvPatchEmbed(img_size=img_size, patch_size=patch_size, in_chans=in_chans,
                                          embed_dim=embed_dim, act_layer=act_layer, **dd)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim, **dd))
        self.pos_embed = PositionalEncodingFourier(dim=embed_dim, **dd) if use_pos_embed else None
        self.pos_drop = nn.Dropout(p=pos_drop_rate)
        self.blocks = nn.ModuleList(
            FANBlock(embed_dim, num_heads, mlp_ratio=mlp_ratio, qkv_bias=qkv_bias, proj_drop=proj_drop_rate,
                     attn_drop=attn_drop_rate, drop_path=drop_path_rate, norm_layer=norm_layer, eta=eta,
                     choice=choice, **dd)
            for _ in range(depth)
        )
        number_layers(blk.attn for blk in self.blocks)  # the FAN blocks are the method's group
        self.feature_info = [dict(num_chs=embed_dim, reduction=patch_size, module=f"blocks.{i}") for i in range(depth)]
        self.cls_attn_blocks = nn.ModuleList(
            ClassAttentionBlock(embed_dim, num_heads, mlp_ratio=mlp_ratio, qkv_bias=qkv_bias,
                                proj_drop=proj_drop_rate, attn_drop=attn_drop_rate, act_layer=act_layer,
                                norm_layer=norm_layer, eta=eta, tokens_norm=tokens_norm, **dd)
            for _ in range(cls_attn_layers)
        )
        self.norm = norm_layer(embed_dim, **dd)
        self.head_drop = nn.Dropout(drop_rate)
        self.head = nn.Linear(embed_dim, num_classes, **dd) if num_classes > 0 else nn.Identity()
        trunc_normal_(self.cls_token, std=0.02)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            trunc_normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.LayerNorm):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)

    @torch.jit.ignore
    def no_weight_decay(self) -> Set[str]:
        return {"cls_token", "pos_embed.*", "*.temperature", "*.attention_params.*"}

    @torch.jit.ignore
    def group_matcher(self, coarse: bool = False) -> Dict[str, Any]:
        return dict(stem=r"^cls_token|pos_embed|patch_embed", blocks=r"^blocks\.(\d+)",
                    cls_attn_blocks=[(r"^cls_attn_blocks\.(\d+)", None), (r"^norm", (99999,))])

    @torch.jit.ignore
    def set_grad_checkpointing(self, enable: bool = True) -> None:
        self.grad_checkpointing = enable

    @torch.jit.ignore
    def get_classifier(self) -> nn.Module:
        return self.head

    def reset_classifier(self, num_classes: int, global_pool: Optional[str] = None) -> None:
        self.num_classes = num_classes
        if global_pool is not None:
            if global_pool not in ("", "avg", "token"):
                raise ValueError(f"global_pool must be '', 'avg' or 'token', got {global_pool!r}")
            self.global_pool = global_pool
        ref = self.patch_embed.proj[0][0].weight
        self.head = (nn.Linear(self.embed_dim, num_classes, device=ref.device, dtype=ref.dtype)
                     if num_classes > 0 else nn.Identity())
        self.head.train(self.training)

    def _embed(self, x: Tensor) -> Tuple[Tensor, int, int]:
        B = x.shape[0]
        x, (Hp, Wp) = self.patch_embed(x)
        if self.pos_embed is not None:
            x = x + self.pos_embed(B, Hp, Wp).reshape(B, -1, x.shape[1]).permute(0, 2, 1)
        return self.pos_drop(x), Hp, Wp

    def _blocks_forward(self, x: Tensor, Hp: int, Wp: int, blocks: nn.Module,
                        take_indices: Optional[List[int]] = None, norm: bool = False) -> Tuple[Tensor, List[Tensor]]:
        return run_blocks(blocks, x, (Hp, Wp), self.grad_checkpointing, take_indices, self.norm if norm else None,
                          warmup_scale=self.method_scale())

    def forward_cls(self, x: Tensor) -> Tensor:
        """Prepend the class token and run the (softmax) class-attention blocks."""
        x = torch.cat((self.cls_token.expand(x.shape[0], -1, -1), x), dim=1)
        for blk in self.cls_attn_blocks:
            x = checkpoint(blk, x) if self.grad_checkpointing and not torch.jit.is_scripting() else blk(x)
        return x

    def forward_features(self, x: Tensor) -> Tensor:
        x, Hp, Wp = self._embed(x)
        x, _ = self._blocks_forward(x, Hp, Wp, self.blocks)
        if self.cls_attn_blocks is not None:
            x = self.forward_cls(x)
        return self.norm(x)

    def forward_intermediates(
        self, x: Tensor, indices: Optional[Union[int, List[int]]] = None, norm: bool = False,
        stop_early: bool = False, output_fmt: str = "NCHW", intermediates_only: bool = False,
    ) -> Union[List[Tensor], Tuple[Tensor, List[Tensor]]]:
        """Patch-token outputs of the FAN blocks at ``indices`` (NCHW or NLC), and the final features."""
        if output_fmt not in ("NCHW", "NLC"):
            raise ValueError(f"output_fmt must be 'NCHW' or 'NLC', got {output_fmt!r}")
        take_indices, max_index = feature_take_indices(len(self.blocks), indices)
        B = x.shape[0]
        x, Hp, Wp = self._embed(x)
        blocks = self.blocks[: max_index + 1] if stop_early else self.blocks
        x, intermediates = self._blocks_forward(x, Hp, Wp, blocks, take_indices=take_indices, norm=norm)
        if output_fmt == "NCHW":
            intermediates = [y.reshape(B, Hp, Wp, -1).permute(0, 3, 1, 2).contiguous() for y in intermediates]
        if intermediates_only:
            return intermediates
        if self.cls_attn_blocks is not None:
            x = self.forward_cls(x)
        return self.norm(x), intermediates

    def prune_intermediate_layers(self, indices: Union[int, List[int]] = 1, prune_norm: bool = False,
                                  prune_head: bool = True) -> List[int]:
        take_indices, max_index = feature_take_indices(len(self.blocks), indices)
        self.blocks = self.blocks[: max_index + 1]
        if prune_norm:
            self.norm = nn.Identity()
        if prune_head:
            self.cls_attn_blocks = None
            self.cls_token = None
            self.num_prefix_tokens = 0
            self.reset_classifier(0, "")
        return take_indices

    def forward_head(self, x: Tensor, pre_logits: bool = False) -> Tensor:
        if self.global_pool:
            x = x[:, self.num_prefix_tokens:].mean(dim=1) if self.global_pool == "avg" else x[:, 0]
        x = self.head_drop(x)
        return x if pre_logits else self.head(x)

    def forward(self, x: Tensor) -> Tensor:
        return self.forward_head(self.forward_features(x))


def checkpoint_filter_fn(state_dict: Dict[str, Any], model: FAN) -> Dict[str, Tensor]:
    """Load an official (or our own) FAN checkpoint: unwrap, rename ``pos_embeder``, split fused ``qkv``."""
    XCIT.require()
    out = unwrap_state_dict(state_dict, "FAN checkpoint")
    out = _xcit_checkpoint_filter_fn(out, model)
    return finish_state_dict(
        out, model, "FAN checkpoints in the official layout load strictly (fan_tiny_12_p16_224 into "
        "fan_tiny_12_p16_224 or pid_fan_tiny_12_p16_224); check the model size matches the checkpoint",
    )


def _create(entry: ModelEntry, name: str, default_attention: str, pretrained: bool = False, **kwargs: Any) -> FAN:
    require(BUILD_MODEL_WITH_CFG, *FAN_INTERNALS)
    choice = entry_choice(entry, default_attention, kwargs, name)
    if pretrained:
        check_pretrained_source(name, entry.base, kwargs)
    out_indices = kwargs.pop("out_indices", 3)
    return build_model_with_cfg(
        FAN, name, pretrained, pretrained_filter_fn=checkpoint_filter_fn,
        feature_cfg=dict(out_indices=out_indices, feature_cls="getter"),
        attention=choice.method.name if choice is not None else "softmax",
        attention_cfg=choice.config if choice is not None else None,
        **{**entry.kwargs, **kwargs},
    )


def _pretrained_cfg(entry: ModelEntry) -> Dict[str, Any]:
    return {
        "num_classes": 1000, "input_size": (3, 224, 224), "pool_size": None, "crop_pct": 1.0,
        "interpolation": "bicubic", "fixed_input_size": False, "mean": IMAGENET_DEFAULT_MEAN,
        "std": IMAGENET_DEFAULT_STD, "first_conv": "patch_embed.proj.0.0", "classifier": "head",
        "notes": ("no bundled weights: set `file` to a local checkpoint (official FAN layout loads)",),
    }


register_entries(__name__, catalogue_entries(["fan"]), _create, _pretrained_cfg, with_base=True)
