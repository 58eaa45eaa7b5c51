"""``pid_plugins.mmseg.convert(model, attention, attention_cfg)``: a built mmseg segmentor (ViT backbone + Segmenter's
mask-transformer head) switched IN PLACE (issue 35): its backbone and decode head replaced (core's replace_module), a
bare method backbone or head reconfigured keeping its class, a bare stock backbone or head converted in place keeping
its class (tests/core/test_convert_whole_model.py compares them with their method types).

References: the segmentor built from a config with pid-plugins' types and that method, the same weights loaded
strictly (bit for bit, and the same attributes, submodules, parameters and buffers), and the stock segmentor itself
(softmax: mmseg's own classes again, its exact attributes, state_dict keys and outputs).
"""
import copy

import pytest
import torch

from zoo_cases import weights as zc_weights

pytest.importorskip("mmseg")
import pid_plugins  # noqa: E402
import pid_plugins.mmseg as pm  # noqa: E402
from mmseg.models.backbones.vit import TransformerEncoderLayer, VisionTransformer  # noqa: E402
from mmseg.models.decode_heads import SegmenterMaskTransformerHead  # noqa: E402
from method_cases import BUILTIN, variants  # noqa: E402
from zoo_cases import mm_args  # noqa: E402
from toy_method import register_non_additive_method  # noqa: E402

#: every built-in method (mmseg's preset), learnable too where it has learnable parameters (tests/method_cases.py)
VARIANTS = variants()
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
    """Everything nn.Module keeps, per module: class, plain attributes, submodule/parameter/buffer names in order,
    train/eval mode."""
    return [(name, type(m), sorted(vars(m)), list(m._modules), list(m._parameters), list(m._buffers), m.training)
            for name, m in model.named_modules()]


def state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


# --------------------------------------------------------------------------------------- stock -> method
@pytest.mark.parametrize("method", VARIANTS)
def test_a_stock_segmentor_converted_in_place_equals_the_one_built_with_the_method(method):
    attention, cfg = VARIANTS[method]
    model = stock()
    params = list(model.parameters())
    y_stock = logits(model)
    assert pm.convert(model, attention, cfg) is model
    assert type(model.backbone) is pm.PIDVisionTransformer
    assert type(model.decode_head) is pm.PIDSegmenterMaskTransformerHead
    assert all(type(layer) is pm.PIDTransformerEncoderLayer for layer in [*model.backbone.layers,
                                                                          *model.decode_head.layers])
    assert all(any(p is q for q in model.parameters()) for p in params)  # the same tensors, nothing copied
    reference = built_with(attention, cfg, weights=model.state_dict())  # learnable: the converted initial values
    assert layout(model) == layout(reference)  # the attributes the PID classes' __init__ sets, nothing else
    assert list(model.state_dict()) == list(reference.state_dict())
    y = logits(model)
    assert torch.equal(y, logits(reference))
    assert (y - y_stock).abs().max() > 1e-4  # the method is on
    if (cfg or {}).get("learnable"):  # each layer's parameters at their initial values, as a built model's
        fresh = built_with(attention, cfg)
        gains = {n: p for n, p in model.named_parameters() if ".attention_params." in n}
        assert len(gains) == 5 * len(BUILTIN[attention].learned)
        assert all(torch.equal(p, fresh.state_dict()[n]) for n, p in gains.items())


# chosen transitions: fixed -> a method with its own prepare, learnable -> fixed, fixed -> learnable, same method
@pytest.mark.parametrize("first, then", [("pid", "elliptical"), ("learnable_value_residual", "neutreno"),
                                         ("neutreno", "learnable_pid"), ("learnable_pid", "pid")])
def test_method_to_method_equals_the_one_built_with_the_second(first, then):
    model = stock()
    weights = state(model)
    pm.convert(model, *VARIANTS[first])
    logits(model)
    pm.convert(model, *VARIANTS[then])
    attention, cfg = VARIANTS[then]
    reference = built_with(attention, cfg, weights=model.state_dict())
    assert layout(model) == layout(reference)
    assert torch.equal(logits(model), logits(reference))
    assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items() if k in weights)


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
    pm.convert(model, "pid", {"learnable": True, "warmup_steps": 5})
    backbone = model.backbone
    assert pm.convert(backbone, "softmax") is backbone and model.backbone is backbone
    assert type(backbone) is pm.PIDVisionTransformer and backbone.attention_method is None
    assert backbone.attention_warmup is None and "attention_warmup" not in backbone._modules
    assert all(type(layer) is TransformerEncoderLayer for layer in backbone.layers)
    pm.convert(model.decode_head, "softmax")
    assert list(model.state_dict()) == list(weights)
    assert torch.equal(logits(model), y_stock)


def test_a_bare_stock_head_converts_in_place_inside_its_segmentor():
    """A stock segmentor's head converted alone (the module given, not its parent): it keeps its class and place, and
    the segmentor computes what the one built with a stock backbone and the method's head type computes; softmax
    gives the stock segmentor back bit for bit. (Bare parts against their types:
    tests/core/test_convert_whole_model.py.)"""
    model = stock()
    module = model.decode_head
    pristine, keys, y = layout(model), list(model.state_dict()), logits(model)
    assert pm.convert(module, "pid") is module and model.decode_head is module
    assert type(module) is SegmenterMaskTransformerHead
    assert not torch.equal(logits(model), y)
    assert pm.convert(module, "softmax") is module
    assert layout(model) == pristine and list(model.state_dict()) == keys
    assert torch.equal(logits(model), y)


# --------------------------------------------------------------------------------------- method -> softmax
@pytest.mark.parametrize("cfg", [None, {"learnable": True, "warmup_steps": 5}], ids=["fixed", "learnable_warmup"])
def test_softmax_goes_back_to_mmsegs_own_classes_bit_for_bit(cfg):
    model = stock()
    pristine, keys = layout(model), list(model.state_dict())
    calls = []
    model.backbone.layers[1].register_forward_hook(lambda *args: calls.append(1))  # a user's hook survives
    y_stock = logits(model)
    pm.convert(model, "pid", cfg)
    pm.convert(model, "neutreno")  # method -> method, in place
    pm.convert(model, "value_residual", {"learnable": True})
    pm.convert(model, "pid", cfg)
    logits(model)
    assert pm.convert(model, "softmax") is model
    assert type(model.backbone) is VisionTransformer and type(model.decode_head) is SegmenterMaskTransformerHead
    assert all(type(layer) is TransformerEncoderLayer for layer in [*model.backbone.layers, *model.decode_head.layers])
    assert layout(model) == pristine  # every attribute, submodule, parameter and buffer pid-plugins added is gone
    assert list(model.state_dict()) == keys
    assert torch.equal(logits(model), y_stock)
    assert len(calls) == 3  # the three forwards above


def test_a_segmentor_built_with_pid_types_goes_to_mmsegs_classes_too():
    model = built_with("pid", {"learnable": True, "warmup_steps": 3})
    weights = {k: v for k, v in zc_weights(state(model)).items()
               if ".attention_params." not in k and "attention_warmup" not in k}
    pm.convert(model, "softmax")
    reference = stock()
    reference.load_state_dict(weights, strict=True)
    assert layout(model) == layout(reference)
    assert torch.equal(logits(model), logits(reference))


# ----------------------------------------------------------------------------- learnable parameters and warm-up
def test_learnable_parameters_on_and_off_on_the_models_device_dtype_and_mode():
    model = stock()
    model.double()
    pm.convert(model, "pid", {"learnable": True})
    gains = {n: p for n, p in model.named_parameters() if ".attention_params." in n}
    assert len(gains) == 3 * 5 and all(p.dtype == torch.float64 for p in gains.values())
    assert not any(m.training for m in model.modules())  # eval model: the new gains modules are in eval too
    model.train()
    pm.convert(model, "value_residual", {"learnable": True})  # another method's learnable parameters, train mode
    lambdas = [n for n, _ in model.named_parameters() if ".attention_params." in n]
    assert len(lambdas) == 2 * 5 and all(m.training for m in model.modules())
    model.eval()
    pm.convert(model, "pid", {"learnable": False})
    assert not any(".attention_params." in n for n, _ in model.named_parameters())
    reference = built_with("pid").double()
    assert layout(model) == layout(reference)


def test_warmup_counters_are_made_follow_the_mode_carry_over_and_go():
    model = stock()
    pm.convert(model, "pid", {"warmup_steps": 4})
    parts = (model.backbone, model.decode_head)
    assert all(isinstance(p.attention_warmup, pid_plugins.GainWarmup) and not p.attention_warmup.training
               for p in parts)
    assert {"backbone.attention_warmup.step", "decode_head.attention_warmup.step"} <= set(model.state_dict())
    logits(model)
    assert all(int(p.attention_warmup.step) == 0 for p in parts)  # eval forwards do not count
    model.train()
    model.backbone(images())
    model.decode_head(model.backbone(images()))
    assert int(model.backbone.attention_warmup.step) == 2 and int(model.decode_head.attention_warmup.step) == 1
    pm.convert(model, "pid", {"warmup_steps": 8})  # another N: t carries over
    assert model.backbone.attention_warmup.warmup_steps == 8 and int(model.backbone.attention_warmup.step) == 2
    pm.convert(model, "pid")  # no warm-up: the counters go
    assert all(p.attention_warmup is None for p in parts)
    assert not any("attention_warmup" in k for k in model.state_dict())
    model.eval()
    assert layout(model) == layout(built_with("pid"))


# ------------------------------------------------------------------------------------------------ refusals
def _register_non_additive_method_with_warmup(monkeypatch):
    """A method that calls attention twice and takes warmup_steps, registered for one test: mmseg warms up as the
    stock attention plus the method's term, which it does not have."""
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
    # another decode head, another backbone, a layer that is not mmseg's encoder layer: nothing converted
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
