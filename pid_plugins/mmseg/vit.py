"""PID attention in mmseg's ViT backbone (Segmenter).

mmseg's ``TransformerEncoderLayer`` uses mmcv's ``MultiheadAttention`` around ``torch.nn.MultiheadAttention``
(packed ``in_proj_weight``), which never exposes per-head values. :class:`PIDTransformerEncoderLayer`
computes q/k/v from those same parameters (names unchanged, so checkpoints load as they are), runs the
core's SDPA + PID path, and returns the PID state; :class:`PIDVisionTransformer` threads it through the
layers. With softmax attention (or all gains zero) the layers run mmcv's own attention, so the output is
the stock backbone's, bit for bit.
"""
from __future__ import annotations

import math
from typing import Any, Dict, Optional, Tuple

import torch
import torch.utils.checkpoint as cp
from torch import Tensor
from mmengine.logging import print_log
from mmseg.models.backbones.vit import TransformerEncoderLayer, VisionTransformer
from mmseg.registry import MODELS

from ..core import GainWarmup, PIDConfig, PIDState, make_warmup, pid_term, scaled_gains, sdpa_with_pid, warmup_scale
from .checkpoint import load_checkpoint

__all__ = ["PIDVisionTransformer", "PIDTransformerEncoderLayer", "timm_vit_to_mmseg"]


class PIDTransformerEncoderLayer(TransformerEncoderLayer):
    """mmseg's encoder layer with PID attention; ``forward(x, state) -> (x, state)``.

    Built by :class:`PIDVisionTransformer` from mmseg's own layers (same parameters); ``pid`` is set there.
    """

    pid: Optional[PIDConfig] = None

    def _attention(self, x: Tensor, state: Optional[PIDState]) -> Tuple[Tensor, PIDState]:
        mha = self.attn.attn  # torch.nn.MultiheadAttention
        B, N, C = x.shape
        heads = mha.num_heads
        qkv = torch.nn.functional.linear(x, mha.in_proj_weight, mha.in_proj_bias)
        q, k, v = qkv.reshape(B, N, 3, heads, C // heads).permute(2, 0, 3, 1, 4).unbind(0)
        out, state = sdpa_with_pid(q, k, v, state, self.pid, dropout_p=mha.dropout if self.training else 0.0)
        return mha.out_proj(out.transpose(1, 2).reshape(B, N, C)), state

    def _warmup_attention(self, x: Tensor, state: Optional[PIDState], scale: Tensor) -> Tuple[Tensor, PIDState]:
        """Under gain warm-up: mmcv's own attention (before its dropout and residual, as mmcv computes it) plus
        the scaled PID term through the output projection's weight, so a zero scale is the stock layer exactly."""
        a = self.attn
        mha = a.attn
        B, N, C = x.shape
        q = x.transpose(0, 1) if a.batch_first else x
        out = mha(query=q, key=q, value=q, attn_mask=None, key_padding_mask=None)[0]
        out = out.transpose(0, 1) if a.batch_first else out
        v = torch.nn.functional.linear(x, mha.in_proj_weight[2 * C:], None if mha.in_proj_bias is None
                                       else mha.in_proj_bias[2 * C:])
        term, state = pid_term(v.reshape(B, N, mha.num_heads, C // mha.num_heads).transpose(1, 2), state,
                               scaled_gains(self.pid, scale))
        return out + torch.nn.functional.linear(term.transpose(1, 2).reshape(B, N, C), mha.out_proj.weight), state

    def forward(self, x: Tensor, state: Optional[PIDState] = None,  # type: ignore[override]
                scale: Optional[Tensor] = None) -> Tuple[Tensor, Optional[PIDState]]:
        """``scale``: the gain warm-up scale of this forward (None: no warm-up)."""
        def inner(x: Tensor, *state_tensors: Tensor) -> Tuple[Tensor, ...]:
            if self.pid is None or self.pid.is_zero:
                return (self.ffn(self.norm2(y := self.attn(self.norm1(x), identity=x)), identity=y),)
            if scale is not None:
                out, new_state = self._warmup_attention(self.norm1(x), PIDState(*state_tensors) if state_tensors
                                                        else None, scale)
                x = x + self.attn.dropout_layer(self.attn.proj_drop(out))
                return (self.ffn(self.norm2(x), identity=x), *new_state)
            out, new_state = self._attention(self.norm1(x), PIDState(*state_tensors) if state_tensors else None)
            x = x + self.attn.dropout_layer(self.attn.proj_drop(out))
            return (self.ffn(self.norm2(x), identity=x), *new_state)

        args = tuple(state) if state is not None else ()
        if self.with_cp and x.requires_grad:
            outputs = cp.checkpoint(inner, x, *args, use_reentrant=False)
        else:
            outputs = inner(x, *args)
        return outputs[0], (PIDState(*outputs[1:]) if len(outputs) > 1 else state)


def timm_vit_to_mmseg(state_dict: Dict[str, Tensor]) -> Dict[str, Tensor]:
    """timm ViT/DeiT (softmax or PID) parameter names -> mmseg ``VisionTransformer`` names.

    The same renaming mmseg's ``tools/model_converters/vit2mmseg.py`` applies; the classifier head is dropped.
    """
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
                   .replace(".attn.qkv.", ".attn.attn.in_proj_").replace(".attn.proj.", ".attn.attn.out_proj."))
        out[new] = value
    return out


@MODELS.register_module()
class PIDVisionTransformer(VisionTransformer):
    """mmseg's ``VisionTransformer`` with PID attention in its encoder layers (one PID group).

    Args (beyond mmseg's ``VisionTransformer``):
        attention: ``'pid'`` (default) or ``'softmax'`` (the stock backbone).
        pid: gains as a preset name, a ``PIDConfig``, or a dict (``preset`` key allowed) over the paper's
            ``segmenter`` preset.
        lambda_p, lambda_i, lambda_d, beta: single gains, overriding ``pid``.

    ``init_cfg=dict(type='Pretrained', checkpoint=PATH)`` accepts an mmseg ViT checkpoint or a timm
    ViT/DeiT checkpoint (e.g. trained with ``pid_plugins.timm``; converted with :func:`timm_vit_to_mmseg`),
    and loads it strictly: missing or unexpected keys raise a ``ValueError`` listing them. The file is read with
    ``torch.load(weights_only=True)`` whatever the environment says (:mod:`pid_plugins.mmseg.checkpoint`).
    A whole segmentor checkpoint (``backbone.`` and ``decode_head.`` keys) is refused: load it with ``load_from``.
    """

    def __init__(self, *args: Any, attention: str = "pid", pid: Any = None, lambda_p: Optional[float] = None,
                 lambda_i: Optional[float] = None, lambda_d: Optional[float] = None, beta: Optional[float] = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if attention not in ("pid", "softmax"):
            raise ValueError(f"attention must be 'pid' or 'softmax', got {attention!r}")
        single = {k: v for k, v in dict(lambda_p=lambda_p, lambda_i=lambda_i, lambda_d=lambda_d, beta=beta).items()
                  if v is not None}
        config = None
        if attention == "pid":
            config = PIDConfig.coerce(pid, default="segmenter")
            config = config.replace(**single) if single else config
            if config.learnable:
                raise ValueError("learnable gains are not supported by the mmseg backbone; use fixed gains")
        self.pid = config
        #: the gain warm-up counter (``pid=dict(warmup_steps=N)``), advanced once per training forward
        self.pid_warmup: Optional[GainWarmup] = make_warmup(config, like=self.pos_embed)
        for layer in self.layers:
            layer.__class__ = PIDTransformerEncoderLayer
            layer.pid = config

    def init_weights(self) -> None:
        cfg = self.init_cfg
        if not (isinstance(cfg, dict) and cfg.get("type") == "Pretrained"):
            return super().init_weights()
        checkpoint = load_checkpoint(cfg["checkpoint"], map_location="cpu")
        state_dict = checkpoint
        for key in ("state_dict", "model"):
            if isinstance(state_dict, dict) and key in state_dict:
                state_dict = state_dict[key]
        if not isinstance(state_dict, dict):
            raise ValueError(f"checkpoint {cfg['checkpoint']!r} holds a {type(state_dict).__name__}, not a state_dict")
        heads = sorted({k.split(".", 1)[0] for k in state_dict if k.startswith(("decode_head.", "auxiliary_head."))})
        if heads:
            raise ValueError(
                f"checkpoint {cfg['checkpoint']!r} is a whole segmentor (backbone. and {', '.join(heads)}. keys), "
                "not a backbone: load it with load_from=PATH (or tools/test.py PATH); backbone init_cfg takes a "
                "backbone, mmseg ViT or timm ViT/DeiT checkpoint"
            )
        state_dict = {k[len("backbone."):] if k.startswith("backbone.") else k: v for k, v in state_dict.items()}
        if any(k.startswith("blocks.") for k in state_dict):
            state_dict = timm_vit_to_mmseg(state_dict)
        # pretrained weights start a new training run: its warm-up starts at t = 0, whatever the checkpoint's was
        state_dict.pop("pid_warmup.step", None)
        if self.pid_warmup is not None:
            state_dict["pid_warmup.step"] = torch.zeros_like(self.pid_warmup.step)
        if "pos_embed" in state_dict and state_dict["pos_embed"].shape != self.pos_embed.shape:
            h, w = self.img_size
            pos_size = int(math.sqrt(state_dict["pos_embed"].shape[1] - 1))
            print_log(f"resize pos_embed {tuple(state_dict['pos_embed'].shape)} -> {tuple(self.pos_embed.shape)}")
            state_dict["pos_embed"] = self.resize_pos_embed(
                state_dict["pos_embed"], (h // self.patch_size, w // self.patch_size), (pos_size, pos_size),
                self.interpolate_mode)
        expected = self.state_dict()
        missing = sorted(set(expected) - set(state_dict))
        unexpected = sorted(set(state_dict) - set(expected))
        if missing or unexpected:
            hint = ("mmseg ViT checkpoints and timm ViT/DeiT checkpoints of the same size load; check "
                    "embed_dims/num_layers/num_heads")
            if "patch_embed.projection.bias" in unexpected:
                hint = ("timm ViT/DeiT checkpoints have a patch-embedding bias and mmseg's ViT default has none: "
                        "set backbone patch_bias=True")
            elif "patch_embed.projection.bias" in missing:
                hint = "this checkpoint has no patch-embedding bias: set backbone patch_bias=False"
            raise ValueError(
                f"checkpoint {cfg['checkpoint']!r} does not fit PIDVisionTransformer: missing keys {missing}; "
                f"unexpected keys {unexpected}. {hint}"
            )
        self.load_state_dict(state_dict, strict=True)

    def forward(self, inputs: Tensor) -> Tuple[Any, ...]:
        B = inputs.shape[0]
        x, hw_shape = self.patch_embed(inputs)
        x = torch.cat((self.cls_token.expand(B, -1, -1), x), dim=1)
        x = self._pos_embeding(x, hw_shape, self.pos_embed)
        if not self.with_cls_token:
            x = x[:, 1:]
        if self.pre_norm:
            x = self.pre_ln(x)
        outs = []
        if self.out_origin:
            outs.append(self._output(x, hw_shape))
        state: Optional[PIDState] = None
        scale = warmup_scale(self.pid_warmup)  # one warm-up step per forward (outside the checkpointed layers)
        for i, layer in enumerate(self.layers):
            x, state = layer(x, state, scale)
            if i == len(self.layers) - 1 and self.final_norm:
                x = self.norm1(x)
            if i in self.out_indices:
                outs.append(self._output(x, hw_shape))
        return tuple(outs)

    def _output(self, x: Tensor, hw_shape: Tuple[int, int]) -> Any:
        out = x[:, 1:] if self.with_cls_token else x
        B, _, C = out.shape
        out = out.reshape(B, hw_shape[0], hw_shape[1], C).permute(0, 3, 1, 2).contiguous()
        return [out, x[:, 0]] if self.output_cls_token else out
