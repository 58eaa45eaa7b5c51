"""Elliptical attention (``attention="elliptical"``, pid_plugins/core/siblings/elliptical.py) in every zoo.

The rule is restated here from the official code (stefvk/Elliptical-Attention, ``ImageNet/models.py``
``MahalaAttention.W_over_layers``) without calling the method: :func:`naive_scales` loops over batch, heads, dimensions
and positions; :func:`naive_attention` is the softmax of the rescaled scores written out. Bidirectional models (timm
DeiT and FAN, transformers BERT, mmseg backbone and decode head) are compared with float64 references built from the
stock modules; causal models (transformers decoders and encoder-decoders, fairseq LMs) and cached decoding are refused
before anything is computed.
"""
import pytest
import torch

import pid_plugins
from pid_plugins.core import AttentionContext, LayerCall
from pid_plugins.core.siblings.elliptical import EllipticalConfig, EllipticalMethod
from zoo_cases import elliptical_prefix_rule, fairseq_reference, fs_incremental_logits
from zoo_cases import (MM_TYPES, TIMM, assert_equal_or_both_none, bart_config, bert_config, bert_reference, fs_build,
                       fs_dictionary, fs_method, hf_checkpointing_grads, hf_ids, import_timm, import_transformers,
                       llama_config, mm_args, mm_build, mm_compiled, mm_inputs, mm_out, mm_with_cp_runs,
                       mmseg_reference, set_fused, timm_checkpointing_results, timm_images, timm_load_pretrained,
                       timm_reference)
from zoo_cases import mm_pair as zoo_mm_pair
from zoo_cases import timm_pair as zoo_timm_pair

NAME = "elliptical"
METHOD = pid_plugins.get_method(NAME)


# ----------------------------------------------------------------------------------- the rule, by loops
def naive_scales(v, v_prev, delta):
    """m[b, h, d] = (1/N) sum_n |v - v_prev|[b, h, n, d] / delta, then divided by max_d m[b, h, d] (float64)."""
    B, H, N, D = v.shape
    m = torch.zeros(B, H, D, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            for d in range(D):
                total = 0.0
                for n in range(N):
                    total += abs(float(v[b, h, n, d]) - float(v_prev[b, h, n, d])) / delta
                m[b, h, d] = total / N
            m[b, h] = m[b, h] / max(float(x) for x in m[b, h])
    return m


def naive_attention(q, k, v, m=None, mask=None):
    """softmax((q diag(m)) k^T / sqrt(D) + mask) v in float64; the scaling of key/value head j serves query heads
    j*r .. j*r + r - 1 (grouped-query attention)."""
    q, k, v = q.double(), k.double(), v.double()
    r = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(r, 1), v.repeat_interleave(r, 1)
    if m is not None:
        q = q * m.repeat_interleave(r, 1)[:, :, None, :]
    scores = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    if mask is not None:
        scores = scores + mask
    return torch.softmax(scores, -1) @ v


def naive_layer(q, k, v, v_prev, layer, from_layer=2, delta=5.0):
    """One layer (1-based index ``layer``) of the official rule."""
    if layer < from_layer:
        return naive_attention(q, k, v)
    return naive_attention(q, k, v, naive_scales(v, v_prev, delta))


# ----------------------------------------------------------------------------------------- core level
def test_config_presets_and_validation():
    assert METHOD.configure(None, "timm") == EllipticalConfig(from_layer=2, delta=5.0)
    for preset in ("deit", "fan", "segmenter"):
        assert EllipticalConfig.preset(preset) == EllipticalConfig()
    assert METHOD.configure(None, "mmseg") == EllipticalConfig.preset("segmenter")
    assert METHOD.configure({"from_layer": 3}, "hf").from_layer == 3
    assert not METHOD.is_identity(EllipticalConfig()) and not METHOD.additive
    assert EllipticalConfig.from_dict(EllipticalConfig(from_layer=4, delta=1).to_dict()) == EllipticalConfig(4, 1.0)
    with pytest.raises(ValueError, match="from_layer must be >= 2 .*attention='softmax'"):
        EllipticalConfig(from_layer=1)
    with pytest.raises(ValueError, match="delta must be a finite number > 0"):
        EllipticalConfig(delta=0.0)
    with pytest.raises(ValueError, match="unknown EllipticalConfig field.*learnable"):
        METHOD.configure({"learnable": True})
    with pytest.raises(ValueError, match="not additive"):
        METHOD.term(EllipticalConfig(), torch.zeros(1, 1, 2, 2), None, None)


def test_check_refuses_causal_and_cached_with_what_to_do():
    METHOD.check(EllipticalConfig(), AttentionContext(dropout=True, grouped=True))  # both exact
    with pytest.raises(ValueError, match="not causal.*earlier positions would read later tokens.*mean='prefix'"):
        METHOD.check(EllipticalConfig(), AttentionContext(causal=True))
    with pytest.raises(ValueError, match="KV cache.*mean='prefix'.*without a cache"):
        METHOD.check(EllipticalConfig(), AttentionContext(cached=True))
    METHOD.check(EllipticalConfig(mean="prefix"), AttentionContext(causal=True, cached=True, grouped=True))


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_layer_stack_matches_the_loop_statement(kv_heads):
    """Four layers of the method (the one call, with each layer's index) with SDPA as the attention, against
    :func:`naive_layer`: the first layer plain, the previous values handed on by every layer, ``from_layer``
    respected, grouped heads."""
    g = torch.Generator().manual_seed(0)
    B, H, N, D = 2, 4, 5, 3
    for from_layer in (2, 3, 9):
        config = EllipticalConfig(from_layer=from_layer, delta=2.0)
        state, v_prev = None, None
        for layer in range(1, 5):
            q = torch.randn(B, H, N, D, generator=g, dtype=torch.float64)
            k, v = (torch.randn(B, kv_heads, N, D, generator=g, dtype=torch.float64) for _ in range(2))

            def attend(query, value):
                return torch.nn.functional.scaled_dot_product_attention(query, k, value, enable_gqa=True)

            out, state = METHOD.apply(config, None, LayerCall(attend, q, v, v, layer=layer - 1), state)
            want = naive_attention(q, k, v) if layer == 1 else naive_layer(q, k, v, v_prev, layer, from_layer, 2.0)
            torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
            assert len(state) == 1 and torch.equal(state[0], v) and not state[0].requires_grad
            v_prev = v
        assert from_layer == 9 or not torch.allclose(out, naive_attention(q, k, v))
    # from_layer=2 (every layer after the first) needs no index: the state tells the first layer; a later from_layer
    # refuses a call without one, naming the method and what the adapter must pass
    v_prev, v = v, torch.randn(B, kv_heads, N, D, generator=g, dtype=torch.float64)
    call = LayerCall(attend, q, v, v)
    torch.testing.assert_close(METHOD.apply(EllipticalConfig(delta=2.0), None, call, state)[0],
                               naive_layer(q, k, v, v_prev, 2, 2, 2.0), rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="'elliptical' reads the layer's index.*LayerCall\\(\\.\\.\\., layer=i\\)"):
        METHOD.apply(EllipticalConfig(from_layer=3), None, call, state)


def test_scales_take_no_gradient_and_follow_the_layout_of_the_update():
    q = torch.randn(1, 2, 4, 3, requires_grad=True)
    v = torch.randn(1, 2, 4, 3, requires_grad=True)
    _, state = METHOD.update(EllipticalConfig(), q, v.transpose(1, 2), None, None, head_dim=-2)  # (B, N, H, D)
    assert torch.equal(state[0], v.detach()) and state[0].shape == v.shape
    v2 = torch.randn(1, 2, 4, 3, requires_grad=True)
    scaled = METHOD.prepare(EllipticalConfig(), q, v2, state)
    scaled.sum().backward()
    assert v2.grad is None and v.grad is None  # m is computed from detached values
    m = naive_scales(v2.detach(), v.detach(), 5.0).float()
    torch.testing.assert_close(q.grad, m[:, :, None, :].expand_as(q))


# ---------------------------------------------------------------------------------------------- timm
timm_cases = pytest.mark.parametrize("kind", ["deit", "fan"])


def elliptical_rule(from_layer):
    """The zoo references' per-layer rule: the first layer plain, then :func:`naive_layer` with the previous
    layer's values (layers counted from 1)."""
    def rule(qs, ks, vs, mask):
        if len(vs) == 1:
            return naive_attention(qs[-1], ks[-1], vs[-1])
        return naive_layer(qs[-1], ks[-1], vs[-1], vs[-2], len(vs), from_layer)
    return rule


def timm_pair(kind, cfg=None, seed=0):
    return zoo_timm_pair(kind, seed, attention=NAME, attention_cfg=cfg)


@pytest.mark.parametrize("kind, from_layer", [("deit", 2), ("deit", 3), ("fan", 3)])
def test_timm_matches_an_independent_float64_reference(kind, from_layer):
    model, stock = timm_pair(kind, {"from_layer": from_layer})
    assert model.attention_method is METHOD and model.attention_config == EllipticalConfig(from_layer=from_layer)
    model, stock = model.double(), stock.double()
    x = timm_images(kind).double()
    with torch.no_grad():
        want = timm_reference(kind, stock, x, elliptical_rule(from_layer))
        torch.testing.assert_close(model(x), want, rtol=1e-10, atol=1e-10)
        assert not torch.allclose(stock(x), want)


@timm_cases
@pytest.mark.parametrize("fused", [True, False])
def test_timm_without_elliptical_layers_is_the_stock_model_bit_for_bit(kind, fused):
    """No ZERO values exist (delta cancels): with ``from_layer`` past the depth the method's path scales the queries
    by exactly 1 and equals the stock model bit for bit; ``attention='softmax'`` is the stock model."""
    timm = import_timm()
    model, stock = timm_pair(kind, {"from_layer": 99})
    softmax = timm.create_model(TIMM[kind][0], attention="softmax", **TIMM[kind][2]).eval()
    softmax.load_state_dict(stock.state_dict())
    set_fused((model, stock, softmax), fused)
    x = timm_images(kind)
    with torch.no_grad():
        want = stock(x)
        assert torch.equal(model(x), want) and torch.equal(softmax(x), want)
    assert model.blocks[0].attn.state_size == 1  # the method's path ran (the state is threaded)


@timm_cases
@pytest.mark.parametrize("reentrant", [False, True])
def test_timm_gradient_checkpointing_equals_no_checkpointing(kind, reentrant):
    timm = import_timm()
    ref, _ = timm_pair(kind)
    ckpt, _ = timm_pair(kind)
    ckpt.set_grad_checkpointing(True)
    results = timm_checkpointing_results(timm, (ref, ckpt), lambda: timm_images(kind), reentrant)
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@timm_cases
def test_timm_compile_fullgraph_equals_eager(kind):
    model, _ = timm_pair(kind, {"from_layer": 3})
    x = timm_images(kind)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-6)


def test_timm_save_and_reload(tmp_path):
    name, _, cfg = TIMM["deit"]
    model, _ = timm_pair("deit", {"from_layer": 3}, seed=3)
    path = tmp_path / "model.pth"
    torch.save(model.state_dict(), path)
    loaded = timm_load_pretrained(name, path, attention=NAME, attention_cfg={"from_layer": 3}, **cfg)
    x = timm_images("deit")
    with torch.no_grad():
        want = model(x)
        assert torch.equal(loaded(x), want)


# ------------------------------------------------------------------------------------------ transformers
V = 96


def bert_pair(cfg=None, seed=0):
    T = import_transformers()
    import pid_plugins.hf as ph

    torch.manual_seed(seed)
    config = dict(layers=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    stock = T.BertModel(bert_config(V, **config)).eval()
    model = T.BertModel(bert_config(V, **config)).eval()
    model.load_state_dict(stock.state_dict())
    ph.to_pid(model, cfg, method=NAME)
    return model, stock


def ids(n=2, length=8, seed=1):
    return hf_ids(n, length, seed, vocab=V)


def reference_bert(stock, x, from_layer):
    """BERT by hand in float64: the stock modules for embeddings, projections, post-norms and MLP, attention with
    the official rule."""
    return bert_reference(stock.double(), x, elliptical_rule(from_layer))


@pytest.mark.parametrize("from_layer", [2, 3])
def test_bert_matches_an_independent_float64_reference(from_layer):
    model, stock = bert_pair({"from_layer": from_layer})
    assert model.config._attn_implementation == NAME
    model = model.double()
    x = ids()
    with torch.no_grad():
        got = model(x).last_hidden_state
        want = reference_bert(stock, x, from_layer)
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
        assert not torch.allclose(stock(x).last_hidden_state, want)


def test_bert_without_elliptical_layers_is_the_stock_model_bit_for_bit():
    model, stock = bert_pair({"from_layer": 99})
    x = ids()
    with torch.no_grad():
        assert torch.equal(model(x).last_hidden_state, stock(x).last_hidden_state)


def test_bert_gradient_checkpointing_equals_no_checkpointing():
    model, _ = bert_pair()
    model.train()
    x = ids()

    def forward(m):
        out = m(x).last_hidden_state
        return out, out.square().mean()

    plain, ckpt = hf_checkpointing_grads(model, forward, every_parameter=False)
    assert plain.keys() == ckpt.keys() and len(plain) > 10


@pytest.mark.slow
def test_bert_compiled_fullgraph_equals_eager():
    model, _ = bert_pair({"from_layer": 3})
    x = ids()
    torch._dynamo.reset()
    with torch.no_grad():
        want = model(x).last_hidden_state
        got = torch.compile(model, fullgraph=True, backend="aot_eager")(x).last_hidden_state
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_bert_save_and_reload(tmp_path):
    T = import_transformers()
    import pid_plugins.hf as ph

    model, _ = bert_pair({"from_layer": 3})
    model.save_pretrained(tmp_path)
    again = T.BertModel.from_pretrained(tmp_path).eval()
    assert again.config._attn_implementation == NAME
    assert ph.model_method_config(again.config) == EllipticalConfig(from_layer=3)
    x = ids()
    with torch.no_grad():
        assert torch.equal(again(x).last_hidden_state, model(x).last_hidden_state)


def test_transformers_causal_models_are_refused_with_the_message():
    """Llama (decoder: forward and cached generation) and BART (its decoder's causal self-attention)."""
    T = import_transformers()
    import pid_plugins.hf as ph

    torch.manual_seed(0)
    llama = T.LlamaForCausalLM(llama_config(layers=2, vocab=V)).eval()
    ph.to_pid(llama, method=NAME)
    bart = T.BartModel(bart_config(V)).eval()
    ph.to_pid(bart, method=NAME)
    x = ids()
    with torch.no_grad():
        for run in (lambda: llama(x), lambda: llama.generate(x, max_new_tokens=2, do_sample=False, pad_token_id=0),
                    lambda: bart(x)):
            with pytest.raises(ValueError, match="'elliptical' with mean='sequence' is not causal.*later tokens.*mean='prefix'"):
                run()


# ---------------------------------------------------------------------------------------------- mmseg
def mm_pair(part, cfg=None, **kw):
    return zoo_mm_pair(part, layers=3, attention=NAME, attention_cfg=cfg, **kw)


@pytest.mark.parametrize("part", ["backbone", "head"])
def test_mmseg_matches_an_independent_float64_reference(part):
    model, stock = mm_pair(part, {"from_layer": 3})
    assert model.attention_config == EllipticalConfig(from_layer=3) and model.attention_method is METHOD
    model, stock = model.double(), stock.double()
    x = mm_inputs(part, torch.float64)
    with torch.no_grad():
        got = mm_out(part, model, x)
        want = mmseg_reference(part, stock, x, elliptical_rule(3))
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
        assert (got - mm_out(part, stock, x)).abs().max() > 1e-4
    # switched off: attention='softmax' with the same weights is the stock model bit for bit (mmseg's own layers);
    # without elliptical layers the method's path (SDPA) computes the stock attention up to rounding
    softmax = mm_build("PID" + MM_TYPES[part], mm_args(part, 3), seed=2, attention="softmax")
    unscaled, stock = mm_pair(part, {"from_layer": 99})
    softmax.load_state_dict(stock.state_dict(), strict=True)
    x = mm_inputs(part)
    with torch.no_grad():
        want = mm_out(part, stock, x)
        assert torch.equal(mm_out(part, softmax, x), want)
        torch.testing.assert_close(mm_out(part, unscaled, x), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("part", ["backbone", "head"])
def test_mmseg_with_cp_equals_no_checkpointing_and_reloads(part):
    ref, results = mm_with_cp_runs(part, lambda: mm_pair(part)[0], input_grad=False)
    assert sum(g is not None for g in results[0]) > 10
    assert_equal_or_both_none(*results)
    # mmseg's save/reload: a state_dict (the method adds no parameters) into a freshly built model
    again = mm_build("PID" + MM_TYPES[part], mm_args(part, 3), seed=5, attention=NAME)
    again.load_state_dict(ref.state_dict(), strict=True)
    ref.eval()
    with torch.no_grad():
        assert torch.equal(mm_out(part, again, mm_inputs(part)), mm_out(part, ref, mm_inputs(part)))


@pytest.mark.slow
def test_mmseg_backbone_compiles_fullgraph():
    model, _ = mm_pair("backbone", {"from_layer": 3})
    x = mm_inputs("backbone")
    compiled = mm_compiled(model, x, "aot_eager")
    with torch.no_grad():
        torch.testing.assert_close(compiled, model(x)[0], rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------- fairseq
def test_fairseq_language_models_run_the_prefix_mean_and_refuse_the_sequence_mean(tmp_path):
    """fairseq's default for the causal LM is the ``lm`` preset (prefix mean, delta 1): the float64 rule, causality,
    incremental decoding equal to the full pass; ``mean="sequence"`` is refused naming ``mean='prefix'``."""
    data = fs_dictionary(tmp_path)
    stock, _, _ = fs_build(data, arch="transformer_lm", layers=3)
    model, _, _ = fs_build(data, extra=fs_method(NAME), layers=3, seed=1)
    model.load_state_dict(stock.state_dict(), strict=True)
    assert model.decoder.layers[0].self_attn.attention_config == EllipticalConfig.preset("lm")
    toks = torch.randint(4, 44, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(toks)[0]
        want = fairseq_reference(stock.double(), toks, elliptical_prefix_rule(1.0))
        torch.testing.assert_close(full.double(), want, rtol=1e-5, atol=1e-5)
        stock.float()
        torch.testing.assert_close(fs_incremental_logits(model, toks), full, rtol=1e-5, atol=1e-5)
        changed = toks.clone()
        changed[:, 4] = (changed[:, 4] - 4 + 7) % 40 + 4
        other = model(changed)[0]
        torch.testing.assert_close(other[:, :4], full[:, :4], rtol=0, atol=0)
    model, _, _ = fs_build(data, extra=fs_method(NAME, {"mean": "sequence"}), layers=2)
    with torch.no_grad():
        with pytest.raises(ValueError, match="'elliptical' with mean='sequence' is not causal.*later tokens.*mean='prefix'"):
            model(toks)
        with pytest.raises(ValueError, match="'elliptical' with mean='sequence' is not causal"):
            model.decoder(toks[:, :1], incremental_state={})
