"""Attention methods (PID, or any registered one) in Segmenter's mask-transformer decoder (off by default)."""
from __future__ import annotations

from functools import partial
from typing import Any, Callable, List, Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from mmseg.models.decode_heads import SegmenterMaskTransformerHead
from mmseg.registry import MODELS

from ..core import SOFTMAX, MethodChoice
from ..core.layer import MethodModel
from .vit import _choose, configure_attention

__all__ = ["PIDSegmenterMaskTransformerHead"]


@MODELS.register_module()
class PIDSegmenterMaskTransformerHead(MethodModel, SegmenterMaskTransformerHead):
    """mmseg's ``SegmenterMaskTransformerHead`` with an optional attention method (``attention='softmax'``,
    ``attention_cfg=``) in its layers (their own group)."""

    def __init__(self, *args: Any, attention: str = SOFTMAX, attention_cfg: Any = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        where = "mmseg decode_head PIDSegmenterMaskTransformerHead"
        self._configure_attention(_choose(attention, attention_cfg, where), where)

    def _configure_attention(self, choice: Optional[MethodChoice], where: str) -> None:
        configure_attention(self, choice, self.cls_emb, where)

    def forward(self, inputs: List[Tensor]) -> Tensor:
        return method_head_forward(self, inputs, super().forward)


def method_head_forward(head: SegmenterMaskTransformerHead, inputs: List[Tensor],
                        stock_forward: Callable[[List[Tensor]], Tensor]) -> Tensor:
    """The forward of a head with a method: the method's state threaded through the decoder's layers."""
    scale = MethodModel.method_scale(head)  # one warm-up step per forward
    if not MethodModel.method_active.fget(head):
        return stock_forward(inputs)
    x = head._transform_inputs(inputs)
    b, c, h, w = x.shape
    x = head.dec_proj(x.permute(0, 2, 3, 1).contiguous().view(b, -1, c))
    x = torch.cat((x, head.cls_emb.expand(x.size(0), -1, -1)), 1)
    state: Optional[tuple] = None
    for layer in head.layers:
        x, state = layer(x, method_state=state, warmup_scale=scale)
    x = head.decoder_norm(x)
    patches = F.normalize(head.patch_proj(x[:, :-head.num_classes]), dim=2, p=2)
    cls_seg_feat = F.normalize(head.classes_proj(x[:, -head.num_classes:]), dim=2, p=2)
    masks = head.mask_norm(patches @ cls_seg_feat.transpose(1, 2))
    return masks.permute(0, 2, 1).contiguous().view(b, -1, h, w)


def bare_head_forward(head: SegmenterMaskTransformerHead, inputs: List[Tensor]) -> Tensor:
    """The forward :func:`~pid_plugins.mmseg.convert` binds to a bare stock head: the method head's."""
    return method_head_forward(head, inputs, partial(SegmenterMaskTransformerHead.forward, head))
