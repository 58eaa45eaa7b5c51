"""Twicing attention (``attention="twicing"``), ``A v + A (v - A v)``, in every zoo.

The references are written from the official rule (github.com/lazizcodes/twicing_attention: ``SharpAttention`` in
``twicing_attention_vision/models.py``, ``2A - A A`` in ``twicing_attention_lang/lmtool-fwms/src/mem_transformer.py``)
with the attention matrix formed explicitly in float64, not through the method's code. Twicing has no strength
parameter: switched off is ``attention="softmax"`` with the same weights (and ``from_layer`` past the last layer).
"""
import json

import pytest
import torch
import torch.nn.functional as F

import pid_plugins
from pid_plugins.core import AttentionContext, get_method
from pid_plugins.core.siblings.twicing import Twicing, TwicingConfig, twicing_rule

NAME = "twicing"


def twice64(scores, v):
    """The official rule from the attention matrix: ``A = softmax(scores)`` (masked scores), ``A v + A (v - A v)``."""
    a = torch.softmax(scores.double(), -1)
    av = a @ v.double()
    return av + a @ (v.double() - av)


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
    assert isinstance(method, Twicing) and not method.additive and method.state_fields == ("layer",)
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


def test_check_refuses_what_cannot_be_exact():
    method, config = get_method(NAME), TwicingConfig()
    method.check(config, AttentionContext(causal=True))
    for field, match in (("dropout", "set the attention dropout to 0"), ("cached", "use_cache=False"),
                         ("grouped", "num_key_value_heads = num_attention_heads")):
        with pytest.raises(ValueError, match=match):
            method.check(config, AttentionContext(**{field: True}))


def test_from_layer_counts_the_layers_of_a_group():
    """Five layers threaded through ``forward``: stock attention before ``from_layer``, twicing from it on."""
    method, config = get_method(NAME), TwicingConfig(from_layer=2)
    g = torch.Generator().manual_seed(1)
    state = None
    for layer in range(5):
        q, k, v = (torch.randn(1, 2, 4, 3, generator=g, dtype=torch.float64) for _ in range(3))
        out, state = method.forward(config, lambda a, b: F.scaled_dot_product_attention(a, k, b), q, v, v, state)
        scores = q @ k.transpose(-1, -2) / 3 ** 0.5
        want = twice64(scores, v) if layer >= 2 else torch.softmax(scores, -1) @ v
        torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
        assert state[0].shape == (min(layer + 1, 2),)
    assert method.forward(TwicingConfig(), lambda a, b: b, q, v, v, None)[1] == (None,)
    # the attend step alone (as timm calls it) reads the layer's index from the state too
    plain = lambda a, b: F.scaled_dot_product_attention(a, k, b)  # noqa: E731
    torch.testing.assert_close(method.attend(config, plain, q, v, None), plain(q, v), rtol=0, atol=0)
    torch.testing.assert_close(method.attend(config, plain, q, v, state), twice64(q @ k.transpose(-1, -2) / 3 ** 0.5, v),
                               rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="as many value heads as query heads"):
        twicing_rule(lambda a, b: a, q, v[:, :1])


# ============================================================================================== timm
DEIT = dict(img_size=32, patch_size=8, embed_dim=48, depth=3, num_heads=3, num_classes=10)
FAN = dict(img_size=32, embed_dim=48, depth=2, num_heads=4, num_classes=10)
TIMM = {"deit": ("pid_deit_tiny_patch16_224", "deit_tiny_patch16_224", DEIT),
        "fan": ("pid_fan_tiny_12_p16_224", "fan_tiny_12_p16_224", FAN)}


def timm_pair(kind, **kw):
    timm = pytest.importorskip("timm")
    import pid_plugins.timm  # noqa: F401

    name, base, cfg = TIMM[kind]
    torch.manual_seed(0)
    stock = timm.create_model(base, **cfg, **kw)
    model = timm.create_model(name, attention=NAME, **cfg, **kw)
    model.load_state_dict(stock.state_dict())
    return model.eval(), stock.eval()


def images(kind, n=2):
    size = TIMM[kind][2]["img_size"]
    return torch.randn(n, 3, size, size, generator=torch.Generator().manual_seed(1))


def deit_reference(stock, x):
    """The stock DeiT's modules in float64, every layer's attention twiced by hand."""
    h = stock.norm_pre(stock._pos_embed(stock.patch_embed(x)))
    for blk in stock.blocks:
        a = blk.attn
        B, N, C = h.shape
        q, k, v = a.qkv(blk.norm1(h)).reshape(B, N, 3, a.num_heads, a.head_dim).permute(2, 0, 3, 1, 4)
        h = h + a.proj(twice64(q @ k.transpose(-1, -2) * a.head_dim ** -0.5, v).transpose(1, 2).reshape(B, N, C))
        h = h + blk.mlp(blk.norm2(h))
    return stock.forward_head(stock.norm(h))


def fan_attention_reference(stock, h):
    """FAN's token-mixing layers in float64 (the stack of its blocks' attentions, each fed the previous one's
    output), twiced by hand. (FAN's whole model in float64 runs its grouped convolutions in torch's slow float64
    kernel: the rest of FAN's model is checked with the toy method in test_method_contract_timm.py.)"""
    for blk in stock.blocks:
        a = blk.attn
        B, N, C = h.shape
        q = a.q(h).reshape(B, N, a.num_heads, -1).transpose(1, 2)
        k, v = a.kv(h).reshape(B, N, 2, a.num_heads, -1).permute(2, 0, 3, 1, 4)
        h = a.proj(twice64(q @ k.transpose(-1, -2) * a.head_dim ** -0.5, v).transpose(1, 2).reshape(B, N, C))
    return h


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("kind", sorted(TIMM))
def test_timm_matches_a_float64_reference_and_softmax_is_stock(kind, fused):
    timm = pytest.importorskip("timm")
    model, stock = timm_pair(kind)
    for m in (model, stock):
        for blk in m.blocks:
            blk.attn.fused_attn = fused
    x = images(kind)
    with torch.no_grad():
        softmax = timm.create_model(TIMM[kind][0], attention="softmax", **TIMM[kind][2]).eval()
        softmax.load_state_dict(stock.state_dict())
        for blk in softmax.blocks:
            blk.attn.fused_attn = fused
        assert torch.equal(softmax(x), stock(x))  # (b): the stock attention with the same weights
        model, stock = model.double(), stock.double()
        if kind == "deit":
            want = deit_reference(stock, x.double())
            torch.testing.assert_close(model(x.double()), want, rtol=1e-10, atol=1e-10)
            assert not torch.allclose(stock(x.double()), want)
        else:
            h = torch.randn(2, 5, 48, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
            got, state = h, None
            for blk in model.blocks:
                got, state = blk.attn(got, state)
            assert state == (None,)  # every layer twices: nothing to count
            torch.testing.assert_close(got, fan_attention_reference(stock, h), rtol=1e-10, atol=1e-10)
    # from_layer past the last layer (the language preset, layers >= 14): every layer computes the stock attention
    late = timm.create_model(TIMM[kind][0], attention=NAME, attention_cfg="lm", **TIMM[kind][2]).eval()
    late.load_state_dict(stock.state_dict())
    for blk in late.blocks:
        blk.attn.fused_attn = fused
    with torch.no_grad():
        torch.testing.assert_close(late.float()(x.float()), stock.float()(x.float()), rtol=0, atol=0)


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


def llama_cfg(T, method=NAME, cfg=None, layers=3, kv_heads=4, **kw):
    args = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
                num_key_value_heads=kv_heads, max_position_embeddings=64, pad_token_id=0)
    args.update(attn_implementation=method, **({method: cfg} if cfg is not None else {}))
    return T.LlamaConfig(**{**args, **kw})


def llama_pair(cfg=None, **kw):
    T = pytest.importorskip("transformers")
    import pid_plugins.hf  # noqa: F401

    torch.manual_seed(0)
    model = T.LlamaForCausalLM(llama_cfg(T, cfg=cfg, **kw)).eval()
    stock = T.LlamaForCausalLM(llama_cfg(T, method="sdpa", **kw)).eval()
    stock.load_state_dict(model.state_dict())
    return model, stock


def ids(n=2, length=8, seed=1):
    return torch.randint(3, V, (n, length), generator=torch.Generator().manual_seed(seed))


def llama_reference(model, x, from_layer):
    """The Llama by hand in float64 (stock modules for embeddings, norms, rotary, MLP), attention written out."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    m = model.model.double()
    B, N = x.shape
    h = m.embed_tokens(x)
    cos, sin = m.rotary_emb(h, torch.arange(N)[None])
    causal = torch.full((N, N), float("-inf"), dtype=torch.float64).triu(1)
    for index, layer in enumerate(m.layers):
        a = layer.self_attn
        D = a.head_dim
        t = layer.input_layernorm(h)
        q, k, v = (p(t).view(B, N, -1, D).transpose(1, 2) for p in (a.q_proj, a.k_proj, a.v_proj))
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        scores = q @ k.transpose(-1, -2) * D ** -0.5 + causal
        u = twice64(scores, v) if index >= from_layer else torch.softmax(scores, -1) @ v
        h = h + a.o_proj(u.transpose(1, 2).reshape(B, N, -1))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return model.lm_head(m.norm(h))


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
        softmax = T.LlamaForCausalLM(llama_cfg(T, method="sdpa")).eval()
        softmax.load_state_dict(stock.state_dict())
        assert torch.equal(softmax(x, attention_mask=mask).logits, want)


def test_hf_checkpointing_compile_and_save(tmp_path):
    T = pytest.importorskip("transformers")
    import pid_plugins.hf as ph
    model, _ = llama_pair({"from_layer": 1})  # the layer count threaded too
    x = ids()
    model.train()

    def grads():
        model.zero_grad()
        out = model(x, labels=x)
        out.loss.backward()
        return out.logits.detach(), [p.grad.clone() for p in model.parameters()]

    plain = grads()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ckpt = grads()
    torch.testing.assert_close(ckpt[0], plain[0], rtol=0, atol=0)
    for a, b in zip(ckpt[1], plain[1]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
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


def test_hf_generation_refuses_the_cache_and_recomputes_without_it():
    model, _ = llama_pair({"from_layer": 1})
    x = ids(length=5)
    with torch.no_grad():
        with pytest.raises(ValueError, match="use_cache=False"):
            model.generate(x, max_new_tokens=3, do_sample=False, pad_token_id=0)
        got = model.generate(x, max_new_tokens=3, do_sample=False, use_cache=False, pad_token_id=0)
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


def test_hf_refuses_grouped_query_and_attention_dropout():
    model, _ = llama_pair(kv_heads=2)
    with torch.no_grad(), pytest.raises(ValueError, match="num_key_value_heads = num_attention_heads"):
        model(ids())
    model, _ = llama_pair(attention_dropout=0.1)
    model(ids())  # eval: no dropout drawn
    with pytest.raises(ValueError, match="set the attention dropout to 0"):
        model.train()(ids())


def bert_reference(model, x):
    """BERT's encoder by hand in float64 (its modules for embeddings, output blocks and FFN), attention written
    out and twiced."""
    emb = model.embeddings(x)
    h = emb
    for layer in model.encoder.layer:
        s = layer.attention.self
        B, N, _ = h.shape
        H, D = s.num_attention_heads, s.attention_head_size
        q, k, v = (p(h).view(B, N, H, D).transpose(1, 2) for p in (s.query, s.key, s.value))
        ctx = twice64(q @ k.transpose(-1, -2) / D ** 0.5, v).transpose(1, 2).reshape(B, N, H * D)
        att = layer.attention.output(ctx, h)
        h = layer.output(layer.intermediate(att), att)
    return h


def test_hf_encoder_and_encoder_decoder():
    T = pytest.importorskip("transformers")
    import pid_plugins.hf as ph

    torch.manual_seed(0)
    bert = T.BertModel(T.BertConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                    intermediate_size=64, max_position_embeddings=32)).eval()
    x = ids()
    with torch.no_grad():
        stock = bert(x).last_hidden_state
        ph.to_pid(bert, method=NAME)
        got = bert.double()(x).last_hidden_state
        torch.testing.assert_close(got, bert_reference(bert, x), rtol=1e-10, atol=1e-10)
        assert not torch.allclose(got.float(), stock)
    torch.manual_seed(0)
    bart = T.BartModel(T.BartConfig(vocab_size=V, d_model=32, encoder_layers=2, decoder_layers=2,
                                    encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                                    decoder_ffn_dim=64, max_position_embeddings=32)).eval()
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
BACKBONE = dict(img_size=(32, 32), patch_size=8, embed_dims=48, num_layers=2, num_heads=3, drop_path_rate=0.0,
                final_norm=True, with_cls_token=True, norm_cfg=dict(type="LN", eps=1e-6))
HEAD = dict(in_channels=48, channels=48, num_classes=5, num_layers=2, num_heads=3, embed_dims=48,
            dropout_ratio=0.0, drop_path_rate=0.0, norm_cfg=dict(type="LN"))


def mm_build(type, args, seed=0, **kw):
    pytest.importorskip("mmseg")
    import pid_plugins.mmseg  # noqa: F401
    from mmseg.registry import MODELS

    torch.manual_seed(seed)
    model = MODELS.build(dict(type=type, **args, **kw))
    model.init_weights()
    model.eval()
    return model


def mm_layers(layers, h, heads):
    """mmseg ``TransformerEncoderLayer``s (pre-norm, packed in_proj, FFN) with every attention twiced by hand."""
    for layer in layers:
        mha = layer.attn.attn
        B, N, C = h.shape
        qkv = (layer.norm1(h) @ mha.in_proj_weight.T + mha.in_proj_bias).reshape(B, N, 3, heads, C // heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        u = twice64(q @ k.transpose(-1, -2) * (C // heads) ** -0.5, v)
        h = h + mha.out_proj(u.transpose(1, 2).reshape(B, N, C))
        h = layer.ffn(layer.norm2(h), identity=h)
    return h


def test_mmseg_backbone_and_head_match_float64_references_and_softmax_is_stock():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 32, 32, generator=g, dtype=torch.float64)
    feats = [torch.randn(2, 48, 4, 4, generator=g, dtype=torch.float64)]
    stock = mm_build("VisionTransformer", BACKBONE)
    model = mm_build("PIDVisionTransformer", BACKBONE, seed=1, attention=NAME)
    model.load_state_dict(stock.state_dict(), strict=True)
    softmax = mm_build("PIDVisionTransformer", BACKBONE, seed=1, attention="softmax")
    softmax.load_state_dict(stock.state_dict(), strict=True)
    stock_h = mm_build("SegmenterMaskTransformerHead", HEAD)
    head = mm_build("PIDSegmenterMaskTransformerHead", HEAD, seed=1, attention=NAME)
    head.load_state_dict(stock_h.state_dict(), strict=True)
    with torch.no_grad():
        assert torch.equal(softmax(x.float())[0], stock(x.float())[0])
        stock, model, stock_h, head = stock.double(), model.double(), stock_h.double(), head.double()
        h, hw = stock.patch_embed(x)
        h = stock._pos_embeding(torch.cat([stock.cls_token.expand(2, -1, -1), h], 1), hw, stock.pos_embed)
        h = stock.norm1(mm_layers(stock.layers, h, 3))
        want = h[:, 1:].reshape(2, 4, 4, 48).permute(0, 3, 1, 2)
        torch.testing.assert_close(model(x)[0], want, rtol=1e-10, atol=1e-10)
        assert (want - stock(x)[0]).abs().max() > 1e-3
        h = stock_h.dec_proj(feats[0].flatten(2).transpose(1, 2))
        h = stock_h.decoder_norm(mm_layers(stock_h.layers, torch.cat([h, stock_h.cls_emb.expand(2, -1, -1)], 1), 3))
        patches = F.normalize(stock_h.patch_proj(h[:, :-5]), dim=2)
        classes = F.normalize(stock_h.classes_proj(h[:, -5:]), dim=2)
        want = stock_h.mask_norm(patches @ classes.transpose(1, 2)).transpose(1, 2).reshape(2, 5, 4, 4)
        torch.testing.assert_close(head(feats), want, rtol=1e-10, atol=1e-10)


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
    for a, b in zip(*results):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    ref.eval()
    torch._dynamo.reset()
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(ref.forward, fullgraph=True, backend="eager")(x)[0], ref(x)[0],
                                   rtol=1e-6, atol=1e-6)
    torch._dynamo.reset()
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
TINY = ["--decoder-layers", "2", "--decoder-embed-dim", "32", "--decoder-ffn-embed-dim", "64",
        "--decoder-attention-heads", "4", "--tokens-per-sample", "32", "--dropout", "0"]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    pytest.importorskip("fairseq")
    from fairseq.data import Dictionary

    d = tmp_path_factory.mktemp("dict")
    dictionary = Dictionary()
    for i in range(40):
        dictionary.add_symbol(f"w{i}")
    dictionary.save(str(d / "dict.txt"))
    return d


def fs_build(data_dir, arch="transformer_lm_pid", extra=(), seed=0):
    from fairseq import options, tasks

    import pid_plugins.fairseq as pf

    args = options.parse_args_and_arch(options.get_training_parser(), [
        str(data_dir), "--task", "language_modeling", "--arch", arch, "--user-dir", pf.USER_DIR, *TINY, *extra])
    task = tasks.setup_task(args)
    torch.manual_seed(seed)
    model = task.build_model(args)
    model.eval()
    return model, task, args


def fs_twicing(cfg=None):
    return ["--attention-method", NAME] + (["--attention-cfg", json.dumps(cfg)] if cfg is not None else [])


def fs_tokens(n=2, length=10, seed=1):
    return torch.randint(4, 44, (n, length), generator=torch.Generator().manual_seed(seed))


def fs_reference(stock, toks, from_layer):
    """fairseq's transformer_lm modules run by hand in float64, the attention written out and twiced."""
    dec = stock.decoder
    B, N = toks.shape
    x = dec.embed_scale * dec.embed_tokens(toks)
    if dec.project_in_dim is not None:
        x = dec.project_in_dim(x)
    x = (x + dec.embed_positions(toks)).transpose(0, 1)
    causal = torch.full((N, N), float("-inf"), dtype=torch.float64).triu(1)
    for index, layer in enumerate(dec.layers):
        attn = layer.self_attn
        H, D = attn.num_heads, attn.head_dim
        residual = x
        h = layer.self_attn_layer_norm(x) if layer.normalize_before else x
        q, k, v = (p(h).view(N, B, H, D).permute(1, 2, 0, 3) for p in (attn.q_proj, attn.k_proj, attn.v_proj))
        scores = q @ k.transpose(-1, -2) / D ** 0.5 + causal
        u = twice64(scores, v) if index >= from_layer else torch.softmax(scores, -1) @ v
        x = residual + attn.out_proj(u.permute(2, 0, 1, 3).reshape(N, B, H * D))
        if not layer.normalize_before:
            x = layer.self_attn_layer_norm(x)
        residual = x
        h = layer.final_layer_norm(x) if layer.normalize_before else x
        x = residual + layer.fc2(layer.activation_fn(layer.fc1(h)))
        if not layer.normalize_before:
            x = layer.final_layer_norm(x)
    if dec.layer_norm is not None:
        x = dec.layer_norm(x)
    x = x.transpose(0, 1)
    if dec.project_out_dim is not None:
        x = dec.project_out_dim(x)
    return dec.output_layer(x)


def test_fairseq_lm_reference_softmax_causality_and_cache_refusal(data_dir):
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
        with pytest.raises(ValueError, match="no incremental_state"):
            model(toks[:, :1], incremental_state={})
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


def test_fairseq_save_and_reload_through_checkpoint_utils(data_dir, tmp_path):
    from fairseq import checkpoint_utils
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from omegaconf import OmegaConf

    model, task, args = fs_build(data_dir, extra=fs_twicing({"from_layer": 1}))
    path = str(tmp_path / "checkpoint_twicing.pt")
    checkpoint_utils.torch_persistent_save({
        "cfg": OmegaConf.to_container(convert_namespace_to_omegaconf(args), resolve=True, enum_to_str=True),
        "args": None, "model": model.state_dict(),
        "optimizer_history": [{"criterion_name": "CrossEntropyCriterion", "optimizer_name": "Adam",
                               "lr_scheduler_state": {}, "num_updates": 0}],
        "extra_state": {"train_iterator": {"epoch": 1}}, "last_optimizer_state": None,
    }, path)
    (loaded,), _ = checkpoint_utils.load_model_ensemble([path], task=task)
    loaded.eval()
    assert loaded.decoder.layers[0].self_attn.pid == TwicingConfig(from_layer=1)
    toks = fs_tokens()
    with torch.no_grad():
        assert torch.equal(loaded(toks)[0], model(toks)[0])
