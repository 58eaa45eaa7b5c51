"""The timm adapter: PID DeiT/ViT by name, by kwarg, from softmax checkpoints, and timm's model contract."""
import ast
import importlib
import math

import pytest
import torch

from zoo_cases import assert_direct_path_equals_apply, weights as zc_weights
import torch.nn.functional as F

timm = pytest.importorskip("timm")
import pid_plugins.timm as pt  # noqa: E402
from pid_plugins import PIDConfig, list_models  # noqa: E402
from timm.models.deit import VisionTransformerDistilled  # noqa: E402

TINY = dict(img_size=32, patch_size=8, embed_dim=48, depth=3, num_heads=3, num_classes=10)
NAMES = [n for n in list_models(zoo="timm") if not n.startswith("pid_fan")]  # FAN: test_timm_fan.py


def pair(name="pid_deit_tiny_patch16_224", seed=0, **kwargs):
    """A PID model and the stock timm model of its base architecture, with identical weights."""
    base = pid_plugins_entry(name).base
    args = {**TINY, **kwargs}
    pid_kwargs = {k: args.pop(k) for k in ("attention_cfg", "attention") if k in args}
    torch.manual_seed(seed)
    stock = timm.create_model(base, **args)
    model = timm.create_model(name, **args, **pid_kwargs)
    result = model.load_state_dict(stock.state_dict(), strict=False)  # learnable gains are model-only
    assert not result.unexpected_keys and all(".attention_params." in k for k in result.missing_keys)
    return model.eval(), stock.eval()


def pid_plugins_entry(name):
    from pid_plugins import get_model_entry

    return get_model_entry(name)


def images(n=2, size=32, seed=1):
    return torch.randn(n, 3, size, size, generator=torch.Generator().manual_seed(seed))


def test_every_catalogue_name_is_registered_with_a_local_only_pretrained_cfg():
    assert set(NAMES) == {
        f"pid_deit_{s}_patch16_224" for s in ("tiny", "small", "base")
    } | {f"pid_deit_{s}_distilled_patch16_224" for s in ("tiny", "small", "base")} | {
        f"pid_vit_{s}_patch16_224" for s in ("tiny", "small", "base", "large")
    }
    assert set(NAMES) <= set(timm.list_models("pid_*"))
    for name in NAMES:
        cfg = timm.models.get_pretrained_cfg(name)
        assert cfg is not None and not cfg.url and not cfg.hf_hub_id and not cfg.file
        assert cfg.input_size == (3, 224, 224)
    assert timm.models.get_pretrained_cfg("pid_deit_tiny_distilled_patch16_224").classifier == ("head", "head_dist")
    assert timm.models.get_pretrained_cfg("pid_vit_base_patch16_224").mean == (0.5, 0.5, 0.5)


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_real_sizes_build_and_run_with_the_stock_state_dict_layout(name):
    entry = pid_plugins_entry(name)
    torch.manual_seed(0)
    with torch.device("meta"):
        stock = timm.create_model(entry.base)
    model = timm.create_model(name).eval()
    assert model.attention_config == PIDConfig.preset("deit")
    assert all(blk.attn.attention_config == model.attention_config for blk in model.blocks)
    sd = zc_weights(model.state_dict())
    assert list(sd) == list(stock.state_dict())
    assert all(sd[k].shape == v.shape for k, v in stock.state_dict().items())
    with torch.no_grad():
        out = model(torch.randn(1, 3, 224, 224))
    assert out.shape == (1, 1000) and torch.isfinite(out).all()


def test_gains_by_kwarg_and_validation():
    m = timm.create_model("pid_deit_small_patch16_224", attention_cfg=dict(lambda_p=0.5, beta=0.3), **TINY)
    assert m.attention_config.gains == (0.5, 0.5, 0.05, 0.3)
    assert all(blk.attn.attention_config == m.attention_config for blk in m.blocks)
    m = timm.create_model("pid_deit_tiny_patch16_224", attention_cfg="segmenter", **TINY)
    assert m.attention_config == PIDConfig.preset("segmenter")
    m = timm.create_model("pid_deit_tiny_patch16_224", attention_cfg=PIDConfig(0.1, 0.2, 0.3, 0.4), **TINY)
    assert m.attention_config.gains == (0.1, 0.2, 0.3, 0.4)
    with pytest.raises(ValueError, match="PIDConfig.beta must be in"):
        timm.create_model("pid_deit_tiny_patch16_224", attention_cfg=dict(beta=0.0), **TINY)
    with pytest.raises(ValueError, match="PIDConfig.lambda_p must be >= 0"):
        timm.create_model("pid_deit_tiny_patch16_224", attention_cfg=dict(lambda_p=-1), **TINY)
    with pytest.raises(ValueError, match="unknown attention method 'linear'"):
        timm.create_model("pid_deit_tiny_patch16_224", attention="linear", **TINY)
    with pytest.raises(RuntimeError, match="Unknown model"):
        timm.create_model("pid_deit_nano_patch16_224")


@pytest.mark.parametrize("name", ["pid_deit_tiny_patch16_224", "pid_deit_tiny_distilled_patch16_224"])
@pytest.mark.parametrize("kwargs", [dict(attention="softmax"), dict(attention_cfg=dict(lambda_p=0, lambda_i=0, lambda_d=0))])
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("dims", [dict(), dict(embed_dim=72, num_heads=3)], ids=["head_dim16", "head_dim24"])
def test_softmax_or_zero_gains_give_the_stock_model_bit_for_bit(name, kwargs, fused, dims):
    model, stock = pair(name, **kwargs, **dims)
    for m in (model, stock):
        for blk in m.blocks:
            blk.attn.fused_attn = fused
    x = images()
    with torch.no_grad():
        assert torch.equal(model(x), stock(x))
        assert torch.equal(model.forward_features(x), stock.forward_features(x))
    if "attention" in kwargs:
        assert model.attention_config is None and all(blk.attn.attention_config is None for blk in model.blocks)


def test_forward_head_and_features():
    model, _ = pair()
    x = images()
    with torch.no_grad():
        feats = model.forward_features(x)
        assert feats.shape == (2, 1 + 16, 48)
        torch.testing.assert_close(model.forward_head(feats), model(x))
        assert model.forward_head(feats, pre_logits=True).shape == (2, 48)


INTERMEDIATE_CASES = [
    dict(),
    dict(indices=2),
    dict(indices=[0, 2], norm=True),
    dict(indices=[1], output_fmt="NLC"),
    dict(indices=2, return_prefix_tokens=True),
    dict(indices=[0, 1], intermediates_only=True),
    dict(indices=[0], stop_early=True, intermediates_only=True),
    dict(indices=2, output_dict=True, return_prefix_tokens=True),
]


def _flatten(obj):
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for k in sorted(obj) for t in _flatten(obj[k])]
    return [t for o in obj for t in _flatten(o)]


@pytest.mark.parametrize("kwargs", INTERMEDIATE_CASES)
@pytest.mark.parametrize("name", ["pid_deit_tiny_patch16_224", "pid_deit_tiny_distilled_patch16_224"])
def test_forward_intermediates_follows_timm_exactly(kwargs, name):
    zero, stock = pair(name, attention_cfg=dict(lambda_p=0, lambda_i=0, lambda_d=0))
    x = images()
    with torch.no_grad():
        got, want = zero.forward_intermediates(x, **kwargs), stock.forward_intermediates(x, **kwargs)
    assert type(got) is type(want)
    got_t, want_t = _flatten(got), _flatten(want)
    assert len(got_t) == len(want_t) > 0
    for g, w in zip(got_t, want_t):
        assert torch.equal(g, w)


@pytest.mark.parametrize("name", ["pid_deit_tiny_patch16_224", "pid_deit_tiny_distilled_patch16_224"])
def test_reset_classifier(name):
    model, _ = pair(name)
    model.reset_classifier(5)
    assert model(images()).shape == (2, 5)
    model.reset_classifier(0)
    assert model(images()).shape == (2, 48)


def test_no_weight_decay_and_learnable_gains():
    model = timm.create_model("pid_deit_tiny_patch16_224", **TINY)
    assert {"pos_embed", "cls_token"} <= model.no_weight_decay()
    assert not any("attention_params" in n for n in model.no_weight_decay())
    learned = timm.create_model("pid_deit_tiny_patch16_224", attention_cfg=dict(learnable=True), **TINY)
    gains = {n for n, _ in learned.named_parameters() if "attention_params" in n}
    assert len(gains) == 3 * 3 and gains <= learned.no_weight_decay()
    assert learned.blocks[0].attn.attention_params()[0].item() == pytest.approx(0.8)  # lambda_p = softplus(raw)


def test_dynamic_img_size():
    model, stock = pair(dynamic_img_size=True, attention_cfg=dict(lambda_p=0, lambda_i=0, lambda_d=0))
    pid_model, _ = pair(dynamic_img_size=True)
    with torch.no_grad():
        for size in (32, 48, 64):
            x = images(size=size)
            assert torch.equal(model(x), stock(x))
            assert pid_model(x).shape == (2, 10)
            assert pid_model.forward_intermediates(x, indices=1, intermediates_only=True)[0].shape == (
                2, 48, size // 8, size // 8)


@pytest.mark.slow
def test_torch_compile_fullgraph_training_with_checkpointing():
    model, _ = pair(attention_cfg=dict(learnable=True))
    model.train().set_grad_checkpointing(True)
    ref, _ = pair(attention_cfg=dict(learnable=True))
    ref.load_state_dict(model.state_dict())
    ref.train()
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    x = images()
    compiled(x).square().mean().backward()
    ref(x).square().mean().backward()
    for (n, a), b in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6, msg=n)


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.inductor  # inductor's code generation (20 s of CPU); make test compiles with dynamo's eager backend
def test_torch_compile_inductor_matches_eager():
    model, _ = pair()
    x = images()
    torch._dynamo.reset()
    compiled = torch.compile(model)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_torch_export_replaces_torchscript():
    """torch.jit.script is deprecated in torch 2.x and cannot type the variadic PID state: export works."""
    model, _ = pair()
    x = images()
    exported = torch.export.export(model, (x,))
    with torch.no_grad():
        torch.testing.assert_close(exported.module()(x), model(x))


@pytest.fixture(scope="module")
def stock_deit_tiny():
    torch.manual_seed(0)
    return timm.create_model("deit_tiny_patch16_224").eval()


@pytest.mark.parametrize("fmt", ["pth", "wrapped", "safetensors"])
def test_pretrained_softmax_checkpoint_loads_strictly(stock_deit_tiny, tmp_path, fmt):
    sd = stock_deit_tiny.state_dict()
    if fmt == "safetensors":
        from safetensors.torch import save_file

        path = tmp_path / "deit_tiny_patch16_224.safetensors"
        save_file(sd, str(path))
    else:
        path = tmp_path / "deit_tiny_patch16_224.pth"
        torch.save({"model": sd, "epoch": 3} if fmt == "wrapped" else sd, path)
    model = timm.create_model("pid_deit_tiny_patch16_224", pretrained=True,
                              pretrained_cfg_overlay=dict(file=str(path))).eval()
    for k, v in zc_weights(model.state_dict()).items():
        assert torch.equal(v, sd[k]), k
    softmax = timm.create_model("pid_deit_tiny_patch16_224", pretrained=True, attention="softmax",
                                pretrained_cfg_overlay=dict(file=str(path))).eval()
    x = torch.randn(1, 3, 224, 224)
    with torch.no_grad():
        assert torch.equal(softmax(x), stock_deit_tiny(x))


def test_pretrained_softmax_checkpoint_into_learnable_gains(stock_deit_tiny, tmp_path):
    path = tmp_path / "w.pth"
    torch.save(stock_deit_tiny.state_dict(), path)
    model = timm.create_model("pid_deit_tiny_patch16_224", pretrained=True, attention_cfg=dict(learnable=True),
                              pretrained_cfg_overlay=dict(file=str(path)))
    assert model.blocks[5].attn.attention_params()[1].item() == pytest.approx(0.5)  # lambda_i = softplus(raw)
    assert torch.equal(model.blocks[5].attn.qkv.weight, stock_deit_tiny.blocks[5].attn.qkv.weight)


def test_checkpoint_with_missing_or_extra_keys_is_refused_with_the_keys(stock_deit_tiny, tmp_path):
    sd = dict(stock_deit_tiny.state_dict())
    del sd["blocks.3.attn.qkv.weight"]
    sd["blocks.3.attn.extra_scale"] = torch.ones(1)
    path = tmp_path / "broken.pth"
    torch.save(sd, path)
    with pytest.raises(ValueError) as info:
        timm.create_model("pid_deit_tiny_patch16_224", pretrained=True, pretrained_cfg_overlay=dict(file=str(path)))
    assert "missing keys ['blocks.3.attn.qkv.weight']" in str(info.value)
    assert "unexpected keys ['blocks.3.attn.extra_scale']" in str(info.value)


def test_missing_weights_file_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no pretrained weights file given for pid_deit_tiny_patch16_224"):
        timm.create_model("pid_deit_tiny_patch16_224", pretrained=True)
    missing = tmp_path / "nope.pth"
    with pytest.raises(FileNotFoundError, match=f"pretrained weights file not found: '{missing}'"):
        timm.create_model("pid_deit_tiny_patch16_224", pretrained=True, pretrained_cfg_overlay=dict(file=str(missing)))


@pytest.mark.slow
def test_checkpoints_load_with_weights_only(stock_deit_tiny, tmp_path, monkeypatch):
    calls = []
    original = torch.load

    def spy(*args, **kwargs):
        calls.append(kwargs.get("weights_only"))
        return original(*args, **kwargs)

    monkeypatch.setattr(torch, "load", spy)
    path = tmp_path / "w.pth"
    torch.save(stock_deit_tiny.state_dict(), path)
    timm.create_model("pid_deit_tiny_patch16_224", pretrained=True, pretrained_cfg_overlay=dict(file=str(path)))
    assert calls and all(c is True for c in calls)


def parse_model_kwargs(values):
    """What timm train.py's ParseKwargs action does with `--model-kwargs k=v ...`."""
    kw = {}
    for value in values:
        key, val = value.split("=", 1)
        try:
            kw[key] = ast.literal_eval(val)
        except ValueError:
            kw[key] = str(val)
    return kw


def test_the_calls_timm_train_py_makes(stock_deit_tiny, tmp_path):
    importlib.import_module("pid_plugins.timm")  # --device-modules pid_plugins.timm
    path = tmp_path / "deit_tiny_patch16_224.pth"
    torch.save(stock_deit_tiny.state_dict(), path)
    model_kwargs = parse_model_kwargs(["attention_cfg={'lambda_p': 0.5, 'beta': 0.3}"])
    model = timm.create_model(
        "pid_deit_tiny_patch16_224",
        pretrained=True,
        in_chans=3,
        num_classes=10,
        drop_rate=0.0,
        drop_path_rate=0.1,
        drop_block_rate=None,
        global_pool=None,
        bn_momentum=None,
        bn_eps=None,
        scriptable=False,
        checkpoint_path="",
        pretrained_cfg_overlay=dict(file=str(path), num_classes=-1),  # --pretrained-path
        **model_kwargs,
    )
    assert model.attention_config.gains == (0.5, 0.5, 0.05, 0.3)
    assert model.num_classes == 10 and model.head.out_features == 10
    assert torch.equal(model.blocks[11].mlp.fc2.weight, stock_deit_tiny.blocks[11].mlp.fc2.weight)
    from timm.optim import create_optimizer_v2

    opt = create_optimizer_v2(model, opt="adamw", lr=1e-3, weight_decay=0.05)
    assert len(opt.param_groups) == 2


def test_convert_refuses_what_it_cannot_convert_before_any_change():
    """timm's own refusals (the zoo contract, tests/core/test_zoo_contract.py, runs the common ones)."""
    import copy

    from timm.models.vision_transformer import Block, ResPostBlock

    with pytest.raises(TypeError, match="got ResNet"):
        pt.convert(timm.create_model("resnet10t"), "pid")
    post = timm.models.VisionTransformer(block_fn=ResPostBlock, **TINY)
    with pytest.raises(TypeError, match="block 0 is ResPostBlock"):
        pt.convert(post, "pid")
    model = timm.create_model("deit_tiny_patch16_224", **TINY)
    mixed, odd = copy.deepcopy(model), copy.deepcopy(model)
    mixed.blocks[2] = post.blocks[0]
    odd.blocks[2] = Block(48, num_heads=4)  # another number of heads: a model timm builds only by hand
    for bad, error, match in [(mixed, TypeError, "block 2 is ResPostBlock with Attention attention"),
                              (odd, ValueError, r"one \(num_heads, head_dim\).*\[\(3, 16\), \(4, 12\)\]")]:
        before = [(n, type(m)) for n, m in bad.named_modules()]
        with pytest.raises(error, match=match):
            pt.convert(bad, "pid")
        assert [(n, type(m)) for n, m in bad.named_modules()] == before and "pid_plugins_method" not in str(
            list(bad.state_dict()))
    with pytest.raises(ValueError, match="PIDConfig.lambda_d"):
        pt.convert(timm.create_model("deit_tiny_patch16_224", **TINY), "pid", dict(lambda_d=-0.1))
    with pytest.raises(ValueError, match=r"attention_cfg='twicing' names an attention method.*attention='twicing'"):
        pt.convert(timm.create_model("deit_tiny_patch16_224", **TINY), "pid", "twicing")
    with pytest.raises(ValueError, match=r"attention_cfg='twicing' names an attention method"):
        timm.create_model("pid_deit_tiny_patch16_224", attention_cfg="twicing", **TINY)
    with pytest.raises(TypeError, match="pid"):  # pid= is gone: attention_cfg= is the one spelling
        timm.create_model("pid_deit_tiny_patch16_224", pid=dict(lambda_p=0.5), **TINY)


@pytest.mark.slow
def test_fine_tune_a_softmax_checkpoint_into_pid_on_real_digits(tmp_path):
    """Pretrain a softmax DeiT briefly on real handwritten digits, load it into PID DeiT, fine-tune further."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    x = F.interpolate(x, size=16, mode="bilinear", align_corners=False).expand(-1, 3, -1, -1)
    y = torch.tensor(digits.target)
    args = dict(img_size=16, patch_size=4, embed_dim=48, depth=4, num_heads=3, num_classes=10)
    torch.manual_seed(0)
    stock = timm.create_model("deit_tiny_patch16_224", **args)

    def train(model, steps, seed):
        g = torch.Generator().manual_seed(seed)
        opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
        model.train()
        losses = []
        for _ in range(steps):
            idx = torch.randint(0, len(x) - 300, (64,), generator=g)
            loss = F.cross_entropy(model(x[idx]), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses

    train(stock, 150, seed=0)
    path = tmp_path / "softmax_digits.pth"
    torch.save(stock.state_dict(), path)
    model = timm.create_model("pid_deit_tiny_patch16_224", pretrained=True,
                              pretrained_cfg_overlay=dict(file=str(path), num_classes=10), **args)
    assert torch.equal(model.head.weight, stock.head.weight)

    def held_out(m):
        m.eval()
        with torch.no_grad():
            logits = m(x[-300:])
        return F.cross_entropy(logits, y[-300:]).item(), (logits.argmax(-1) == y[-300:]).float().mean().item()

    stock_loss, stock_acc = held_out(stock)
    assert stock_acc > 0.5, f"the softmax model did not learn the digits (held-out accuracy {stock_acc:.2f})"
    before, _ = held_out(model)
    losses = train(model, 60, seed=1)
    after, acc = held_out(model)
    assert all(math.isfinite(v) for v in losses)
    assert after < before
    assert acc > 0.4, f"the fine-tuned PID model (chance: 0.1) reached only {acc:.2f} held-out accuracy"


@pytest.mark.parametrize("attention", ["pid", "neutreno"])
def test_the_direct_path_equals_core_apply_bit_for_bit(attention, monkeypatch):
    """Methods that call attention once take update_once (no LayerCall); core's apply gives the same output and
    gradients, bit for bit."""
    import pid_plugins.timm._helpers as helpers

    model, _ = pair(attention=attention)
    x = images()

    def step():
        model.zero_grad(set_to_none=True)
        out = model(x)
        out.square().sum().backward()
        return [out.detach(), *(p.grad for p in model.parameters() if p.grad is not None)]

    assert_direct_path_equals_apply(helpers, step, monkeypatch)


def test_convert_keeps_a_users_hooks_and_timms_weight_decay_groups():
    """A forward hook on a block survives the blocks' replacement both ways; a converted root keeps timm's
    ``no_weight_decay``: timm's optimizer factory leaves the learnable gains undecayed."""
    from timm.optim import param_groups_weight_decay

    model = timm.create_model("deit_tiny_patch16_224", **TINY).eval()
    calls = []
    model.blocks[1].register_forward_hook(lambda *args: calls.append(1))
    pt.convert(model, "pid", {"learnable": True})
    undecayed = {id(p) for g in param_groups_weight_decay(model, 0.05) if g["weight_decay"] == 0 for p in g["params"]}
    assert all(id(p) in undecayed for n, p in model.named_parameters() if ".attention_params." in n)
    with torch.no_grad():
        model(images())
        pt.convert(model, "softmax")(images())
    assert len(calls) == 2


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["deit", "fan"])
def test_a_finished_model_traces_with_fx_and_exports_with_timms_onnx_export(kind, tmp_path):
    """After finish_warmup: no counter in timm's fx graph, and timm's onnx_export runs it in onnxruntime."""
    import numpy as np
    from timm.models import create_feature_extractor
    from timm.utils.onnx import onnx_export

    import pid_plugins
    from pid_plugins.core.methods import _fx_update
    from zoo_cases import TIMM

    onnxruntime = pytest.importorskip("onnxruntime")
    name, _, args = TIMM[kind]
    model = timm.create_model(name, attention_cfg={"learnable": True, "warmup_steps": 3}, **args).train()
    x = images(n=3, size=args["img_size"])
    for _ in range(4):
        model(x).sum().backward()
    model = pid_plugins.finish_warmup(model.eval())
    with torch.no_grad():
        want = model(x)
    extractor = create_feature_extractor(model, return_nodes={"head": "logits"})
    nodes = list(extractor.graph.nodes)
    assert sum(n.op == "call_function" and n.target is _fx_update for n in nodes) == len(model.blocks)
    assert not any("attention_warmup" in str(n.target) for n in nodes)
    with torch.no_grad():
        assert torch.equal(extractor(x)["logits"], want)
    path = tmp_path / "model.onnx"
    onnx_export(model, str(path), input_size=(3, args["img_size"], args["img_size"]), batch_size=2, check=True)
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    got = torch.from_numpy(session.run(None, {"input0": x.numpy().astype(np.float32)})[0])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_model_built_by_pid_name_to_softmax_keeps_its_class_and_computes_the_stock_model():
    model = timm.create_model("pid_deit_tiny_patch16_224", attention_cfg={"learnable": True, "warmup_steps": 3},
                              **TINY).eval()
    torch.manual_seed(0)
    reference = timm.create_model("deit_tiny_patch16_224", **TINY).eval()
    model.load_state_dict(reference.state_dict(), strict=False)
    pt.convert(model, "softmax")
    assert type(model) is pt.PIDVisionTransformer and model.attention_method is None
    assert model.attention_warmup is None and model.blocks.warmup_counter is None
    assert list(model.state_dict()) == list(reference.state_dict())  # no gains, no counter
    mask = torch.zeros(17, 17)
    with torch.no_grad():
        assert torch.equal(model(images()), reference(images()))
        assert torch.equal(model(images(), attn_mask=mask), reference(images(), attn_mask=mask))
