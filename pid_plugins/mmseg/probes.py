"""The behavioural probes of :mod:`pid_plugins.mmseg.internals` (registered in its ``PROBES`` on import): the method
classes compute mmcv's MultiheadAttention, mmseg's TransformerEncoderLayer, ViT forward and Segmenter head again, and
each probe builds the stock part and the method's on the same perturbed weights and compares their outputs to float32
rounding. A release that computes differently fails its probe, whatever its source text."""
from __future__ import annotations

from .head import PIDSegmenterMaskTransformerHead
from .internals import PROBES
from .vit import PIDTransformerEncoderLayer, PIDVisionTransformer, _switch_layers

__all__ = ["PROBE_BACKBONE", "PROBE_HEAD"]

#: the probes' stock parts
PROBE_BACKBONE = dict(img_size=(16, 16), patch_size=8, embed_dims=16, num_layers=1, num_heads=2, drop_path_rate=0.0,
                      final_norm=True, with_cls_token=True, out_indices=(0,), norm_cfg=dict(type="LN", eps=1e-6))
PROBE_HEAD = dict(in_channels=16, channels=16, num_classes=3, num_layers=1, num_heads=2, embed_dims=16,
                  dropout_ratio=0.0, drop_path_rate=0.0, norm_cfg=dict(type="LN"))
_PROBING = [False]


def _layer_probe() -> bool:
    """mmseg's TransformerEncoderLayer (with mmcv's MultiheadAttention) and the method's layer switched from a copy of
    it (PID, the reference-only first layer) compute the same, to float32 rounding."""
    if _PROBING[0]:
        return True
    import copy

    import torch

    _PROBING[0] = True
    try:
        from mmseg.models.backbones.vit import TransformerEncoderLayer
        from torch.nn import ModuleList

        from ..core import MethodChoice, get_method

        method = get_method("pid")
        choice = MethodChoice(method, method.configure(
            dict(lambda_p=0.5, lambda_i=0.1, lambda_d=0.1, control_first_layer=False), "mmseg"))
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            stock = ModuleList([TransformerEncoderLayer(embed_dims=16, num_heads=2, feedforward_channels=32,
                                                        norm_cfg=dict(type="LN"))])
            for p in stock.parameters():
                p.data.add_(torch.randn_like(p) * 0.1)
            layers = copy.deepcopy(stock)
            _switch_layers(layers, choice)
            stock.eval(), layers.eval()
            x = torch.randn(2, 5, 16)
            with torch.no_grad():
                got, want = layers[0](x)[0], stock[0](x)
        return isinstance(layers[0], PIDTransformerEncoderLayer) and torch.allclose(got, want, rtol=1e-5, atol=1e-6)
    finally:
        _PROBING[0] = False


def _part_probe(part: str) -> bool:
    """mmseg's ``part`` ("backbone": VisionTransformer; "head": SegmenterMaskTransformerHead) and the method's
    (PID, its one layer the reference-only first layer; the stock weights) compute the same, to float32 rounding (rtol 1e-5, atol 1e-6)."""
    if _PROBING[0]:  # the method part built below requires these internals: the probe in progress answers
        return True
    import torch

    _PROBING[0] = True
    try:
        from mmseg.models.backbones.vit import VisionTransformer
        from mmseg.models.decode_heads import SegmenterMaskTransformerHead

        plain = dict(lambda_p=0.5, lambda_i=0.1, lambda_d=0.1, control_first_layer=False)
        stock_type, method_type, args = ((VisionTransformer, PIDVisionTransformer, PROBE_BACKBONE) if part == "backbone"
                                         else (SegmenterMaskTransformerHead, PIDSegmenterMaskTransformerHead,
                                               PROBE_HEAD))
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            stock = stock_type(**args)
            for p in stock.parameters():  # norms and biases away from their initial values: every step counts
                p.data.add_(torch.randn_like(p) * 0.1)
            model = method_type(**args, attention="pid", attention_cfg=plain)
            model.load_state_dict(stock.state_dict())
            stock.eval(), model.eval()
            x = torch.randn(2, 3, 16, 16) if part == "backbone" else [torch.randn(2, 16, 2, 2)]
            with torch.no_grad():
                got, want = model(x), stock(x)
        if not all(isinstance(layer, PIDTransformerEncoderLayer) for layer in model.layers):
            return False
        got, want = (list(got), list(want)) if part == "backbone" else ([got], [want])
        return len(got) == len(want) and all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(got, want))
    finally:
        _PROBING[0] = False



PROBES.update(layer=_layer_probe, backbone=lambda: _part_probe("backbone"), head=lambda: _part_probe("head"))
