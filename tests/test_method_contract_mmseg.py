"""The adapter contract in mmseg, with a method pid_plugins does not know: the toy ``scaled_reference``.

It reaches the ViT backbone and Segmenter's mask-transformer head through mmseg's own user path only
(``attention="scaled_reference"``, ``attention_cfg=...`` in a config dict or file): float64 references built by
hand from mmseg's stock modules, gamma = 0 is the stock model bit for bit, ``with_cp`` (mmseg's one checkpointing
mode) equals no checkpointing, torch.compile(fullgraph=True), save/reload through mmengine's checkpoint functions,
a config file that imports the method's module with ``custom_imports``, and the refusals.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("mmseg")
import pid_plugins.mmseg as pm  # noqa: E402
from pid_plugins import PIDConfig  # noqa: E402
from toy_method import METHOD, NAME, ScaledReferenceConfig, register_non_additive_method, toy_rule  # noqa: E402
from zoo_cases import assert_equal_or_both_none, mm_args, mm_compiled, mm_inputs, mmseg_reference  # noqa: E402
from zoo_cases import mm_build as build  # noqa: E402

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
GAMMA = 0.3
BACKBONE = mm_args("backbone")
HEAD = mm_args("head")
TOY = dict(attention=NAME, attention_cfg=dict(gamma=GAMMA))


def backbone(seed=0, **kw):
    return build("PIDVisionTransformer", BACKBONE, seed, **kw)


def stock_backbone(seed=0):
    return build("VisionTransformer", BACKBONE, seed)


def head(seed=0, **kw):
    return build("PIDSegmenterMaskTransformerHead", HEAD, seed, **kw)


def stock_head(seed=0):
    return build("SegmenterMaskTransformerHead", HEAD, seed)


def images(dtype=torch.float32):
    return mm_inputs("backbone", dtype)


def features(dtype=torch.float32):
    return mm_inputs("head", dtype, seed=2)


# ------------------------------------------------------------------------------------------ the user path
def test_the_toy_is_chosen_by_name_and_layers_take_over_mmseg_modules():
    from mmseg.models.backbones.vit import TransformerEncoderLayer

    stock, model = stock_backbone(), backbone(**TOY)
    assert model.attention_config == ScaledReferenceConfig(gamma=GAMMA) and model.attention_method is METHOD
    assert all(type(layer) is pm.PIDTransformerEncoderLayer and layer.attention_config == model.attention_config
               for layer in model.layers)
    assert all(isinstance(layer, TransformerEncoderLayer) and not layer.training for layer in model.layers)
    # the same modules and parameter names, and the same random initialisation (the conversion draws nothing)
    assert list(model.state_dict()) == list(stock.state_dict())
    for key, value in stock.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key
    h = head(**TOY)
    assert h.attention_config == ScaledReferenceConfig(gamma=GAMMA) and h.attention_method is METHOD
    assert all(type(layer) is pm.PIDTransformerEncoderLayer for layer in h.layers)
    assert list(h.state_dict()) == list(stock_head().state_dict())
    assert backbone(attention=NAME, attention_cfg="strong").attention_config.gamma == 2.0  # a preset name
    assert backbone(attention=NAME).attention_config.gamma == 0.5  # the method's default preset
    assert backbone(attention="softmax").attention_method is None


# ------------------------------------------------------------------------------------------ (a) references
def test_backbone_matches_a_float64_reference_from_stock_modules():
    stock = stock_backbone().double()
    model = backbone(**TOY).double()
    model.load_state_dict(stock.state_dict(), strict=True)
    x = images(torch.float64)
    with torch.no_grad():
        got = model(x)[0]
        want = mmseg_reference("backbone", stock, x, toy_rule(GAMMA))
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
        assert (got - stock(x)[0]).abs().max() > 1e-3  # the method changes the output


def test_decode_head_matches_a_float64_reference_from_stock_modules():
    stock = stock_head().double()
    model = head(**TOY).double()
    model.load_state_dict(stock.state_dict(), strict=True)
    x = features(torch.float64)
    with torch.no_grad():
        got = model(x)
        want = mmseg_reference("head", stock, x, toy_rule(GAMMA))  # the decoder's own group
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
        assert (got - stock(x)).abs().max() > 1e-3


# ------------------------------------------------------------------------------------------ (b) gamma = 0
def test_gamma_zero_is_the_stock_backbone_and_head_bit_for_bit():
    from mmseg.models.backbones.vit import TransformerEncoderLayer

    zero = dict(attention=NAME, attention_cfg=dict(gamma=0.0))
    stock, model = stock_backbone(), backbone(seed=1, **zero)
    model.load_state_dict(stock.state_dict(), strict=True)
    stock_h, model_h = stock_head(), head(seed=1, **zero)
    model_h.load_state_dict(stock_h.state_dict(), strict=True)
    assert all(type(layer) is TransformerEncoderLayer for layer in [*model.layers, *model_h.layers])
    with torch.no_grad():
        assert torch.equal(model(images())[0], stock(images())[0])
        assert torch.equal(model_h(features()), stock_h(features()))


# ------------------------------------------------------------------------------------------ (c) with_cp
def _train_step(model, inputs, out):
    model.train()
    inputs = [t.clone().requires_grad_() for t in inputs]
    y = out(model, inputs)
    (y.square().mean() + y.mean()).backward()
    return y.detach(), [t.grad for t in inputs] + [p.grad for p in model.parameters()]


@pytest.mark.parametrize("part", ["backbone", "head"])
def test_with_cp_equals_no_checkpointing(part):
    if part == "backbone":
        ref, ckpt = backbone(**TOY), backbone(**TOY, with_cp=True)
        inputs, out = [images()], lambda m, xs: m(xs[0])[0]
    else:
        ref, ckpt = head(**TOY), head(**TOY)
        for layer in ckpt.layers:  # mmseg's head has no with_cp argument: its layers' own flag
            layer.with_cp = True
        inputs, out = features(), lambda m, xs: m(xs)
    ckpt.load_state_dict(ref.state_dict())
    assert all(layer.with_cp for layer in ckpt.layers) and not any(layer.with_cp for layer in ref.layers)
    y_ref, g_ref = _train_step(ref, inputs, out)
    y_ckpt, g_ckpt = _train_step(ckpt, inputs, out)
    assert torch.equal(y_ref, y_ckpt)
    assert len(g_ref) == len(g_ckpt) and sum(g is not None for g in g_ref) > 10
    assert_equal_or_both_none(g_ref, g_ckpt)


# ------------------------------------------------------------------------------------------ (d) compile
@pytest.mark.slow
def test_backbone_compiles_fullgraph_and_equals_eager():
    model = backbone(**TOY)
    x = images()
    compiled = mm_compiled(model, x, "eager")  # mmengine modules: the bound forward compiled
    with torch.no_grad():
        torch.testing.assert_close(compiled, model(x)[0], rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------------------------------ (f) save/reload
def segmentor_cfg(**kw):
    return dict(
        type="EncoderDecoder",
        data_preprocessor=dict(type="SegDataPreProcessor", mean=[123.675, 116.28, 103.53], std=[58.395, 57.12, 57.375],
                               bgr_to_rgb=True, pad_val=0, seg_pad_val=255, size=(32, 32)),
        backbone=dict(type="PIDVisionTransformer", **BACKBONE, **TOY),
        decode_head=dict(type="PIDSegmenterMaskTransformerHead", **HEAD, **TOY, **kw),
        test_cfg=dict(mode="whole"),
    )


def test_segmentor_state_dict_saves_and_reloads_through_mmengine(tmp_path):
    from mmengine.registry import init_default_scope
    from mmengine.runner.checkpoint import load_checkpoint, save_checkpoint
    from mmseg.registry import MODELS

    init_default_scope("mmseg")
    torch.manual_seed(0)
    model = MODELS.build(segmentor_cfg())
    model.init_weights()
    model.eval()
    path = tmp_path / "iter_1.pth"
    save_checkpoint({"state_dict": model.state_dict(), "meta": {}}, str(path))
    torch.manual_seed(1)
    again = MODELS.build(segmentor_cfg())
    again.eval()
    load_checkpoint(again, str(path), map_location="cpu", strict=True)  # weights-only (pid_plugins.mmseg)
    x = images() * 50 + 100
    with torch.no_grad():
        want = model.encode_decode(x, [dict(img_shape=(32, 32))])
        assert torch.equal(again.encode_decode(x, [dict(img_shape=(32, 32))]), want)
        torch.manual_seed(1)
        fresh = MODELS.build(segmentor_cfg()).eval()
        assert (fresh.encode_decode(x, [dict(img_shape=(32, 32))]) - want).abs().max() > 1e-4  # loading mattered


# ------------------------------------------------------------------------------------------ config file
CONFIG = """
custom_imports = dict(imports=['toy_method', 'pid_plugins.mmseg'], allow_failed_imports=False)
model = {model!r}
"""


@pytest.mark.slow
def test_a_config_file_registers_the_method_and_the_plugin_with_custom_imports(tmp_path):
    """A fresh process: mmengine's ``Config.fromfile`` imports the user's method module and the plugin; mmseg's
    ``MODELS.build`` builds the segmentor; its output and weights equal this process's build of the same file."""
    path = tmp_path / "segmenter_toy.py"
    path.write_text(CONFIG.format(model=segmentor_cfg()))
    script = f"""
import sys, torch
from mmengine.config import Config
from mmengine.registry import init_default_scope
cfg = Config.fromfile({str(path)!r})
from mmseg.registry import MODELS
init_default_scope('mmseg')
torch.manual_seed(0)
model = MODELS.build(cfg.model)
model.init_weights()
model.eval()
assert type(model.backbone.layers[0]).__name__ == 'PIDTransformerEncoderLayer', model.backbone.layers[0]
assert model.backbone.attention_method.name == model.decode_head.attention_method.name == {NAME!r}
x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1)) * 50 + 100
with torch.no_grad():
    out = model.encode_decode(x, [dict(img_shape=(32, 32))])
torch.save(dict(state_dict=model.state_dict(), out=out), {str(tmp_path / 'out.pth')!r})
"""
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{TESTS}"}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=tmp_path,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    saved = torch.load(tmp_path / "out.pth", weights_only=True)

    from mmengine.config import Config
    from mmengine.registry import init_default_scope
    from mmseg.registry import MODELS

    cfg = Config.fromfile(str(path))
    assert cfg.model.backbone.attention_cfg == dict(gamma=GAMMA)
    init_default_scope("mmseg")
    model = MODELS.build(cfg.model).eval()
    model.load_state_dict(saved["state_dict"], strict=True)
    with torch.no_grad():
        assert torch.equal(model.encode_decode(images() * 50 + 100, [dict(img_shape=(32, 32))]), saved["out"])


# ------------------------------------------------------------------------------------------ (g) refusals
def test_refusals_say_what_to_change():
    with pytest.raises(ValueError, match=r"unknown ScaledReferenceConfig field\(s\) \['learnable'\]"):
        backbone(attention=NAME, attention_cfg=dict(learnable=True))
    for build_part in (backbone, head):
        with pytest.raises(ValueError, match=r"unknown attention method 'nope'.*'pid'.*'scaled_reference'"):
            build_part(attention="nope")
        with pytest.raises(ValueError, match="pid=... sets PID's gains but attention='scaled_reference'"):
            build_part(attention=NAME, pid=dict(lambda_p=0.1))
        assert build_part(attention="softmax", attention_cfg=dict(gamma=0.1)).attention_method is None  # the flip
        with pytest.raises(ValueError, match="ScaledReferenceConfig.gamma must be finite"):
            build_part(attention=NAME, attention_cfg=dict(gamma=float("nan")))
    with pytest.raises(ValueError, match=r"\['lambda_p'\] are PID's gains but attention='scaled_reference'"):
        backbone(attention=NAME, lambda_p=0.2)
    built = backbone(attention="pid", attention_cfg="deit", beta=0.5)
    assert built.attention_config == PIDConfig.preset("deit", beta=0.5)


def test_warmup_with_a_non_additive_method_is_refused(monkeypatch):
    doubled = register_non_additive_method(monkeypatch, "contract_mmseg_doubled")  # for this test only
    # without warm-up it builds
    assert backbone(attention="contract_mmseg_doubled").attention_config == doubled.config_type()
    for build_part in (backbone, head):
        with pytest.raises(ValueError, match="'contract_mmseg_doubled'.* not additive.*set warmup_steps=0"):
            build_part(attention="contract_mmseg_doubled", attention_cfg=dict(warmup_steps=10))
