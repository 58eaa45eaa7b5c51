"""``pid_plugins.mmseg.convert`` where mmseg's parts meet it."""
import copy

import pytest
import torch

from zoo_cases import weights as zc_weights

pytest.importorskip("mmseg")
import pid_plugins.mmseg as pm  # noqa: E402
from mmseg.models.backbones.vit import TransformerEncoderLayer  # noqa: E402
from zoo_cases import mm_args  # noqa: E402
from toy_method import register_non_additive_method  # noqa: E402

SIZE = (32, 32)


def segmentor_cfg(backbone="VisionTransformer", head="SegmenterMaskTransformerHead", backbone_kw=None, head_kw=None):
    return dict(
        type="EncoderDecoder",
        data_preprocessor=dict(type="SegDataPreProcessor", mean=[123.675, 116.28, 103.53], std=[58.395, 57.12, 57.375],
                               bgr_to_rgb=True, pad_val=0, seg_pad_val=255, size=SIZE),
        backbone=dict(type=backbone, **mm_args("backbone"), **(backbone_kw or {})),
        decode_head=dict(type=head, **mm_args("head"), **(head_kw or {})),
        test_cfg=dict(mode="whole"),
    )


def build(cfg, seed=0, weights=None):
    from mmengine.registry import init_default_scope
    from mmseg.registry import MODELS

    init_default_scope("mmseg")
    torch.manual_seed(seed)
    model = MODELS.build(cfg)
    model.init_weights()
    model.eval()  # mmseg's ViT.train() returns None: not chained
    if weights is not None:
        model.load_state_dict(weights, strict=True)
    return model


def stock(seed=0):
    return build(segmentor_cfg(), seed)


def built_with(attention, attention_cfg=None, weights=None, backbone_only=False):
    """The segmentor a config with pid-plugins' types and this method builds, ``weights`` loaded strictly."""
    method = dict(attention=attention, attention_cfg=attention_cfg)
    head = dict(head="SegmenterMaskTransformerHead") if backbone_only else dict(
        head="PIDSegmenterMaskTransformerHead", head_kw=method)
    return build(segmentor_cfg("PIDVisionTransformer", backbone_kw=method, **head), seed=7, weights=weights)


def images(n=2, seed=1):
    return torch.rand(n, 3, *SIZE, generator=torch.Generator().manual_seed(seed)) * 255


def logits(model, x=None):
    x = images() if x is None else x
    with torch.no_grad():
        return model.encode_decode(x, [dict(img_shape=SIZE)] * len(x))


def layout(model):
    """Everything nn.Module keeps, per module."""
    return [(name, type(m), sorted(vars(m)), list(m._modules), list(m._parameters), list(m._buffers), m.training)
            for name, m in model.named_modules()]


def state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_the_method_in_the_backbone_only_gives_the_shipped_configs_function():
    model = stock()
    weights = state(model)
    pm.convert(model, "pid")
    head = model.decode_head
    assert pm.convert(head, "softmax") is head  # a bare method head: reconfigured, keeping its class
    assert type(head) is pm.PIDSegmenterMaskTransformerHead and head.attention_method is None
    assert all(type(layer) is TransformerEncoderLayer for layer in head.layers)
    reference = built_with("pid", weights=weights, backbone_only=True)
    assert list(model.state_dict()) == list(reference.state_dict())
    assert torch.equal(logits(model), logits(reference))
    pm.convert(model.decode_head, "neutreno")  # and the head alone, its own group
    assert torch.equal(logits(model), logits(build(segmentor_cfg(
        "PIDVisionTransformer", "PIDSegmenterMaskTransformerHead", head_kw=dict(attention="neutreno")), 3, weights)))


def test_a_bare_method_backbone_to_softmax_keeps_its_class_and_computes_the_stock_function():
    model = stock()
    weights = state(model)
    y_stock = logits(model)
    calls = []
    model.backbone.layers[1].register_forward_hook(lambda *args: calls.append(1))  # a user's hook survives
    pm.convert(model, "pid", {"learnable": True, "warmup_steps": 5})
    backbone = model.backbone
    assert pm.convert(backbone, "softmax") is backbone and model.backbone is backbone
    assert type(backbone) is pm.PIDVisionTransformer and backbone.attention_method is None
    assert backbone.attention_warmup is None and "attention_warmup" not in backbone._modules
    assert all(type(layer) is TransformerEncoderLayer for layer in backbone.layers)
    pm.convert(model.decode_head, "softmax")
    assert list(model.state_dict()) == list(weights)
    assert torch.equal(logits(model), y_stock) and len(calls) == 1


def test_a_segmentor_built_with_pid_types_goes_to_mmsegs_classes_too():
    model = built_with("pid", {"learnable": True, "warmup_steps": 3})
    weights = {k: v for k, v in zc_weights(state(model)).items()
               if ".attention_params." not in k and "attention_warmup" not in k}
    pm.convert(model, "softmax")
    reference = stock()
    reference.load_state_dict(weights, strict=True)
    assert layout(model) == layout(reference)
    assert torch.equal(logits(model), logits(reference))


def _register_non_additive_method_with_warmup(monkeypatch):
    """A method that calls attention twice and takes warmup_steps, registered for one test."""
    return register_non_additive_method(monkeypatch, "convert_mmseg_doubled").name


def test_refusals_come_before_any_change(monkeypatch):
    from mmseg.registry import MODELS

    model = stock()
    pm.convert(model, "pid")
    pm.convert(model.decode_head, "softmax")  # a partly converted model: refusals leave it as it is, too
    pristine, keys, y = layout(model), list(model.state_dict()), logits(model)
    with pytest.raises(ValueError, match=r"unknown attention method 'nope': choose 'softmax' or one of \["):
        pm.convert(model, "nope")
    with pytest.raises(ValueError, match="PIDConfig.lambda_d"):
        pm.convert(model, "pid", {"lambda_d": -0.1})
    with pytest.raises(ValueError, match="unknown TwicingConfig field"):
        pm.convert(model, "twicing", {"learnable": True})
    doubled = _register_non_additive_method_with_warmup(monkeypatch)
    with pytest.raises(ValueError, match=f"backbone: .*'{doubled}'.* not additive.*set warmup_steps=0"):
        pm.convert(model, doubled, {"warmup_steps": 3})
    assert layout(model) == pristine and list(model.state_dict()) == keys and torch.equal(logits(model), y)
    fcn = build(segmentor_cfg(head="FCNHead", head_kw=None) | dict(decode_head=dict(
        type="FCNHead", in_channels=48, channels=16, num_convs=1, num_classes=5)))
    fcn_layout = layout(fcn)
    with pytest.raises(TypeError, match=r"decode_head is FCNHead.*backbone=dict\(type='PIDVisionTransformer'"):
        pm.convert(fcn, "pid")
    assert layout(fcn) == fcn_layout
    resnet = build(segmentor_cfg() | dict(backbone=dict(type="ResNetV1c", depth=18, out_indices=(3,))))
    with pytest.raises(TypeError, match="backbone is ResNetV1c"):
        pm.convert(resnet, "pid")
    odd = copy.deepcopy(model)
    odd.decode_head.layers[1] = torch.nn.Identity()
    odd_layout = layout(odd)
    with pytest.raises(TypeError, match="decode_head layer 1 is Identity"):
        pm.convert(odd, "neutreno")
    assert layout(odd) == odd_layout  # not even the backbone, checked first, was switched
    with pytest.raises(TypeError, match="got Linear"):
        pm.convert(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="before torch.compile"):
        pm.convert(torch.compile(stock()))
    assert MODELS.get("PIDVisionTransformer") is pm.PIDVisionTransformer  # the registry untouched
