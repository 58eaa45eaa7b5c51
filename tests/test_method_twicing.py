"""Twicing attention (``attention="twicing"``), ``A v + A (v - A v)``, in every zoo.

The references are written from the official rule (github.com/lazizcodes/twicing_attention: ``SharpAttention`` in
``twicing_attention_vision/models.py``, ``2A - A A`` in ``twicing_attention_lang/lmtool-fwms/src/mem_transformer.py``)
with the attention matrix formed explicitly in float64, not through the method's code. Twicing has no strength
parameter: switched off is ``attention="softmax"`` with the same weights (and ``from_layer`` past the last layer).
"""

import pytest
import torch
import torch.nn.functional as F

import pid_plugins
from pid_plugins.core import AttentionContext, LayerCall, get_method
from pid_plugins.core.siblings.twicing import Twicing, TwicingConfig, twicing_rule
from zoo_cases import TIMM as ZOO_TIMM
from zoo_cases import (assert_equal_or_both_none, bart_config, bert_config, bert_reference,  # noqa: F401
                       causal_lm_loss, data_dir, fairseq_reference, fs_incremental_logits, fs_method,
                       fs_save_and_reload,
                       fs_tokens, hf_checkpointing_grads, hf_ids, llama_config, llama_twins, mm_args,
                       mm_build, mm_compiled, mm_pair, mmseg_reference, on_scores, set_fused,
                       timm_attention_stack, timm_images, timm_reference)
from zoo_cases import fs_build as zoo_fs_build
from zoo_cases import llama_reference as zoo_llama_reference
from zoo_cases import timm_pair as zoo_timm_pair

NAME = "twicing"


def twice64(scores, v):
    """The official rule from the attention matrix: ``A = softmax(scores)`` (masked scores), ``A v + A (v - A v)``."""
    a = torch.softmax(scores.double(), -1)
    av = a @ v.double()
    return av + a @ (v.double() - av)


def twiced_from(from_layer):
    """The zoo references' per-layer rule: stock ``A v`` before ``from_layer``, :func:`twice64` from it on."""
    return on_scores(lambda index, scores, v: twice64(scores, v) if index >= from_layer else
                     torch.softmax(scores, -1) @ v)


# ============================================================================================== core
def _loop_reference(q, k, v, causal):
    """Position by position: u_i = sum_j A_ij v_j + sum_j A_ij (v_j - sum_m A_jm v_m), A from its definition."""
    B, H, N, D = q.shape
    u = torch.zeros(B, H, N, D, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            A = torch.zeros(N, N, dtype=torch.float64)
            for i in range(N):
                keys = range(i + 1) if causal else range(N)
                s = torch.tensor([float(q[b, h, i] @ k[b, h, j]) / D ** 0.5 for j in keys], dtype=torch.float64)
                A[i, : len(s)] = torch.softmax(s, 0)
            av = [sum(A[j, m] * v[b, h, m] for m in range(N)) for j in range(N)]
            for i in range(N):
                u[b, h, i] = av[i] + sum(A[i, j] * (v[b, h, j] - av[j]) for j in range(N))
    return u


@pytest.mark.parametrize("causal", [False, True])
def test_rule_matches_its_loop_statement_in_both_output_layouts(causal):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 5, 4, generator=g, dtype=torch.float64) for _ in range(3))
    want = _loop_reference(q, k, v, causal)

    def attend(query, value):  # (B, H, N, D) out
        return F.scaled_dot_product_attention(query, k, value, is_causal=causal)

    torch.testing.assert_close(twicing_rule(attend, q, v), want, rtol=1e-12, atol=1e-12)
    # transformers' layout: values (B, H, N, D) in, (B, N, H, D) out; also with as many heads as positions
    out = twicing_rule(lambda query, value: attend(query, value).transpose(1, 2), q, v, head_dim=-2)
    torch.testing.assert_close(out, want.transpose(1, 2), rtol=1e-12, atol=1e-12)
    q3, k3, v3 = (t[:, :, :3] for t in (q, k, v))
    square = twicing_rule(lambda a, b: F.scaled_dot_product_attention(a, k3, b, is_causal=causal).transpose(1, 2),
                          q3, v3, head_dim=-2)
    torch.testing.assert_close(square, _loop_reference(q3, k3, v3, causal).transpose(1, 2), rtol=1e-12, atol=1e-12)
    # the language code's form: (2A - A A) v
    mask = torch.full((5, 5), float("-inf"), dtype=torch.float64).triu(1) if causal else 0.0
    a = torch.softmax(q @ k.transpose(-1, -2) / 2 + mask, -1)
    torch.testing.assert_close(want, (2 * a - a @ a) @ v, rtol=1e-12, atol=1e-12)


def test_config_presets_and_validation():
    method = get_method(NAME)
    assert isinstance(method, Twicing) and not method.additive and method.state_fields == ()
    assert TwicingConfig.preset("vision") == TwicingConfig(from_layer=0) == method.configure(None, "hf")
    assert TwicingConfig.preset("lm").from_layer == 14
    assert method.configure({"from_layer": 3}, "timm") == TwicingConfig(3)
    assert TwicingConfig.from_dict(TwicingConfig(2).to_dict()) == TwicingConfig(2)
    assert not TwicingConfig().is_zero and not method.is_identity(TwicingConfig(100))
    for bad, match in ((-1, "from_layer must be a layer index >= 0"), (1.5, "from_layer must be int"),
                       (True, "from_layer must be int")):
        with pytest.raises(ValueError, match=match):
            TwicingConfig(from_layer=bad)
    assert method.make_learned(TwicingConfig()) is None
    for field in ("alpha", "learnable"):  # the official class defines alpha but never uses it
        with pytest.raises(ValueError, match=rf"unknown TwicingConfig field\(s\) \['{field}'\]"):
            method.configure({field: 0.5})


def test_check_refuses_only_attention_dropout():
    """Grouped-query attention and a KV cache are computed exactly (keys expanded for the second call, A v kept in
    the cache); one dropout draw cannot serve two calls."""
    method, config = get_method(NAME), TwicingConfig()
    method.check(config, AttentionContext(causal=True, cached=True, grouped=True))
    with pytest.raises(ValueError, match="'twicing'.*set the attention dropout to 0"):
        method.check(config, AttentionContext(dropout=True))


def test_from_layer_counts_the_layers_of_a_group():
    """Five layers, each the one call with its index in the group (``LayerCall.layer``): stock attention before
    ``from_layer``, twicing from it on; nothing is handed from layer to layer."""
    method, config = get_method(NAME), TwicingConfig(from_layer=2)
    g = torch.Generator().manual_seed(1)
    state = None
    for layer in range(5):
        q, k, v = (torch.randn(1, 2, 4, 3, generator=g, dtype=torch.float64) for _ in range(3))
        plain = lambda a, b: F.scaled_dot_product_attention(a, k, b)  # noqa: E731
        out, state = method.apply(config, None, LayerCall(plain, q, v, v, layer=layer), state)
        scores = q @ k.transpose(-1, -2) / 3 ** 0.5
        if layer >= 2:
            torch.testing.assert_close(out, twice64(scores, v), rtol=1e-12, atol=1e-12)
        else:  # the stock attention exactly: one call of the zoo's attention
            torch.testing.assert_close(out, torch.softmax(scores, -1) @ v, rtol=1e-12, atol=1e-12)
            assert torch.equal(out, plain(q, v))
        assert state == ()
    # the index decides, not the calls before: a group's layer 3 twices when called first
    out, _ = method.apply(config, None, LayerCall(plain, q, v, v, layer=3), None)
    torch.testing.assert_close(out, twice64(q @ k.transpose(-1, -2) / 3 ** 0.5, v), rtol=1e-12, atol=1e-12)
    assert method.layer_params(config, None, layer=1) is None and method.layer_params(config, None, 2) is config
    # from_layer=0 (every layer twices) needs no index; from_layer > 0 refuses a call without one, naming the method
    assert method.apply(TwicingConfig(), None, LayerCall(plain, q, v, v), None)[1] == ()
    with pytest.raises(ValueError, match="'twicing' reads the layer's index.*LayerCall\\(\\.\\.\\., layer=i\\)"):
        method.apply(config, None, LayerCall(plain, q, v, v), None)


def test_grouped_query_heads_and_a_cache_slot_are_exact():
    """Two query heads per key/value head: the second call gets the values expanded to the query heads (the keys
    too, inside ``attend``), against the float64 rule per query head. With two past key positions, ``A v`` of the
    past comes from the slot; without one the rule refuses rather than mixing positions."""
    g = torch.Generator().manual_seed(2)
    q = torch.randn(1, 4, 3, 5, generator=g, dtype=torch.float64)
    k, v = (torch.randn(1, 2, 3, 5, generator=g, dtype=torch.float64) for _ in range(2))

    def attend(a, b, k=k):
        return F.scaled_dot_product_attention(a, k.repeat_interleave(2, 1), b.repeat_interleave(a.shape[1] // b.shape[1], 1))

    want = twice64(q @ k.repeat_interleave(2, 1).transpose(-1, -2) / 5 ** 0.5, v.repeat_interleave(2, 1))
    torch.testing.assert_close(twicing_rule(attend, q, v), want, rtol=1e-12, atol=1e-12)
    # decoding the last position with A v of the first two from a slot: the last row of the full computation
    causal = torch.ones(3, 3, dtype=torch.bool).tril()
    full = lambda a, b: F.scaled_dot_product_attention(  # noqa: E731
        a, k.repeat_interleave(2, 1), b.repeat_interleave(a.shape[1] // b.shape[1], 1), attn_mask=causal[-a.shape[2]:])
    past_av = full(q, v)[:, :, :2]
    slot = lambda rows: torch.cat([past_av, rows], dim=2)  # noqa: E731
    torch.testing.assert_close(twicing_rule(full, q[:, :, 2:], v, slot=slot), twicing_rule(full, q, v)[:, :, 2:],
                               rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="CacheSlot"):
        twicing_rule(full, q[:, :, 2:], v)


# ============================================================================================== timm
TIMM = {**ZOO_TIMM, "fan": ZOO_TIMM["fan"][:2] + (dict(ZOO_TIMM["fan"][2], img_size=32, depth=2),)}


def timm_pair(kind):
    return zoo_timm_pair(kind, models=TIMM, attention=NAME)


def images(kind, n=2):
    return timm_images(kind, n, models=TIMM)


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("kind", sorted(TIMM))
def test_timm_matches_a_float64_reference_and_softmax_is_stock(kind, fused):
    """DeiT whole; FAN's token-mixing layers alone (the stack of its blocks' attentions, each fed the previous one's
    output: FAN's whole model in float64 runs its grouped convolutions in torch's slow float64 kernel, the rest of
    FAN's model is checked with the toy method in test_method_contract_timm.py)."""
    timm = pytest.importorskip("timm")
    model, stock = timm_pair(kind)
    set_fused((model, stock), fused)
    x = images(kind)
    with torch.no_grad():
        softmax = timm.create_model(TIMM[kind][0], attention="softmax", **TIMM[kind][2]).eval()
        softmax.load_state_dict(stock.state_dict())
        set_fused((softmax,), fused)
        assert torch.equal(softmax(x), stock(x))  # (b): the stock attention with the same weights
        model, stock = model.double(), stock.double()
        if kind == "deit":
            want = timm_reference("deit", stock, x.double(), twiced_from(0))
            torch.testing.assert_close(model(x.double()), want, rtol=1e-10, atol=1e-10)
            assert not torch.allclose(stock(x.double()), want)
        else:
            h = torch.randn(2, 5, 48, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
            got, state = h, None
            for blk in model.blocks:
                got, state = blk.attn(got, state)
            assert state == ()  # no state: the layer's index comes with each call
            torch.testing.assert_close(got, timm_attention_stack(stock, h, twiced_from(0)), rtol=1e-10, atol=1e-10)
    # from_layer past the last layer (the language preset, layers >= 14): every layer computes the stock attention
    late = timm.create_model(TIMM[kind][0], attention=NAME, attention_cfg="lm", **TIMM[kind][2]).eval()
    late.load_state_dict(stock.state_dict())
    set_fused((late,), fused)
    with torch.no_grad():
        torch.testing.assert_close(late.float()(x.float()), stock.float()(x.float()), rtol=0, atol=0)


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(TIMM))
def test_timm_checkpointing_compile_dropout_and_save(kind, tmp_path):
    timm = pytest.importorskip("timm")
    ref, _ = timm_pair(kind)
    x = images(kind)
    # (c) both checkpointing modes equal no checkpointing

    def step(model):
        model.zero_grad()
        inp = x.clone().requires_grad_()
        out = model(inp)
        out.square().mean().backward()
        return [out.detach(), inp.grad] + [p.grad for p in model.parameters()]

    want = step(ref)
    ckpt, _ = timm_pair(kind)
    ckpt.set_grad_checkpointing(True)
    previous = timm.layers.use_reentrant_ckpt()
    try:
        for reentrant in (False, True):
            timm.layers.set_reentrant_ckpt(reentrant)
            for a, b in zip(step(ckpt), want, strict=True):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    finally:
        timm.layers.set_reentrant_ckpt(previous)
    # (d) compile (DeiT: FAN's layers run the same MethodLayer step, compiled in test_method_contract_timm.py)
    if kind == "deit":
        torch._dynamo.reset()
        with torch.no_grad():
            torch.testing.assert_close(torch.compile(ref, fullgraph=True, backend="aot_eager")(x), ref(x),
                                       rtol=1e-5, atol=1e-6)
        torch._dynamo.reset()
    # training without attention dropout runs; with it, refused before anything is computed
    ref.train()(x)
    ref.eval()
    dropping = timm.create_model(TIMM[kind][0], attention=NAME, attn_drop_rate=0.1, **TIMM[kind][2])
    dropping.eval()(x)
    with pytest.raises(ValueError, match="set the attention dropout to 0"):
        dropping.train()(x)
    # (g) timm's save / load
    path = tmp_path / "model.pth"
    torch.save(ref.state_dict(), path)
    name, _, cfg = TIMM[kind]
    loaded = timm.create_model(name, attention=NAME, **cfg).eval()
    timm.models.load_checkpoint(loaded, str(path))
    with torch.no_grad():
        assert torch.equal(loaded(x), ref(x))


# ============================================================================================== transformers
V = 64


def llama_cfg(method=NAME, cfg=None, kv_heads=4, **kw):
    return llama_config(method, cfg, kv_heads=kv_heads, vocab=V, **kw)


def llama_pair(cfg=None, kv_heads=4, **kw):
    return llama_twins(NAME, cfg, kv_heads=kv_heads, vocab=V, **kw)


def ids(n=2, length=8, seed=1):
    return hf_ids(n, length, seed, vocab=V)


def llama_reference(model, x, from_layer):
    """The (float64) Llama by hand (stock modules for embeddings, norms, rotary, MLP), attention written out."""
    return zoo_llama_reference(model, x, twiced_from(from_layer))


@pytest.mark.parametrize("from_layer", [0, 1])
def test_hf_llama_matches_a_float64_reference(from_layer):
    model, stock = llama_pair({"from_layer": from_layer})
    x = ids()
    with torch.no_grad():
        want = llama_reference(stock.double(), x, from_layer)
        torch.testing.assert_close(model.double()(x).logits, want, rtol=1e-10, atol=1e-10)
        assert not torch.allclose(stock(x).logits, want)


def test_hf_switched_off_is_the_stock_model_bit_for_bit():
    T = pytest.importorskip("transformers")
    late, stock = llama_pair({"from_layer": 3})  # past the last layer: every layer computes A v itself
    x = ids()
    x[0, :2] = 0
    mask = (x != 0).long()
    with torch.no_grad():
        want = stock(x, attention_mask=mask).logits
        assert torch.equal(late(x, attention_mask=mask).logits, want)
        softmax = T.LlamaForCausalLM(llama_cfg(method="sdpa")).eval()
        softmax.load_state_dict(stock.state_dict())
        assert torch.equal(softmax(x, attention_mask=mask).logits, want)


@pytest.mark.slow
def test_hf_checkpointing_compile_and_save(tmp_path):
    T = pytest.importorskip("transformers")
    import pid_plugins.hf as ph
    model, _ = llama_pair({"from_layer": 1})  # the layer count threaded too
    x = ids()
    model.train()

    hf_checkpointing_grads(model, causal_lm_loss(x))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    with pytest.raises(ValueError, match="use_reentrant': False"):  # the adapter's one refusal, for every method
        model(x, labels=x)
    model.gradient_checkpointing_disable()
    model.eval()
    with torch.no_grad():
        want = model(x).logits
        torch._dynamo.reset()
        got = torch.compile(model, fullgraph=True, backend="aot_eager")(x).logits
        torch._dynamo.reset()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    model.save_pretrained(tmp_path)
    again = T.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert again.config._attn_implementation == NAME and ph.model_method_config(again.config) == TwicingConfig(1)
    with torch.no_grad():
        assert torch.equal(again(x).logits, want)


def test_hf_cached_generation_equals_recomputation_and_stays_causal():
    """A v of past positions is kept in the cache (tests/test_method_hf_lm.py covers GQA, static, beams, compile)."""
    model, _ = llama_pair({"from_layer": 1})
    x = ids(length=5)
    with torch.no_grad():
        got = model.generate(x, max_new_tokens=3, do_sample=False, pad_token_id=0)
        seq = x
        for _ in range(3):
            seq = torch.cat([seq, model(seq, use_cache=False).logits[:, -1:].argmax(-1)], 1)
        assert torch.equal(got, seq)
        # (f) causal: changing a token changes no earlier position
        full = model(x).logits
        for j in (2, 4):
            y = x.clone()
            y[:, j] = (y[:, j] + 1 - 3) % (V - 3) + 3
            other = model(y).logits
            torch.testing.assert_close(other[:, :j], full[:, :j], rtol=0, atol=0)
            assert not torch.allclose(other[:, j:], full[:, j:])


def test_hf_runs_grouped_query_and_refuses_attention_dropout_in_training():
    model, _ = llama_pair(kv_heads=2)
    with torch.no_grad():
        model(ids())
    model, _ = llama_pair(attention_dropout=0.1)
    model(ids())  # eval: no dropout drawn
    with pytest.raises(ValueError, match="set the attention dropout to 0"):
        model.train()(ids())


def test_hf_encoder_and_encoder_decoder():
    T = pytest.importorskip("transformers")
    import pid_plugins.hf as ph

    torch.manual_seed(0)
    bert = T.BertModel(bert_config(V)).eval()
    x = ids()
    with torch.no_grad():
        stock = bert(x).last_hidden_state
        ph.to_pid(bert, method=NAME)
        got = bert.double()(x).last_hidden_state
        torch.testing.assert_close(got, bert_reference(bert, x, twiced_from(0)), rtol=1e-10, atol=1e-10)
        assert not torch.allclose(got.float(), stock)
    torch.manual_seed(0)
    bart = T.BartModel(bart_config(V)).eval()
    with torch.no_grad():
        want = bart(x).last_hidden_state
        ph.to_pid(bart, {"from_layer": 2}, method=NAME)  # past each stack's last layer: the stock model
        assert torch.equal(bart(x).last_hidden_state, want)
        ph.to_pid(bart, "vision", method=NAME)
        full = bart(x).last_hidden_state
        assert not torch.allclose(full, want)
        # the decoder's self-attention stays causal (the encoder sees all of x; change only the decoder's input)
        dec = x.clone()
        dec[:, 5] = (dec[:, 5] + 1 - 3) % (V - 3) + 3
        other = bart(x, decoder_input_ids=dec).last_hidden_state
        ref = bart(x, decoder_input_ids=x).last_hidden_state
        torch.testing.assert_close(other[:, :5], ref[:, :5], rtol=0, atol=0)
        assert not torch.allclose(other[:, 5:], ref[:, 5:])


# ============================================================================================== mmseg
BACKBONE = mm_args("backbone", layers=2)
HEAD = mm_args("head", layers=2)


def test_mmseg_backbone_and_head_match_float64_references_and_softmax_is_stock():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 32, 32, generator=g, dtype=torch.float64)
    feats = [torch.randn(2, 48, 4, 4, generator=g, dtype=torch.float64)]
    model, stock = mm_pair("backbone", layers=2, attention=NAME)
    softmax = mm_build("PIDVisionTransformer", BACKBONE, seed=1, attention="softmax")
    softmax.load_state_dict(stock.state_dict(), strict=True)
    head, stock_h = mm_pair("head", layers=2, attention=NAME)
    with torch.no_grad():
        assert torch.equal(softmax(x.float())[0], stock(x.float())[0])
        stock, model, stock_h, head = stock.double(), model.double(), stock_h.double(), head.double()
        want = mmseg_reference("backbone", stock, x, twiced_from(0))
        torch.testing.assert_close(model(x)[0], want, rtol=1e-10, atol=1e-10)
        assert (want - stock(x)[0]).abs().max() > 1e-3
        want = mmseg_reference("head", stock_h, feats, twiced_from(0))
        torch.testing.assert_close(head(feats), want, rtol=1e-10, atol=1e-10)


@pytest.mark.slow
def test_mmseg_with_cp_compile_dropout_and_save(tmp_path):
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    ref = mm_build("PIDVisionTransformer", BACKBONE, attention=NAME)
    ckpt = mm_build("PIDVisionTransformer", BACKBONE, attention=NAME, with_cp=True)
    ckpt.load_state_dict(ref.state_dict())
    results = []
    for model in (ref, ckpt):
        model.train()
        inp = x.clone().requires_grad_()
        y = model(inp)[0]
        y.square().mean().backward()
        results.append([y.detach(), inp.grad] + [p.grad for p in model.parameters()])
    assert_equal_or_both_none(*results)
    ref.eval()
    compiled = mm_compiled(ref, x, "eager")
    with torch.no_grad():
        torch.testing.assert_close(compiled, ref(x)[0], rtol=1e-6, atol=1e-6)
    dropping = mm_build("PIDVisionTransformer", BACKBONE, attention=NAME, attn_drop_rate=0.1)
    dropping(x)
    dropping.train()
    with pytest.raises(ValueError, match="set the attention dropout to 0"):
        dropping(x)
    from mmengine.runner.checkpoint import load_checkpoint, save_checkpoint

    path = tmp_path / "iter_1.pth"
    save_checkpoint({"state_dict": ref.state_dict(), "meta": {}}, str(path))
    again = mm_build("PIDVisionTransformer", BACKBONE, seed=3, attention=NAME)
    load_checkpoint(again, str(path), map_location="cpu", strict=True)
    with torch.no_grad():
        assert torch.equal(again(x)[0], ref(x)[0])


# ============================================================================================== fairseq
def fs_build(data_dir, arch="transformer_lm_pid", extra=(), seed=0):
    return zoo_fs_build(data_dir, arch, extra, seed, layers=2)


def fs_twicing(cfg=None):
    return fs_method(NAME, cfg)


def fs_reference(stock, toks, from_layer):
    """fairseq's transformer_lm modules run by hand in float64, the attention written out and twiced."""
    return fairseq_reference(stock, toks, twiced_from(from_layer))

@pytest.mark.slow
def test_fairseq_lm_reference_softmax_causality_and_incremental_decoding(data_dir):
    stock, _, _ = fs_build(data_dir, arch="transformer_lm")
    toks = fs_tokens()
    with torch.no_grad():
        want_stock = stock(toks)[0]
        softmax, _, _ = fs_build(data_dir, extra=["--attention-method", "softmax"], seed=1)
        softmax.load_state_dict(stock.state_dict(), strict=True)
        assert torch.equal(softmax(toks)[0], want_stock)
        for from_layer in (0, 1):
            model, _, _ = fs_build(data_dir, extra=fs_twicing({"from_layer": from_layer}), seed=1)
            model.load_state_dict(stock.state_dict(), strict=True)
            want = fs_reference(stock.double(), toks, from_layer)
            torch.testing.assert_close(model.double()(toks)[0], want, rtol=1e-10, atol=1e-10)
            stock.float()
        assert not torch.allclose(want.float(), want_stock)
        model, _, _ = fs_build(data_dir, extra=fs_twicing({"from_layer": 1}))
        full = model(toks)[0]
        for j in (3, 7):
            changed = toks.clone()
            changed[:, j] = (changed[:, j] - 4 + 7) % 40 + 4
            other = model(changed)[0]
            torch.testing.assert_close(other[:, :j], full[:, :j], rtol=0, atol=0)
            assert not torch.allclose(other[:, j:], full[:, j:])
        # A v of past positions kept in fairseq's incremental buffer: decoding token by token equals the full pass
        torch.testing.assert_close(fs_incremental_logits(model, toks), full, rtol=1e-5, atol=1e-5)
        torch._dynamo.reset()
        compiled = torch.compile(model.decoder, fullgraph=True, backend="eager")(toks)[0]
        torch._dynamo.reset()
        torch.testing.assert_close(compiled, full, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="--checkpoint-activations is not supported"):  # fairseq's one mode
        fs_build(data_dir, extra=[*fs_twicing(), "--checkpoint-activations"])
    dropping, _, _ = fs_build(data_dir, extra=[*fs_twicing(), "--attention-dropout", "0.1"])
    dropping.train()
    with pytest.raises(ValueError, match="set the attention dropout to 0"):
        dropping(toks)


@pytest.mark.slow
def test_fairseq_save_and_reload_through_checkpoint_utils(data_dir, tmp_path):
    model, task, args = fs_build(data_dir, extra=fs_twicing({"from_layer": 1}))
    loaded = fs_save_and_reload(model, task, args, str(tmp_path / "checkpoint_twicing.pt"))
    assert loaded.decoder.layers[0].self_attn.attention_config == TwicingConfig(from_layer=1)
    toks = fs_tokens()
    with torch.no_grad():
        assert torch.equal(loaded(toks)[0], model(toks)[0])
