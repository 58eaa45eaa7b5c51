"""``pid_plugins.finish_warmup(model)`` on mmseg's segmentor: its warm-up form (the stock attention plus the method's
term) kept at a fixed scale of 1 that is not saved, and the finished segmentor converted back to mmseg's own. The zoo
contract (tests/core/test_zoo_contract.py) finishes every method that warms up, built and converted."""
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


def test_a_finished_segmentor_converts_back_to_the_stock_one_bit_for_bit():
    from mmengine.registry import init_default_scope
    from mmseg.registry import MODELS

    model = pid_plugins.finish_warmup(train(build("learnable_pid", converted=True), N))
    for part in parts(model):  # a fixed scale: 1, a constant (not saved), whatever the mode
        assert part.method_scale().item() == 1.0 and "_warmup_finished" not in part.state_dict()
    weights = {k: v for k, v in zc_weights(model.state_dict()).items() if ".attention_params." not in k}
    pm.convert(model, "softmax")
    assert not any(hasattr(p, "_warmup_finished") or "_warmup_finished" in p._buffers for p in parts(model))
    assert all(type(layer) is TransformerEncoderLayer for p in parts(model) for layer in p.layers)
    init_default_scope("mmseg")
    stock = MODELS.build(segmentor_cfg()).eval()
    stock.load_state_dict(weights, strict=True)
    assert list(model.state_dict()) == list(stock.state_dict())
    assert torch.equal(logits(model), logits(stock))


def test_a_model_without_warmup_takes_the_method_path():
    model = pid_plugins.finish_warmup(build("pid", warmup_steps=0).eval())
    assert all(part.method_scale() is None for part in parts(model))  # no warm-up form
