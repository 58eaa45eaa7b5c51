"""Attention methods (PID, or any registered one) in Segmenter's mask-transformer decoder (off by default)."""
from __future__ import annotations

from typing import Any, List, Optional

from torch import Tensor
from mmseg.models.decode_heads import SegmenterMaskTransformerHead
from mmseg.registry import MODELS

from ..core import SOFTMAX, MethodChoice, resolve_attention
from ..core.layer import MethodModel
from .vit import configure_attention, method_forward

__all__ = ["PIDSegmenterMaskTransformerHead"]


@MODELS.register_module()
class PIDSegmenterMaskTransformerHead(MethodModel, SegmenterMaskTransformerHead):
    """mmseg's ``SegmenterMaskTransformerHead`` with an optional attention method (``attention='softmax'``,
    ``attention_cfg=``) in its layers (their own group)."""

    def __init__(self, *args: Any, attention: str = SOFTMAX, attention_cfg: Any = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        where = "mmseg decode_head PIDSegmenterMaskTransformerHead"
        self._configure_attention(resolve_attention(attention, attention_cfg, zoo="mmseg", where=where), where)

    def _configure_attention(self, choice: Optional[MethodChoice], where: str) -> None:
        configure_attention(self, choice, self.cls_emb, where)

    def forward(self, inputs: List[Tensor]) -> Tensor:
        return method_forward(self, super().forward, inputs)
