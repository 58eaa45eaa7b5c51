"""The attention-method contract in timm, on the toy method ``scaled_reference`` (tests/toy_method.py).

The toy reaches timm only through ``pid_plugins.register_method`` and the user's ``attention="scaled_reference"``
(no adapter code knows it): DeiT/ViT and FAN, by name, by ``to_pid``, through checkpointing, torch.compile,
timm's save/load, ``features_only`` / ``forward_intermediates`` and torch.fx feature extraction. timm's models
have no cached/incremental generation, so the contract's KV-cache case does not apply here.
"""
from typing import Optional

import pytest
import torch

timm = pytest.importorskip("timm")
import pid_plugins  # noqa: E402
import pid_plugins.timm as pt  # noqa: E402
from pid_plugins.core.methods import method_update  # noqa: E402
from toy_method import METHOD, NAME, ScaledReference, ScaledReferenceConfig, toy_rule  # noqa: E402
from zoo_cases import (DEIT, FAN, set_fused, timm_checkpointing_results, timm_load_pretrained,  # noqa: E402
                       timm_reference)
from zoo_cases import TIMM as MODELS  # noqa: E402
from zoo_cases import timm_images as images  # noqa: E402
from zoo_cases import timm_pair  # noqa: E402


def pair(kind, gamma: Optional[float] = 0.5, seed=0):
    """The toy-method model (by its PID name, ``attention="scaled_reference"``) and the stock timm model, with
    identical weights."""
    return timm_pair(kind, seed, attention=NAME, attention_cfg=None if gamma is None else {"gamma": gamma})


# ------------------------------------------------------------------------------------------ selection
@pytest.mark.parametrize("kind", sorted(MODELS))
def test_selected_by_name_through_create_model(kind):
    model, _ = pair(kind, gamma=None)
    assert model.attention_method is METHOD
    assert model.attention_config == ScaledReferenceConfig(gamma=0.5)  # its own default
    assert all(blk.attn.attention_method is METHOD and blk.attn.attention_config == model.attention_config
               for blk in model.blocks)
    model, _ = pair(kind, gamma=0.25)
    assert model.attention_config.gamma == 0.25 and model.attention_warmup is None
    preset = timm.create_model(MODELS[kind][0], attention=NAME, attention_cfg="strong", **MODELS[kind][2])
    assert preset.attention_config.gamma == 2.0
    if kind == "fan":  # the softmax names pid_plugins registers (fan_*) take the method too
        assert timm.create_model(MODELS[kind][1], attention=NAME, **FAN).attention_method is METHOD
    # the state is threaded as len(state_fields) flat tensors: a block is an ordinary module of tensors
    args = (4, 1) if kind == "fan" else ()
    x = torch.randn(2, 4, 48)
    out = model.blocks[0](x, *args)
    assert isinstance(out, tuple) and len(out) == 1 + len(METHOD.state_fields)
    out2 = model.blocks[1](out[0], *args, *out[1:])
    assert len(out2) == 2 and out2[1] is out[1]  # v^1 handed on unchanged


def test_softmax_and_pid_names_keep_working():
    deit = timm.create_model("pid_deit_tiny_patch16_224", **DEIT)
    assert type(deit.attention_method).__name__ == "PIDMethod"
    assert deit.attention_config == pid_plugins.PIDConfig.preset("deit")
    assert timm.create_model("pid_deit_tiny_patch16_224", attention="softmax", **DEIT).attention_method is None
    fan = timm.create_model("fan_tiny_12_p16_224", **FAN)
    assert fan.attention_config is None and fan.attention_method is None


# ------------------------------------------------------------------------- (a) an independent reference
@pytest.mark.parametrize("kind", sorted(MODELS))
def test_whole_model_matches_an_independent_float64_reference(kind):
    """The stock DeiT / FAN modules, float64, attention by hand, the toy rule from ``naive_scaled_reference``."""
    model, stock = pair(kind, gamma=0.7)
    model, stock = model.double(), stock.double()
    x = images(kind).double()
    with torch.no_grad():
        want = timm_reference(kind, stock, x, toy_rule(0.7))
        torch.testing.assert_close(model(x), want, rtol=1e-10, atol=1e-10)
        assert not torch.allclose(stock(x), want)


# ------------------------------------------------------------------------------ (b) gamma = 0 is stock
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("kind", sorted(MODELS))
def test_gamma_zero_is_the_stock_model_bit_for_bit(kind, fused):
    model, stock = pair(kind, gamma=0.0)
    set_fused((model, stock), fused)
    x = images(kind)
    with torch.no_grad():
        assert torch.equal(model(x), stock(x))
        got = model.forward_intermediates(x, indices=[0, 2], intermediates_only=True)
        want = stock.forward_intermediates(x, indices=[0, 2], intermediates_only=True)
        assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert model.blocks[0].attn.state_size == 0  # the stock code path: nothing threaded


# ------------------------------------------------------------------------------ (c) gradient checkpointing
@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("kind", sorted(MODELS))
def test_gradient_checkpointing_equals_no_checkpointing(kind, reentrant):
    ref, _ = pair(kind)
    ckpt, _ = pair(kind)
    ckpt.set_grad_checkpointing(True)
    results = timm_checkpointing_results(timm, (ref, ckpt), lambda: images(kind), reentrant)
    assert len(results[0]) == len(results[1])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------- (d) compile
@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(MODELS))
def test_compile_fullgraph_equals_eager(kind):
    model, _ = pair(kind)
    x = images(kind)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------------- (f) save / reload
@pytest.mark.parametrize("kind", sorted(MODELS))
def test_timm_save_and_load_give_the_same_outputs(kind, tmp_path):
    name, _, cfg = MODELS[kind]
    model, _ = pair(kind, gamma=0.3, seed=3)
    path = tmp_path / "model.pth"
    torch.save(model.state_dict(), path)
    x = images(kind)
    loaded = timm_load_pretrained(name, path, attention=NAME, attention_cfg={"gamma": 0.3}, **cfg)
    other = timm.create_model(name, attention=NAME, attention_cfg={"gamma": 0.3}, **cfg).eval()
    timm.models.load_checkpoint(other, str(path))  # validate.py's path (weights-only)
    with torch.no_grad():
        want = model(x)
        assert torch.equal(loaded(x), want) and torch.equal(other(x), want)


# ------------------------------------------------------------------------------------- (g) refusals
def test_learnable_and_unknown_names_are_refused_clearly():
    with pytest.raises(ValueError, match="learnable"):
        timm.create_model("pid_deit_tiny_patch16_224", attention=NAME, attention_cfg={"learnable": True}, **DEIT)
    with pytest.raises(ValueError, match="learnable") as info:
        timm.create_model("pid_fan_tiny_12_p16_224", attention=NAME, attention_cfg={"learnable": True}, **FAN)
    assert "gamma" in str(info.value)  # what it does take
    for name in ("pid_deit_tiny_patch16_224", "fan_tiny_12_p16_224"):
        with pytest.raises(ValueError, match="unknown attention method 'scaled_referense'") as info:
            timm.create_model(name, attention="scaled_referense", **MODELS["deit" if "deit" in name else "fan"][2])
        assert NAME in str(info.value) and "'pid'" in str(info.value) and "'softmax'" in str(info.value)
    with pytest.raises(ValueError, match="pid=... sets PID's gains"):
        timm.create_model("pid_deit_tiny_patch16_224", attention=NAME, pid=dict(lambda_p=0.1), **DEIT)


# ------------------------------------------------------------------------------------------- to_pid
def test_to_pid_converts_a_stock_model_to_the_method_in_place():
    model, stock = pair("deit", gamma=0.4)
    before = {k: v.clone() for k, v in stock.state_dict().items()}
    x = images("deit")
    with torch.no_grad():
        y_stock = stock(x)
    converted = pt.to_pid(stock, {"gamma": 0.4}, attention=NAME)
    assert converted is stock and type(converted) is pt.PIDVisionTransformer and not converted.training
    assert converted.attention_method is METHOD and converted.attention_config == ScaledReferenceConfig(gamma=0.4)
    assert list(converted.state_dict()) == list(before)
    with torch.no_grad():
        assert torch.equal(converted(x), model(x))
        assert torch.equal(pt.to_pid(converted, {"gamma": 0.0}, attention=NAME)(x), y_stock)  # reconfigured
        assert torch.equal(pt.to_pid(converted, attention="softmax")(x), y_stock)  # the stock model again


# -------------------------------------------------------------------- features_only / intermediates / fx
@pytest.mark.parametrize("kind", sorted(MODELS))
def test_features_only_and_intermediates(kind):
    name, _, cfg = MODELS[kind]
    model, _ = pair(kind)
    x = images(kind)
    feats = timm.create_model(name, features_only=True, out_indices=(1, 2), attention=NAME, **cfg).eval()
    result = feats.model.load_state_dict(model.state_dict(), strict=False)  # timm's getter wraps the model
    assert not result.missing_keys
    with torch.no_grad():
        final, inter = model.forward_intermediates(x, indices=[1, 2])
        torch.testing.assert_close(final, model.forward_features(x), rtol=0, atol=0)
        got = feats(x)
        assert len(got) == 2 and all(torch.equal(g, w) for g, w in zip(got, inter))
        early = model.forward_intermediates(x, indices=[1], stop_early=True, intermediates_only=True)
        assert torch.equal(early[0], inter[0])


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_fx_feature_extraction(kind):
    from timm.models import create_feature_extractor

    name, _, cfg = MODELS[kind]
    model, _ = pair(kind)
    extractor = create_feature_extractor(model, return_nodes={"blocks.1.add_1": "block", "head": "logits"})
    steps = [n for n in extractor.graph.nodes if n.op == "call_function" and n.target is method_update]
    assert len(steps) == len(model.blocks)  # the method's update: one leaf call per layer
    x = images(kind)
    with torch.no_grad():
        out = extractor(x)
        torch.testing.assert_close(out["logits"], model(x), rtol=0, atol=0)
        want = model.forward_intermediates(x, indices=[1], output_fmt="NLC", intermediates_only=True)[0]
        prefix = model.num_prefix_tokens if kind == "deit" else 0
        torch.testing.assert_close(out["block"][:, prefix:], want, rtol=0, atol=0)
    # timm's fx feature wrapper returns each block's output tokens (NLC, prefix tokens included)
    torch.manual_seed(5)
    fx_feats = timm.create_model(name, features_only=True, feature_cls="fx", out_indices=(1, 2), attention=NAME, **cfg)
    torch.manual_seed(5)
    model = timm.create_model(name, attention=NAME, **cfg).eval()  # the same weights
    with torch.no_grad():
        want = model.forward_intermediates(x, indices=[1, 2], output_fmt="NLC", intermediates_only=True)
        got = fx_feats.eval()(x)
        assert len(got) == 2 and all(torch.equal(g[:, prefix:], w) for g, w in zip(got, want))


# ------------------------------------------------------------- a method that calls the attention itself
class ScaledReferenceAttend(ScaledReference):
    """The toy with its own ``attend`` (the same computation): the layer then runs the method's ``forward``."""

    name = "scaled_reference_attend"
    calls = 0

    def attend(self, params, attend, query, value, state=None, head_dim=-3):
        type(self).calls += 1
        return attend(query, value)


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_a_method_with_its_own_attend_is_called_through_it(kind):
    method = pid_plugins.register_method(ScaledReferenceAttend(), replace=True)
    name, _, cfg = MODELS[kind]
    model, _ = pair(kind, gamma=0.6)
    other = timm.create_model(name, attention=method.name, attention_cfg={"gamma": 0.6}, **cfg).eval()
    other.load_state_dict(model.state_dict())
    x = images(kind)
    before = ScaledReferenceAttend.calls
    with torch.no_grad():
        assert torch.equal(other(x), model(x))
    assert ScaledReferenceAttend.calls - before == len(model.blocks)
    from timm.models import create_feature_extractor

    extractor = create_feature_extractor(other, return_nodes={"head": "logits"})
    with torch.no_grad():
        torch.testing.assert_close(extractor(x)["logits"], model(x), rtol=0, atol=0)
