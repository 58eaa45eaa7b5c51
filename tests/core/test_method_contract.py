"""The attention-method contract: every method (pid, neutreno, twicing, elliptical, value_residual and the toy
``scaled_reference`` a user registers, tests/toy_method.py) x every zoo model (timm DeiT and FAN, a transformers
Llama with grouped-query attention and BERT, mmseg's ViT backbone and Segmenter head, fairseq's transformer_lm),
one parametrised test per property; tests/method_cases.py says which pair applies and with which parameters and
independent float64 rule (pairs that do not apply are not generated).

Properties: selected by name (the method and its parameters reach every layer; unset parameters are the zoo's
preset), ``attention="softmax"`` is the stock model, the whole model matches a float64 reference built from the
stock modules (attention by hand, tests/zoo_cases.py), switched off (zero parameters) is the stock model bit for
bit, gradient checkpointing equals none (fairseq: refused), torch.compile(fullgraph=True) equals eager, a save/load
round trip gives the same outputs, cached decoding equals recomputation and no position reads a later token.

The toy method's own paths through each zoo (refusals, conversion, feature extraction, config files, the
fairseq-train CLI) follow at the end.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import pid_plugins
import zoo_cases as zc
from method_cases import CAUSAL, METHODS, MODELS, cases, method_cfg
from pyexec import run_python_c

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one torch thread (tests/conftest.py)


@pytest.fixture(autouse=True)
def toy_registered():
    """The toy is registered on import of tests/toy_method.py, exactly as a user registers a method."""
    import toy_method  # noqa: F401


def method_of(name):
    import toy_method  # noqa: F401  (registers scaled_reference)

    return pid_plugins.get_method(name)


def configs_of(model_case, model):
    """The (attention_method, attention_config) of every attention layer of ``model`` (hf: of its config)."""
    if model_case.zoo == "hf":
        import pid_plugins.hf as ph

        return [(ph.method_of(model.config), ph.model_method_config(model.config))]
    layers = model_case.attention_layers(model)
    assert layers
    top = [] if model_case.zoo == "fairseq" else [(model.attention_method, model.attention_config)]
    return top + [
        (layer.attention_method if hasattr(layer, "attention_method") else model.attention_method,
         layer.attention_config) for layer in layers]


# ================================================================================================ selection
@pytest.mark.parametrize("method, model_case", cases())
def test_selected_by_name_with_its_parameters_or_the_zoo_preset(method, model_case):
    expected = method_of(method.name)
    cfg = method_cfg(method, model_case)
    for given in (cfg, None):
        model, _ = model_case.pair(method.name, given)
        if model_case.zoo == "hf":
            assert model.config._attn_implementation == method.name
        want = method.config(given, model_case.zoo)
        assert isinstance(want, method.config_type())
        for got_method, got_config in configs_of(model_case, model):
            assert got_method is expected and got_config == want


@pytest.mark.parametrize("model_case", [pytest.param(m, id=m.name) for m in MODELS.values()])
def test_softmax_is_the_stock_model_bit_for_bit(model_case):
    """``attention="softmax"`` (transformers: the method model converted back to it) is the stock model."""
    if model_case.name == "hf-llama":
        import pid_plugins.hf as ph

        model, stock = model_case.pair("pid", None, seed=2)
        ph.convert(model, "softmax")
        assert model.config._attn_implementation == "sdpa"
    else:
        model, stock = model_case.pair("softmax", None, seed=2)
    x = model_case.inputs()
    with torch.no_grad():
        assert torch.equal(model_case.out(model, x), model_case.out(stock, x))
    if model_case.zoo in ("timm", "mmseg"):
        assert model.attention_method is None
    elif model_case.zoo == "fairseq":
        assert all(layer.attention_method is None for layer in model_case.attention_layers(model))


@pytest.mark.parametrize("method", [pytest.param(m, id=m.name) for m in METHODS.values() if m.models & CAUSAL])
def test_the_tables_causal_parameters_are_needed_and_accepted_in_a_causal_model_with_a_cache(method):
    """``causal_cfg`` (what transformers' decoding tests run, method_cases.CAUSAL_METHODS): the method's own check
    accepts it over the transformers preset in a causal call with a KV cache, and it is set only where that preset
    alone is refused there."""
    from pid_plugins.core import AttentionContext

    impl, context = method.impl, AttentionContext(causal=True, cached=True)
    impl.check(impl.configure(method.causal_cfg, "hf"), context)
    if method.causal_cfg is not None:
        with pytest.raises(ValueError, match=repr(method.name)):
            impl.check(impl.configure(None, "hf"), context)


# ================================================================================================ (a) reference
@pytest.mark.parametrize("method, model_case, cfg", cases(with_cfg=True))
def test_matches_an_independent_float64_reference(method, model_case, cfg):
    """The whole model in float64 against the stock model's modules run by hand with the method's rule (written
    from the official code in tests/zoo_cases.py), and the method does change the output."""
    model, stock = model_case.pair(method.name, cfg)
    model, stock = model.double(), stock.double()
    x = model_case.inputs(torch.float64)
    rule = method.rule(cfg, model_case)
    with torch.no_grad():
        got = model_case.out(model, x)
        want = model_case.reference(stock, x, rule)
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
        assert not torch.allclose(model_case.out(stock, x), want)  # the method changes the output
        if model_case.name == "hf-llama":  # ... by more than the float32 comparisons' tolerances there (5e-5)
            assert (model_case.out(stock, x) - want).abs().max() > 5e-5
        if model_case.zoo == "timm":  # the normed features too
            features = zc.timm_reference(model_case.kind, stock, x, rule, features=True)
            torch.testing.assert_close(model.forward_features(x), features, rtol=1e-10, atol=1e-10)
            assert (stock.forward_features(x) - features).abs().max() > 1e-4


# ================================================================================================ (b) zero
@pytest.mark.parametrize("method, model_case", cases(pair=lambda method, model: model.name in method.zero_models))
def test_switched_off_is_the_stock_model_bit_for_bit(method, model_case):
    model, stock = model_case.pair(method.name, method.zero)
    x = model_case.inputs()
    identity = method_of(method.name).is_identity(method.config(method.zero, model_case.zoo))
    with torch.no_grad():
        assert torch.equal(model_case.out(model, x), model_case.out(stock, x))
    if model_case.zoo == "timm":
        for fused in (True, False):
            zc.set_fused((model, stock), fused)
            with torch.no_grad():
                assert torch.equal(model(x), stock(x))
                got = model.forward_intermediates(x, indices=[0, 2], intermediates_only=True)
                want = stock.forward_intermediates(x, indices=[0, 2], intermediates_only=True)
                assert len(got) == 2 and all(torch.equal(g, w) for g, w in zip(got, want))
        if identity:
            assert model.blocks[0].attn.state_size == 0  # the stock code path: nothing threaded
    elif model_case.name == "hf-llama":  # cached greedy generation, and left padding
        with torch.no_grad():
            assert torch.equal(zc.hf_greedy(model, x), zc.hf_greedy(stock, x))
        x[0, :2] = 0
        mask = (x != 0).long()
        with torch.no_grad():
            assert torch.equal(model(x, attention_mask=mask).logits, stock(x, attention_mask=mask).logits)
    elif model_case.zoo == "mmseg" and identity:
        from mmseg.models.backbones.vit import TransformerEncoderLayer

        assert all(type(layer) is TransformerEncoderLayer for layer in model.layers)  # mmseg's own layers
    elif model_case.zoo == "fairseq":
        x[0, -3:] = 1  # padding
        with torch.no_grad():
            assert torch.equal(model(x)[0], stock(x)[0])
        for m in (stock, model):  # training mode, with dropout: the same draws, outputs and gradients
            m.train()
            m.decoder.dropout_module.p = 0.1
        torch.manual_seed(5)
        a = stock(x)[0]
        torch.manual_seed(5)
        b = model(x)[0]
        assert torch.equal(a, b)
        a.sum().backward()
        b.sum().backward()
        assert all(torch.equal(p.grad, q.grad) for p, q in zip(stock.parameters(), model.parameters()))


# ================================================================================================ (c) checkpointing
@pytest.mark.parametrize("method, model_case", cases(models=lambda m: m.zoo == "timm"))
@pytest.mark.parametrize("reentrant", [False, True])
def test_timm_gradient_checkpointing_equals_no_checkpointing(method, model_case, reentrant):
    timm = zc.import_timm()
    cfg = method_cfg(method, model_case)
    ref, _ = model_case.pair(method.name, cfg)
    ckpt, _ = model_case.pair(method.name, cfg)
    ckpt.set_grad_checkpointing(True)
    results = zc.timm_checkpointing_results(timm, (ref, ckpt), lambda: model_case.inputs(), reentrant)
    assert len(results[0]) == len(results[1]) == 2 + len(list(ref.parameters()))
    assert all(r is not None for r in results[0])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("method, model_case", cases(models=lambda m: m.zoo == "hf"))
def test_hf_gradient_checkpointing_equals_no_checkpointing(method, model_case):
    """The causal LM with ``use_cache=False`` and ``True`` in training (transformers' checkpointed layers drop the
    cache, and the method's cache slot follows them: a slot filled by the recomputation too would hold every position
    twice)."""
    x = model_case.inputs()
    if model_case.name == "hf-llama":
        forwards, every = [zc.causal_lm_loss(x, use_cache=False), zc.causal_lm_loss(x, use_cache=True)], True
    else:
        def forward(m):
            out = m(x).last_hidden_state
            return out, out.square().mean()
        forwards, every = [forward], False  # BERT's pooler takes no part
    for forward in forwards:
        model, _ = model_case.pair(method.name, method_cfg(method, model_case))
        model.train()
        plain, ckpt = zc.hf_checkpointing_grads(model, forward, every_parameter=every)
        assert plain.keys() == ckpt.keys() and len(plain) > 10
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    with pytest.raises(ValueError, match="use_reentrant': False"):  # the adapter's one refusal, for every method
        forward(model)


@pytest.mark.parametrize("method, model_case", cases(models=lambda m: m.zoo == "mmseg"))
def test_mmseg_with_cp_equals_no_checkpointing(method, model_case):
    """mmseg's one checkpointing mode (every layer's ``with_cp``): outputs and gradients equal bit for bit."""
    part = model_case.kind
    cfg = method_cfg(method, model_case)
    _, results = zc.mm_with_cp_runs(part, lambda: model_case.pair(method.name, cfg)[0])
    assert sum(g is not None for g in results[0]) > 10
    zc.assert_equal_or_both_none(*results)


@pytest.mark.parametrize("method, model_case", cases(models=lambda m: m.zoo == "fairseq"))
def test_fairseq_checkpoint_activations_is_refused(method, model_case):
    """fairseq's checkpointing (--checkpoint-activations) is not supported by transformer_lm_pid: refused at build."""
    with pytest.raises(ValueError, match="--checkpoint-activations is not supported by transformer_lm_pid"):
        zc.fs_build(zc_fairseq_data(), extra=[*zc.fs_method(method.name, method_cfg(method, model_case)),
                                              "--checkpoint-activations"])


def zc_fairseq_data():
    from method_cases import fairseq_data

    return fairseq_data()


# ================================================================================================ (d) compile
@pytest.mark.slow
@pytest.mark.parametrize("method, model_case", cases(
    pair=lambda method, model: model.compile_backend is not None and model.name in method.compile_models))
def test_compile_fullgraph_equals_eager(method, model_case):
    backend, (rtol, atol) = method.compile_overrides.get(
        model_case.name, (model_case.compile_backend, model_case.compile_tol))
    model, _ = model_case.pair(method.name, method_cfg(method, model_case))
    x = model_case.inputs()
    torch._dynamo.reset()
    try:
        with torch.no_grad():
            want = model_case.out(model, x)
            if model_case.zoo == "mmseg":
                got = zc.mm_compiled(model, x, backend)  # mmengine modules: the bound forward compiled
            elif model_case.zoo == "fairseq":
                got = torch.compile(model.decoder, fullgraph=True, backend=backend)(x)[0]
            else:
                got = model_case.out(torch.compile(model, fullgraph=True, backend=backend), x)
    finally:
        torch._dynamo.reset()
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol)


# ================================================================================================ (e) save / load
@pytest.mark.parametrize("method, model_case", cases())
def test_save_and_load_give_the_same_outputs(method, model_case, tmp_path):
    cfg = method_cfg(method, model_case)
    model, _ = model_case.pair(method.name, cfg, seed=3)
    x = model_case.inputs()
    loaded = []
    if model_case.zoo == "timm":
        timm = zc.import_timm()
        name, _, args = zc.TIMM[model_case.kind]
        path = tmp_path / "model.pth"
        torch.save(model.state_dict(), path)
        loaded.append(zc.timm_load_pretrained(name, path, attention=method.name, attention_cfg=cfg, **args))
        other = model_case.build(method.name, cfg, seed=4)
        timm.models.load_checkpoint(other, str(path))  # validate.py's path (weights-only)
        loaded.append(other)
    elif model_case.zoo == "hf":
        T = zc.import_transformers()
        import pid_plugins.hf as ph

        model.save_pretrained(tmp_path)
        cls = T.AutoModelForCausalLM if model_case.name == "hf-llama" else T.BertModel
        again = cls.from_pretrained(tmp_path).eval()
        assert again.config._attn_implementation == method.name
        assert ph.model_method_config(again.config) == method.config(cfg, "hf")
        loaded.append(again)
    elif model_case.zoo == "mmseg":
        from mmengine.runner.checkpoint import load_checkpoint, save_checkpoint

        path = tmp_path / "iter_1.pth"
        save_checkpoint({"state_dict": model.state_dict(), "meta": {}}, str(path))
        again = model_case.build(method.name, cfg, seed=7)
        load_checkpoint(again, str(path), map_location="cpu", strict=True)  # weights-only
        loaded.append(again)
    else:
        from method_cases import fairseq_data

        model, task, args = zc.fs_build(fairseq_data(), extra=zc.fs_method(method.name, cfg), seed=3)
        path = str(tmp_path / "checkpoint.pt")
        again = zc.fs_save_and_reload(model, task, args, path)
        saved = torch.load(path, map_location="cpu", weights_only=True)
        assert saved["cfg"]["model"]["attention_method"] == method.name
        assert all(layer.attention_method is method_of(method.name)
                   and layer.attention_config == method.config(cfg, "fairseq")
                   for layer in model_case.attention_layers(again))
        loaded.append(again)
    with torch.no_grad():
        want = model_case.out(model, x)
        fresh = model_case.out(model_case.build(method.name, cfg, seed=11), x)
        assert (fresh - want).abs().max() > 1e-6  # loading mattered
        for again in loaded:
            assert torch.equal(model_case.out(again, x), want)


# ================================================================================================ (f) cache
@pytest.mark.parametrize("method, model_case", cases(models=lambda m: m.name == "hf-llama"))
def test_hf_cached_generation_equals_recomputation_and_is_causal(method, model_case):
    """generate() with the dynamic and the static cache and beam search, cached passes of one token and of a chunk,
    against recomputation; no position reads a later token."""
    model, _ = model_case.pair(method.name, method_cfg(method, model_case))
    x = zc.hf_ids(length=6)
    with torch.no_grad():
        # generate() with each cache and a cached pass's logits, against recomputation
        seq, full = zc.assert_cached_generation(model, x)
        # beam search (the cache reordered) as without a cache
        beams = dict(num_beams=3, num_return_sequences=3)
        assert torch.equal(zc.hf_greedy(model, x, **beams), zc.hf_greedy(model, x, use_cache=False, **beams))
        # a chunk of several tokens after a cached prefix
        first = model(seq[:, :5], use_cache=True)
        rest = model(seq[:, 5:9], past_key_values=first.past_key_values).logits
        torch.testing.assert_close(torch.cat([first.logits, rest], 1), full[:, :9], rtol=1e-5, atol=1e-5)
        # causal: changing a token changes no earlier position's logits
        for j in (2, 7):
            y = seq.clone()
            y[:, j] = (y[:, j] + 1 - 3) % (96 - 3) + 3
            other = model(y).logits
            torch.testing.assert_close(other[:, :j], full[:, :j], rtol=0, atol=0)
            assert not torch.allclose(other[:, j:], full[:, j:])


@pytest.mark.parametrize("method, model_case", cases(models=lambda m: m.zoo == "fairseq"))
def test_fairseq_incremental_decoding_equals_recomputation_and_is_causal(method, model_case):
    model, _ = model_case.pair(method.name, method_cfg(method, model_case))
    toks = zc.fs_tokens(length=9)
    full = zc.fs_logits(model, toks)
    torch.testing.assert_close(zc.fs_incremental_logits(model, toks), full, rtol=1e-5, atol=1e-5)
    # beam reordering: the cache follows the rows
    order = torch.tensor([1, 0])
    torch.testing.assert_close(zc.fs_reordered_logits(model, toks, order, prefix=4),
                               zc.fs_logits(model, toks[order])[:, 4:], rtol=1e-5, atol=1e-5)
    # no position depends on a later token
    for j in (3, 6):
        changed = toks.clone()
        changed[:, j] = (changed[:, j] - 4 + 7) % 40 + 4
        other = zc.fs_logits(model, changed)
        torch.testing.assert_close(other[:, :j], full[:, :j], rtol=0, atol=0)
        assert not torch.allclose(other[:, j:], full[:, j:])


# ================================================================================================ the toy's paths
# The toy reaches every zoo through pid_plugins.register_method only (tests/toy_method.py): what each zoo's user path
# does with a method nothing in pid_plugins knows, beyond the grid above.
def toy_timm_pair(kind, gamma=0.5, seed=0):
    from toy_method import NAME

    return zc.timm_pair(kind, seed, attention=NAME, attention_cfg=None if gamma is None else {"gamma": gamma})


@pytest.mark.parametrize("kind", sorted(zc.TIMM))
def test_timm_toy_presets_stock_names_and_the_threaded_state(kind):
    timm = zc.import_timm()
    from toy_method import METHOD, NAME

    model, _ = toy_timm_pair(kind, gamma=0.25)
    assert model.attention_config.gamma == 0.25 and model.attention_warmup is None
    preset = timm.create_model(zc.TIMM[kind][0], attention=NAME, attention_cfg="strong", **zc.TIMM[kind][2])
    assert preset.attention_config.gamma == 2.0
    if kind == "fan":  # the softmax names pid_plugins registers (fan_*) take the method too
        assert timm.create_model(zc.TIMM[kind][1], attention=NAME, **zc.FAN).attention_method is METHOD
    # the state is threaded as len(state_fields) flat tensors: a block is an ordinary module of tensors
    args, kw = ((4, 1), {}) if kind == "fan" else ((), {"with_state": True})  # a ViT block as its container calls it
    x = torch.randn(2, 4, 48)
    out = model.blocks[0](x, *args, **kw)
    assert isinstance(out, tuple) and len(out) == 1 + len(METHOD.state_fields)
    out2 = model.blocks[1](out[0], *args, *out[1:], **kw)
    assert len(out2) == 2 and out2[1] is out[1]  # v^1 handed on unchanged


def test_timm_softmax_and_pid_names_keep_working():
    timm = zc.import_timm()
    deit = timm.create_model("pid_deit_tiny_patch16_224", **zc.DEIT)
    assert type(deit.attention_method).__name__ == "PIDMethod"
    assert deit.attention_config == pid_plugins.PIDConfig.preset("deit")
    assert timm.create_model("pid_deit_tiny_patch16_224", attention="softmax", **zc.DEIT).attention_method is None
    fan = timm.create_model("fan_tiny_12_p16_224", **zc.FAN)
    assert fan.attention_config is None and fan.attention_method is None


def test_timm_learnable_and_unknown_names_are_refused_clearly():
    timm = zc.import_timm()
    from toy_method import NAME

    with pytest.raises(ValueError, match="learnable"):
        timm.create_model("pid_deit_tiny_patch16_224", attention=NAME, attention_cfg={"learnable": True}, **zc.DEIT)
    with pytest.raises(ValueError, match="learnable") as info:
        timm.create_model("pid_fan_tiny_12_p16_224", attention=NAME, attention_cfg={"learnable": True}, **zc.FAN)
    assert "gamma" in str(info.value)  # what it does take
    for name in ("pid_deit_tiny_patch16_224", "fan_tiny_12_p16_224"):
        with pytest.raises(ValueError, match="unknown attention method 'scaled_referense'") as info:
            timm.create_model(name, attention="scaled_referense", **zc.TIMM["deit" if "deit" in name else "fan"][2])
        assert NAME in str(info.value) and "'pid'" in str(info.value) and "'softmax'" in str(info.value)


def test_timm_convert_switches_a_stock_model_to_the_toy_in_place():
    import pid_plugins.timm as pt
    from toy_method import METHOD, NAME, ScaledReferenceConfig

    model, stock = toy_timm_pair("deit", gamma=0.4)
    before = {k: v.clone() for k, v in stock.state_dict().items()}
    x = zc.timm_images("deit")
    with torch.no_grad():
        y_stock = stock(x)
    converted = pt.convert(stock, NAME, {"gamma": 0.4})
    # the model keeps its class (modules are replaced, never retyped): its blocks container threads the method
    assert converted is stock and type(converted) is type(zc.import_timm().create_model("deit_tiny_patch16_224", **zc.DEIT)) and not converted.training
    assert isinstance(converted.blocks, pt.MethodBlocks)
    assert all(blk.attn.attention_method is METHOD and blk.attn.attention_config == ScaledReferenceConfig(gamma=0.4)
               for blk in converted.blocks)
    assert list(zc.weights(converted.state_dict())) == list(before)
    with torch.no_grad():
        assert torch.equal(converted(x), model(x))
        assert torch.equal(pt.convert(converted, NAME, {"gamma": 0.0})(x), y_stock)  # reconfigured
        assert torch.equal(pt.convert(converted, "softmax")(x), y_stock)  # the stock model again


@pytest.mark.parametrize("kind", sorted(zc.TIMM))
def test_timm_features_only_intermediates_and_fx_feature_extraction(kind):
    timm = zc.import_timm()
    from toy_method import NAME

    name, _, cfg = zc.TIMM[kind]
    model, _ = toy_timm_pair(kind)
    x = zc.assert_timm_feature_paths(kind, model, attention=NAME)
    # timm's fx feature wrapper returns each block's output tokens (NLC, prefix tokens included)
    torch.manual_seed(5)
    fx_feats = timm.create_model(name, features_only=True, feature_cls="fx", out_indices=(1, 2), attention=NAME, **cfg)
    torch.manual_seed(5)
    model = timm.create_model(name, attention=NAME, **cfg).eval()  # the same weights
    with torch.no_grad():
        want = model.forward_intermediates(x, indices=[1, 2], output_fmt="NLC", intermediates_only=True)
        got = fx_feats.eval()(x)
        prefix = model.num_prefix_tokens if kind == "deit" else 0
        assert len(got) == 2 and all(torch.equal(g[:, prefix:], w) for g, w in zip(got, want))


def _attend_toy():
    from toy_method import ScaledReference

    class ScaledReferenceAttend(ScaledReference):
        """The toy with its own ``attend`` (the same computation): the layer then calls the method's attend."""

        name = "scaled_reference_attend"
        calls = 0

        def attend(self, params, attend, query, value, state=None, head_dim=-3):
            type(self).calls += 1
            return attend(query, value)

    return ScaledReferenceAttend


@pytest.mark.parametrize("kind", sorted(zc.TIMM))
def test_timm_a_method_with_its_own_attend_is_called_through_it(kind):
    timm = zc.import_timm()
    from timm.models import create_feature_extractor

    cls = _attend_toy()
    method = pid_plugins.register_method(cls(), replace=True)
    name, _, cfg = zc.TIMM[kind]
    model, _ = toy_timm_pair(kind, gamma=0.6)
    other = timm.create_model(name, attention=method.name, attention_cfg={"gamma": 0.6}, **cfg).eval()
    other.load_state_dict(model.state_dict())
    x = zc.timm_images(kind)
    with torch.no_grad():
        assert torch.equal(other(x), model(x))
    assert cls.calls == len(model.blocks)
    extractor = create_feature_extractor(other, return_nodes={"head": "logits"})
    with torch.no_grad():
        torch.testing.assert_close(extractor(x)["logits"], model(x), rtol=0, atol=0)


def test_hf_a_registered_method_is_an_attn_implementation_and_convert_refuses_bad_input():
    T = zc.import_transformers()
    import pid_plugins.hf as ph
    from toy_method import NAME, ScaledReferenceConfig

    assert NAME in pid_plugins.list_methods()
    model, stock = MODELS["hf-llama"].pair(NAME, {"gamma": 0.3})
    assert ph.method_of(model.config) is pid_plugins.get_method(NAME)
    assert ph.model_method_config(model.config) == ScaledReferenceConfig(gamma=0.3)
    with pytest.raises(ValueError, match="unknown attention method 'nope'.*scaled_reference"):
        ph.convert(stock, "nope")
    with pytest.raises(ValueError, match="unknown ScaledReferenceConfig field.*learnable"):
        ph.convert(stock, NAME, {"learnable": True})
    # convert(): the stock model to the toy and back; from_config with config.<method>
    x = zc.hf_ids()
    with torch.no_grad():
        want = stock(x).logits
        assert torch.equal(ph.convert(stock, NAME, {"gamma": 0.3})(x).logits, model(x).logits)
        assert torch.equal(ph.convert(stock, NAME, {"gamma": 0.0})(x).logits, want)
        assert torch.equal(ph.convert(stock, "softmax")(x).logits, want)
    config = zc.llama_config(kv_heads=2)
    setattr(config, NAME, {"gamma": 0.3})
    again = T.LlamaForCausalLM._from_config(config, attn_implementation=NAME)
    assert ph.model_method_config(again.config) == ScaledReferenceConfig(gamma=0.3)


def test_hf_encoder_decoder_self_attention_stacks_take_the_toy():
    """BART (the encoder's and the decoder's self-attention stacks; cross-attention untouched): switched off equals
    stock bit for bit, switched on changes the output."""
    T = zc.import_transformers()
    import pid_plugins.hf as ph
    from toy_method import NAME

    torch.manual_seed(0)
    stock = T.BartModel(zc.bart_config()).eval()
    x = zc.hf_ids()
    with torch.no_grad():
        want = stock(x).last_hidden_state
        ph.convert(stock, NAME, {"gamma": 0.0})
        assert torch.equal(stock(x).last_hidden_state, want)
        ph.convert(stock, NAME, {"gamma": 0.5})
        assert not torch.allclose(stock(x).last_hidden_state, want)


TOY = dict(attention="scaled_reference", attention_cfg=dict(gamma=0.3))


def test_mmseg_the_toy_is_chosen_by_name_and_layers_take_over_mmseg_modules():
    pytest.importorskip("mmseg")
    import pid_plugins.mmseg as pm  # first: the plugin makes mmseg importable without mmcv's compiled ops
    from mmseg.models.backbones.vit import TransformerEncoderLayer

    from toy_method import METHOD, NAME, ScaledReferenceConfig

    model, stock = zc.mm_pair("backbone", **TOY)
    assert model.attention_config == ScaledReferenceConfig(gamma=0.3) and model.attention_method is METHOD
    assert all(type(layer) is pm.PIDTransformerEncoderLayer and layer.attention_config == model.attention_config
               for layer in model.layers)
    assert all(isinstance(layer, TransformerEncoderLayer) and not layer.training for layer in model.layers)
    # the same modules and parameter names, and the same random initialisation (the conversion draws nothing)
    built = zc.mm_build("PIDVisionTransformer", zc.mm_args("backbone"), 0, **TOY)
    assert list(zc.weights(built.state_dict())) == list(stock.state_dict())
    for key, value in stock.state_dict().items():
        assert torch.equal(built.state_dict()[key], value), key
    h, stock_h = zc.mm_pair("head", **TOY)
    assert h.attention_config == ScaledReferenceConfig(gamma=0.3) and h.attention_method is METHOD
    assert all(type(layer) is pm.PIDTransformerEncoderLayer for layer in h.layers)
    assert list(zc.weights(h.state_dict())) == list(stock_h.state_dict())
    args = zc.mm_args("backbone")
    assert zc.mm_build("PIDVisionTransformer", args, attention=NAME, attention_cfg="strong").attention_config.gamma == 2.0
    assert zc.mm_build("PIDVisionTransformer", args, attention=NAME).attention_config.gamma == 0.5
    assert zc.mm_build("PIDVisionTransformer", args, attention="softmax").attention_method is None


def segmentor_cfg():
    return dict(
        type="EncoderDecoder",
        data_preprocessor=dict(type="SegDataPreProcessor", mean=[123.675, 116.28, 103.53], std=[58.395, 57.12, 57.375],
                               bgr_to_rgb=True, pad_val=0, seg_pad_val=255, size=(32, 32)),
        backbone=dict(type="PIDVisionTransformer", **zc.MM_BACKBONE, **TOY),
        decode_head=dict(type="PIDSegmenterMaskTransformerHead", **zc.MM_HEAD, **TOY),
        test_cfg=dict(mode="whole"),
    )


def test_mmseg_segmentor_state_dict_saves_and_reloads_through_mmengine(tmp_path):
    pytest.importorskip("mmseg")
    import pid_plugins.mmseg  # noqa: F401
    from mmengine.registry import init_default_scope
    from mmengine.runner.checkpoint import load_checkpoint, save_checkpoint
    from mmseg.registry import MODELS as MM

    init_default_scope("mmseg")
    torch.manual_seed(0)
    model = MM.build(segmentor_cfg())
    model.init_weights()
    model.eval()
    path = tmp_path / "iter_1.pth"
    save_checkpoint({"state_dict": model.state_dict(), "meta": {}}, str(path))
    torch.manual_seed(1)
    again = MM.build(segmentor_cfg())
    again.eval()
    load_checkpoint(again, str(path), map_location="cpu", strict=True)  # weights-only (pid_plugins.mmseg)
    x = zc.mm_inputs("backbone") * 50 + 100
    with torch.no_grad():
        want = model.encode_decode(x, [dict(img_shape=(32, 32))])
        assert torch.equal(again.encode_decode(x, [dict(img_shape=(32, 32))]), want)
        torch.manual_seed(1)
        fresh = MM.build(segmentor_cfg()).eval()
        assert (fresh.encode_decode(x, [dict(img_shape=(32, 32))]) - want).abs().max() > 1e-4  # loading mattered


CONFIG = """
custom_imports = dict(imports=['toy_method', 'pid_plugins.mmseg'], allow_failed_imports=False)
model = {model!r}
"""


@pytest.mark.slow
def test_mmseg_a_config_file_registers_the_method_and_the_plugin_with_custom_imports(tmp_path):
    """A fresh process: mmengine's ``Config.fromfile`` imports the user's method module and the plugin; mmseg's
    ``MODELS.build`` builds the segmentor; its output and weights equal this process's build of the same file. (The
    process is a ``python -c`` forked from tests/pyexec.py's zygote: mmengine and mmseg imported, pid_plugins and the
    user's module never; the repository and tests/ (the user's toy_method) on its path where PYTHONPATH puts them.)"""
    pytest.importorskip("mmseg")
    import pid_plugins.mmseg  # noqa: F401

    path = tmp_path / "segmenter_toy.py"
    path.write_text(CONFIG.format(model=segmentor_cfg()))
    script = f"""
import sys, torch
sys.path[1:1] = [{str(REPO)!r}, {str(TESTS)!r}]  # where PYTHONPATH puts them: after -c's '', before site
torch.set_num_threads(1)  # as one_thread
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
assert model.backbone.attention_method.name == model.decode_head.attention_method.name == 'scaled_reference'
x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1)) * 50 + 100
with torch.no_grad():
    out = model.encode_decode(x, [dict(img_shape=(32, 32))])
torch.save(dict(state_dict=model.state_dict(), out=out), {str(tmp_path / 'out.pth')!r})
"""
    result = run_python_c(script, cwd=tmp_path, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    saved = torch.load(tmp_path / "out.pth", weights_only=True)

    from mmengine.config import Config
    from mmengine.registry import init_default_scope
    from mmseg.registry import MODELS as MM

    cfg = Config.fromfile(str(path))
    assert cfg.model.backbone.attention_cfg == dict(gamma=0.3)
    init_default_scope("mmseg")
    model = MM.build(cfg.model).eval()
    model.load_state_dict(saved["state_dict"], strict=True)
    with torch.no_grad():
        x = zc.mm_inputs("backbone") * 50 + 100
        assert torch.equal(model.encode_decode(x, [dict(img_shape=(32, 32))]), saved["out"])


def test_mmseg_refusals_say_what_to_change():
    from toy_method import NAME

    def backbone(**kw):
        return zc.mm_build("PIDVisionTransformer", zc.mm_args("backbone"), **kw)

    def head(**kw):
        return zc.mm_build("PIDSegmenterMaskTransformerHead", zc.mm_args("head"), **kw)

    with pytest.raises(ValueError, match=r"unknown ScaledReferenceConfig field\(s\) \['learnable'\]"):
        backbone(attention=NAME, attention_cfg=dict(learnable=True))
    for build_part in (backbone, head):
        with pytest.raises(ValueError, match=r"unknown attention method 'nope'.*'pid'.*'scaled_reference'"):
            build_part(attention="nope")
        assert build_part(attention="softmax", attention_cfg=dict(gamma=0.1)).attention_method is None  # the flip
        with pytest.raises(ValueError, match="ScaledReferenceConfig.gamma must be finite"):
            build_part(attention=NAME, attention_cfg=dict(gamma=float("nan")))


def test_mmseg_warmup_with_a_non_additive_method_is_refused(monkeypatch):
    from toy_method import register_non_additive_method

    doubled = register_non_additive_method(monkeypatch, "contract_mmseg_doubled")  # for this test only
    args = zc.mm_args("backbone")
    # without warm-up it builds
    built = zc.mm_build("PIDVisionTransformer", args, attention="contract_mmseg_doubled")
    assert built.attention_config == doubled.config_type()
    for type_, part in (("PIDVisionTransformer", "backbone"), ("PIDSegmenterMaskTransformerHead", "head")):
        with pytest.raises(ValueError, match="'contract_mmseg_doubled'.* not additive.*set warmup_steps=0"):
            zc.mm_build(type_, zc.mm_args(part), attention="contract_mmseg_doubled",
                        attention_cfg=dict(warmup_steps=10))


def toy_fs(gamma):
    return zc.fs_method("scaled_reference", {"gamma": gamma})


def test_fairseq_toy_options_presets_and_the_catalogue_architectures():
    import pid_plugins.fairseq as pf
    from method_cases import fairseq_data
    from toy_method import METHOD, ScaledReferenceConfig

    data = fairseq_data()
    args = zc.fs_parse(data, extra=toy_fs(0.3))
    assert (args.attention_method, json.loads(args.attention_cfg)) == ("scaled_reference", {"gamma": 0.3})
    model, _, _ = zc.fs_build(data, extra=toy_fs(0.3))
    assert isinstance(model.decoder, pf.PIDTransformerDecoder)
    for layer in model.decoder.layers:
        assert type(layer) is pf.PIDTransformerDecoderLayer and type(layer.self_attn) is pf.PIDMultiheadAttention
    strong, _, _ = zc.fs_build(data, extra=["--attention-method", "scaled_reference", "--attention-cfg", '"strong"'])
    assert strong.decoder.layers[0].self_attn.attention_config == ScaledReferenceConfig(gamma=2.0)
    # the catalogue's architectures take the method too (their PID gains are not filled in then)
    wide, _, _ = zc.fs_build(data, arch="transformer_lm_pid_wikitext103", extra=toy_fs(0.3))
    assert wide.decoder.layers[0].self_attn.attention_method is METHOD
    # --attention-cfg without --attention-method: PID (the architecture's method) with those parameters
    pid, _, _ = zc.fs_build(data, extra=["--attention-cfg", '{"lambda_p": 0.2, "beta": 0.9}'])
    assert pid.decoder.layers[0].self_attn.attention_config.gains == (0.2, 0.5, 0.1, 0.9)


def test_fairseq_refusals():
    from method_cases import fairseq_data

    data = fairseq_data()
    with pytest.raises(ValueError, match=r"unknown attention method 'nope': choose 'softmax' or one of \[.*'pid'.*"
                                         r"'scaled_reference'"):
        zc.fs_build(data, extra=["--attention-method", "nope"])
    with pytest.raises(ValueError, match=r"unknown ScaledReferenceConfig field\(s\) \['learnable'\]"):
        zc.fs_build(data, extra=["--attention-method", "scaled_reference", "--attention-cfg", '{"learnable": true}'])
    with pytest.raises(ValueError, match="--attention-cfg must be a JSON object"):
        zc.fs_build(data, extra=["--attention-method", "scaled_reference", "--attention-cfg", "gamma=0.3"])


def test_fairseq_learnable_attention_params_are_per_layer_parameters():
    from method_cases import fairseq_data

    model, _, _ = zc.fs_build(fairseq_data(), extra=["--attention-cfg", '{"learnable": true}'])
    names = [n for n, _ in model.named_parameters() if "attention_params" in n]
    assert len(names) >= len(model.decoder.layers) and all(".self_attn.attention_params." in n for n in names)
    model.train()
    model(zc.fs_tokens())[0].sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all()
               for n, p in model.named_parameters() if "attention_params" in n)


@pytest.mark.integration  # fairseq-train's CLI
@pytest.mark.slow
def test_fairseq_train_cli_with_a_method_from_the_users_user_dir(tmp_path, tiny_fairseq_data_bin):
    """fairseq-train --arch transformer_lm_pid --attention-method scaled_reference, the toy registered by the user's
    own --user-dir (which imports pid_plugins.fairseq); the checkpoint reloads with the method and its parameters."""
    import pid_plugins.fairseq as pf
    from toy_method import METHOD, ScaledReferenceConfig

    user_dir = tmp_path / "my_methods_user_dir"
    user_dir.mkdir()
    (user_dir / "__init__.py").write_text(
        f"import sys\nsys.path.insert(0, {str(TESTS)!r})\nimport pid_plugins.fairseq  # noqa\nimport toy_method  # noqa\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    bin_dir = Path(sys.executable).parent
    proc = subprocess.run([str(bin_dir / "fairseq-train"), str(tiny_fairseq_data_bin), "--task", "language_modeling",
                           "--user-dir", str(user_dir), "--arch", "transformer_lm_pid", *zc.fs_tiny(), "--max-tokens",
                           "128", "--optimizer", "adam", "--lr", "0.001", "--max-update", "2", "--cpu",
                           "--num-workers", "0", "--save-dir", "ck", "--no-epoch-checkpoints", *toy_fs(0.25)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    state = torch.load(tmp_path / "ck" / "checkpoint_last.pt", map_location="cpu", weights_only=True)
    assert state["cfg"]["model"]["attention_method"] == "scaled_reference"
    assert json.loads(state["cfg"]["model"]["attention_cfg"]) == {"gamma": 0.25}
    hub = pf.load_pid_lm(str(tmp_path / "ck" / "checkpoint_last.pt"), str(tiny_fairseq_data_bin))
    attn = hub.models[0].decoder.layers[0].self_attn
    assert attn.attention_method is METHOD and attn.attention_config == ScaledReferenceConfig(gamma=0.25)
    assert torch.isfinite(hub.score("w1 w2 w3")["positional_scores"]).all()


def test_fairseq_warmup_with_a_non_additive_method_is_refused():
    """Warm-up runs fairseq's fused attention plus the method's term: a method without a separate term is refused
    (the method is handed to the decoder directly, so the registry stays as it is for other tests)."""
    from dataclasses import dataclass

    import pid_plugins.fairseq as pf
    from method_cases import fairseq_data
    from pid_plugins.core import MethodChoice

    @dataclass(frozen=True)
    class Cfg(pid_plugins.MethodConfig):
        warmup_steps: int = 0

    class Doubled(pid_plugins.AttentionMethod):
        name = "doubled"
        config_type = Cfg
        state_fields = ()
        additive = False

        def update(self, params, out, value_q, state, scale, head_dim):
            return 2 * out, ()

    stock, task, args = zc.fs_build(fairseq_data(), arch="transformer_lm")
    args.max_target_positions = args.tokens_per_sample  # as build_model sets it
    embed = stock.decoder.embed_tokens
    decoder = pf.PIDTransformerDecoder(args, task.target_dictionary, embed, no_encoder_attn=True,
                                       choice=MethodChoice(Doubled(), Cfg()))  # no warm-up: fine
    assert decoder.attention_warmup is None
    with pytest.raises(ValueError, match="'doubled'.* not additive.*set warmup_steps=0"):
        pf.PIDTransformerDecoder(args, task.target_dictionary, embed, no_encoder_attn=True,
                                 choice=MethodChoice(Doubled(), Cfg(warmup_steps=5)))
