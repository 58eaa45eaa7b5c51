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
from method_cases import CAUSAL, METHODS, MODELS, cases, method_cfg  # noqa: F401

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models: one intra-op thread (float64 kernels, e.g. FAN's grouped convolutions, take the slow path, whose
    parallel regions cost far more than they compute on a shared machine); restored afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


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
    elif model_case.name == "hf-llama":  # left padding
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
    model, _ = model_case.pair(method.name, method_cfg(method, model_case))
    model.train()
    x = model_case.inputs()
    if model_case.name == "hf-llama":
        forward, every = zc.causal_lm_loss(x), True
    else:
        def forward(m):
            out = m(x).last_hidden_state
            return out, out.square().mean()
        every = False  # BERT's pooler takes no part
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
@pytest.mark.parametrize("method, model_case", cases(models=lambda m: m.compile_backend is not None))
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
    model, _ = model_case.pair(method.name, method_cfg(method, model_case))
    x = zc.hf_ids(length=6)
    with torch.no_grad():
        seq = x
        for _ in range(6):
            step = model(seq, use_cache=False).logits[:, -1]
            seq = torch.cat([seq, step.argmax(-1, keepdim=True)], 1)
        assert torch.equal(model.generate(x, max_new_tokens=6, do_sample=False, use_cache=True, pad_token_id=0), seq)
        static = model.generate(x, max_new_tokens=6, do_sample=False, cache_implementation="static", pad_token_id=0)
        assert torch.equal(static, seq)
        # the logits of a cached pass, position by position, against the full pass
        full = model(seq).logits
        out = model(seq[:, :8], use_cache=True)
        cache, steps = out.past_key_values, [out.logits[:, -1]]
        for t in range(8, seq.shape[1]):
            out = model(seq[:, t:t + 1], past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            steps.append(out.logits[:, -1])
        torch.testing.assert_close(torch.stack(steps, 1), full[:, 7:], rtol=1e-5, atol=1e-5)
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
    state, order = {}, torch.tensor([1, 0])
    with torch.no_grad():
        for t in range(1, 5):
            model(toks[:, :t], incremental_state=state)
        model.decoder.reorder_incremental_state_scripting(state, order)
        swapped = toks[order]
        out = [model(swapped[:, :t], incremental_state=state)[0][:, -1] for t in range(5, 10)]
    torch.testing.assert_close(torch.stack(out, 1), zc.fs_logits(model, swapped)[:, 4:], rtol=1e-5, atol=1e-5)
    # no position depends on a later token
    for j in (3, 6):
        changed = toks.clone()
        changed[:, j] = (changed[:, j] - 4 + 7) % 40 + 4
        other = zc.fs_logits(model, changed)
        torch.testing.assert_close(other[:, :j], full[:, :j], rtol=0, atol=0)
        assert not torch.allclose(other[:, j:], full[:, j:])
