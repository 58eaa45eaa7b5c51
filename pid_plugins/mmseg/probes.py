"""The behavioural probes of :mod:`pid_plugins.mmseg.internals` (registered in its ``PROBES`` on import): the method
classes compute mmcv's MultiheadAttention, mmseg's TransformerEncoderLayer, ViT forward and Segmenter head again, and
each probe builds the stock part and the method's on the same perturbed weights and compares their outputs to float32
rounding. A release that computes differently fails its probe, whatever its source text."""
from __future__ import annotations

import copy

import torch
from mmseg.models.backbones.vit import TransformerEncoderLayer, VisionTransformer
from mmseg.models.decode_heads import SegmenterMaskTransformerHead
from torch.nn import ModuleList

from ..core import MethodChoice, get_method
from ..versions import behaviour_probe, close_to_rounding, perturbed
from .head import PIDSegmenterMaskTransformerHead
from .internals import PROBES
from .vit import PIDTransformerEncoderLayer, PIDVisionTransformer, _switch_layers

__all__ = ["PROBE_BACKBONE", "PROBE_HEAD"]

#: the probes' stock parts
PROBE_BACKBONE = dict(img_size=(16, 16), patch_size=8, embed_dims=16, num_layers=1, num_heads=2, drop_path_rate=0.0,
                      final_norm=True, with_cls_token=True, out_indices=(0,), norm_cfg=dict(type="LN", eps=1e-6))
PROBE_HEAD = dict(in_channels=16, channels=16, num_classes=3, num_layers=1, num_heads=2, embed_dims=16,
                  dropout_ratio=0.0, drop_path_rate=0.0, norm_cfg=dict(type="LN"))
#: PID whose one layer is the group's reference-only first layer: the attention through the method classes, nothing
#: added (at zero gains the adapter keeps mmseg's own layers, which would test nothing)
PLAIN = dict(lambda_p=0.5, lambda_i=0.1, lambda_d=0.1, control_first_layer=False)


@behaviour_probe
def _layer_probe() -> bool:
    """mmseg's TransformerEncoderLayer (with mmcv's MultiheadAttention) and the method's layer switched from a copy of
    it compute the same, to float32 rounding."""
    method = get_method("pid")
    stock = perturbed(ModuleList([TransformerEncoderLayer(embed_dims=16, num_heads=2, feedforward_channels=32,
                                                          norm_cfg=dict(type="LN"))]))
    layers = copy.deepcopy(stock)
    _switch_layers(layers, MethodChoice(method, method.configure(dict(PLAIN), "mmseg")))
    layers.eval()
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        got, want = layers[0](x)[0], stock[0](x)
    return isinstance(layers[0], PIDTransformerEncoderLayer) and close_to_rounding(got, want)


def _part_probe(stock_type: type, method_type: type, args: dict, x) -> bool:
    """mmseg's part and the method's (the stock weights) compute the same, to float32 rounding."""
    stock = perturbed(stock_type(**args))
    model = method_type(**args, attention="pid", attention_cfg=dict(PLAIN))
    model.load_state_dict(stock.state_dict())
    model.eval()
    with torch.no_grad():
        got, want = model(x), stock(x)
    if not all(isinstance(layer, PIDTransformerEncoderLayer) for layer in model.layers):
        return False
    got, want = (got, want) if isinstance(got, (list, tuple)) else ([got], [want])
    return len(got) == len(want) and all(close_to_rounding(a, b) for a, b in zip(got, want))


@behaviour_probe
def _backbone_probe() -> bool:
    return _part_probe(VisionTransformer, PIDVisionTransformer, PROBE_BACKBONE, torch.randn(2, 3, 16, 16))


@behaviour_probe
def _head_probe() -> bool:
    return _part_probe(SegmenterMaskTransformerHead, PIDSegmenterMaskTransformerHead, PROBE_HEAD,
                       [torch.randn(2, 16, 2, 2)])


PROBES.update(layer=_layer_probe, backbone=_backbone_probe, head=_head_probe)
