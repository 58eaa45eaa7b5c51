"""PID attention in Segmenter's mask-transformer decoder (an option, off by default)."""
from __future__ import annotations

from typing import Any, List, Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from mmseg.models.decode_heads import SegmenterMaskTransformerHead
from mmseg.registry import MODELS

from ..core import GainWarmup, PIDConfig, PIDState, make_warmup, warmup_scale
from .vit import PIDTransformerEncoderLayer

__all__ = ["PIDSegmenterMaskTransformerHead"]


@MODELS.register_module()
class PIDSegmenterMaskTransformerHead(SegmenterMaskTransformerHead):
    """mmseg's ``SegmenterMaskTransformerHead`` with optional PID attention in its transformer layers.

    The decoder's layers (patch tokens + class embeddings) form their own PID group: the state starts afresh
    at the decoder's first layer, independent of the backbone's. Parameter names are mmseg's, so stock
    Segmenter checkpoints load unchanged.

    Args (beyond mmseg's head):
        attention: ``'softmax'`` (default: the stock head, layers untouched) or ``'pid'``.
        pid: gains for ``attention='pid'``: a preset name, a ``PIDConfig`` or a dict (``preset`` key allowed),
            over the paper's ``segmenter`` preset.
    """

    def __init__(self, *args: Any, attention: str = "softmax", pid: Any = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if attention not in ("pid", "softmax"):
            raise ValueError(f"decode_head attention must be 'pid' or 'softmax', got {attention!r}")
        if attention == "softmax" and pid is not None:
            raise ValueError("decode_head pid=... is set but attention='softmax': set attention='pid' to use it")
        self.pid: Optional[PIDConfig] = None
        #: the gain warm-up counter (``pid=dict(warmup_steps=N)``), advanced once per training forward
        self.pid_warmup: Optional[GainWarmup] = None
        if attention == "pid":
            self.pid = PIDConfig.coerce(pid, default="segmenter")
            if self.pid.learnable:
                raise ValueError("learnable gains are not supported by the mmseg decode head; use fixed gains")
            for layer in self.layers:
                layer.__class__ = PIDTransformerEncoderLayer
                layer.pid = self.pid
            self.pid_warmup = make_warmup(self.pid, like=self.cls_emb)

    def forward(self, inputs: List[Tensor]) -> Tensor:
        if self.pid is None:
            return super().forward(inputs)
        x = self._transform_inputs(inputs)
        b, c, h, w = x.shape
        x = self.dec_proj(x.permute(0, 2, 3, 1).contiguous().view(b, -1, c))
        x = torch.cat((x, self.cls_emb.expand(x.size(0), -1, -1)), 1)
        state: Optional[PIDState] = None
        scale = warmup_scale(self.pid_warmup)  # one warm-up step per forward
        for layer in self.layers:
            x, state = layer(x, state, scale)
        x = self.decoder_norm(x)
        patches = F.normalize(self.patch_proj(x[:, :-self.num_classes]), dim=2, p=2)
        cls_seg_feat = F.normalize(self.classes_proj(x[:, -self.num_classes:]), dim=2, p=2)
        masks = self.mask_norm(patches @ cls_seg_feat.transpose(1, 2))
        return masks.permute(0, 2, 1).contiguous().view(b, -1, h, w)
