"""``pid_plugins.finish_warmup(model)`` on mmseg models (issue 34): a Segmenter with a method in its ViT backbone and in
its mask-transformer head (PID, NeuTRENO, learnable PID; built from a config or converted), trained past
``warmup_steps``, then finished: it computes exactly (torch.equal) what the warmed-up model computed, its state_dict
has no ``attention_warmup.step``, and it runs at a fixed scale of 1 (mmseg's warm-up form, the stock attention plus the
method's term, kept; see ``pid_plugins.core.layer.finish_warmup``)."""
import copy
import logging

import pytest
import torch

from zoo_cases import weights as zc_weights

pytest.importorskip("mmseg")
import pid_plugins  # noqa: E402
import pid_plugins.mmseg as pm  # noqa: E402
from mmseg.models.backbones.vit import TransformerEncoderLayer  # noqa: E402
from method_cases import variants  # noqa: E402
from zoo_cases import mm_args  # noqa: E402

N = 3
SIZE = (32, 32)
#: every built-in method with warm-up (the preset), learnable too where it has learnable parameters
VARIANTS = variants(methods=lambda m: m.warmup)


def segmentor_cfg(attention=None, attention_cfg=None):
    method = {} if attention is None else dict(attention=attention, attention_cfg=attention_cfg)
    return dict(
        type="EncoderDecoder",
        data_preprocessor=dict(type="SegDataPreProcessor", mean=[123.675, 116.28, 103.53], std=[58.395, 57.12, 57.375],
                               bgr_to_rgb=True, pad_val=0, seg_pad_val=255, size=SIZE),
        backbone=dict(type="PIDVisionTransformer" if method else "VisionTransformer", **mm_args("backbone"), **method),
        decode_head=dict(type="PIDSegmenterMaskTransformerHead" if method else "SegmenterMaskTransformerHead",
                         **mm_args("head"), **method),
        test_cfg=dict(mode="whole"),
    )


def build(method, warmup_steps=N, converted=False, seed=0):
    from mmengine.registry import init_default_scope
    from mmseg.registry import MODELS

    attention, cfg = VARIANTS[method]
    cfg = dict(cfg or {}, warmup_steps=warmup_steps) if warmup_steps else cfg
    init_default_scope("mmseg")
    torch.manual_seed(seed)
    if converted:  # a stock segmentor switched in place
        model = MODELS.build(segmentor_cfg())
        model.init_weights()
        return pm.convert(model, attention, cfg)
    model = MODELS.build(segmentor_cfg(attention, cfg))
    model.init_weights()
    return model


def batch(n=2, seed=2):
    from mmengine.structures import PixelData
    from mmseg.structures import SegDataSample

    g = torch.Generator().manual_seed(seed)
    samples = []
    for _ in range(n):
        sample = SegDataSample(gt_sem_seg=PixelData(data=torch.randint(0, 5, (1, *SIZE), generator=g)))
        sample.set_metainfo(dict(img_shape=SIZE, pad_shape=SIZE))
        samples.append(sample)
    return torch.randn(n, 3, *SIZE, generator=g), samples


def train(model, steps):
    """``steps`` training steps of the segmentor's loss (one forward of backbone and head each), SGD."""
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    x, samples = batch()
    for _ in range(steps):
        loss, _ = model.parse_losses(model(x, samples, mode="loss"))
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    return model


def logits(model, seed=1):
    x = torch.randn(2, 3, *SIZE, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model.encode_decode(x, [dict(img_shape=SIZE)] * 2)


def parts(model):
    return (model.backbone, model.decode_head)


# converted: PID, fixed and learnable (conversion takes one path for every method:
# tests/zoos/mmseg/test_mmseg_convert.py)
CASES = [(method, False) for method in VARIANTS] + [("pid", True), ("learnable_pid", True)]


@pytest.mark.parametrize("method, converted", CASES)
def test_finished_segmentor_is_the_warmed_up_function_without_the_counter(method, converted):
    model = train(build(method, converted=converted), N)
    assert all(int(p.attention_warmup.step) == N for p in parts(model))  # t = N: the scale reached 1
    want = logits(model)
    gains = {n: p.clone() for n, p in model.named_parameters() if ".attention_params." in n}
    if method == "learnable_pid":  # the learned gains moved during warm-up (past each group's first layer)
        initial = dict(build(method, converted=converted).named_parameters())
        assert len(gains) == 15 and sum(not torch.equal(p, initial[n]) for n, p in gains.items()) >= 9
    assert pid_plugins.finish_warmup(model) is model
    assert all(p.attention_warmup is None and p.attention_config.warmup_steps == 0 for p in parts(model))
    assert all(layer.attention_config.warmup_steps == 0 for p in parts(model) for layer in p.layers)
    assert not any("attention_warmup" in k for k in model.state_dict())
    assert torch.equal(logits(model), want)
    assert all(torch.equal(p, gains[n]) for n, p in model.named_parameters() if ".attention_params." in n)
    # a fixed scale: 1, a constant (not saved), whatever the mode; training forwards count nothing
    for part in parts(model):
        assert part.method_scale().item() == 1.0 and "_warmup_finished" not in part.state_dict()
    plain = build(method, warmup_steps=0, converted=converted)  # the same model without warm-up: its keys
    assert list(model.state_dict()) == list(plain.state_dict())
    plain.load_state_dict(model.state_dict(), strict=True)
    plain.eval()
    # ... and, with these weights, the same function up to the rounding of mmseg's fused attention (the finished
    # model keeps the stock attention plus the method's term; the plain model takes the method path)
    torch.testing.assert_close(logits(plain), want, rtol=1e-5, atol=1e-5)
    train(model, 1)
    assert not any("attention_warmup" in k for k in model.state_dict())
    assert all(part.method_scale().item() == 1.0 for part in parts(model))


def test_finishing_early_warns_and_jumps_to_the_final_gains(caplog):
    model = train(build("pid", warmup_steps=5), 2)
    at_the_end = copy.deepcopy(model)
    for part in parts(at_the_end):
        part.attention_warmup.step.fill_(5)  # the same weights at t = N: scale 1
    with caplog.at_level(logging.WARNING, logger="pid_plugins.core.layer"):
        pid_plugins.finish_warmup(model)
    assert "had warmed up 2 of 5 steps (scale 0.400)" in caplog.text
    assert "backbone" in caplog.text and "decode_head" in caplog.text
    assert torch.equal(logits(model), logits(at_the_end))


def test_a_finished_segmentor_converts_back_to_the_stock_one_bit_for_bit():
    from mmengine.registry import init_default_scope
    from mmseg.registry import MODELS

    model = pid_plugins.finish_warmup(train(build("learnable_pid", converted=True), N))
    weights = {k: v for k, v in zc_weights(model.state_dict()).items() if ".attention_params." not in k}
    pm.convert(model, "softmax")
    assert not any(hasattr(p, "_warmup_finished") or "_warmup_finished" in p._buffers for p in parts(model))
    assert all(type(layer) is TransformerEncoderLayer for p in parts(model) for layer in p.layers)
    init_default_scope("mmseg")
    stock = MODELS.build(segmentor_cfg()).eval()
    stock.load_state_dict(weights, strict=True)
    assert list(model.state_dict()) == list(stock.state_dict())
    assert torch.equal(logits(model), logits(stock))


def test_a_model_without_warmup_is_unchanged_and_a_stock_one_is_refused():
    model = build("pid", warmup_steps=0).eval()
    want, keys = logits(model), list(model.state_dict())
    assert pid_plugins.finish_warmup(model) is model
    assert list(model.state_dict()) == keys and torch.equal(logits(model), want)
    assert all(part.method_scale() is None for part in parts(model))  # the method path, no warm-up form
    from mmengine.registry import init_default_scope
    from mmseg.registry import MODELS

    init_default_scope("mmseg")
    with pytest.raises(TypeError, match="EncoderDecoder has no attention method of pid-plugins"):
        pid_plugins.finish_warmup(MODELS.build(segmentor_cfg()))
