"""NeuTRENO (``attention="neutreno"``) in every zoo: the rule against its loop statement, float64 references written
from the official rule (github.com/tamnguyen9520/NeuTRENO_NeurIPS2024: ``DeiT/neutreno.py``,
``segmenter/segm/model/blocks_neutreno.py``, ``wikitext103/src/mem_transformer.py``: layer 1 computes ``A v`` and
records ``v^1``; layers l >= 2 compute ``A v + alpha (v^1 - v^l)``), alpha = 0 equals the stock model bit for bit,
checkpointing, torch.compile, cached decoding, causality, save/reload and warm-up.

The references never call pid_plugins' code: attention written out by hand from the stock modules' weights (or the
stock model with hooks that add the term at its output projection), the term from :func:`naive_neutreno`.
"""
import json
import math

import pytest
import torch
import torch.nn.functional as F

import pid_plugins
from pid_plugins import pid_update
from pid_plugins.core import AttentionContext
from pid_plugins.core.siblings.neutreno import NeuTRENOConfig, NeuTRENOMethod

NAME = "neutreno"


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models: one intra-op thread (float64 convolutions, e.g. FAN's, take the slow kernel, whose parallel
    regions cost far more than they compute on a shared machine); restored afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def naive_neutreno(attn_out, values, alpha):
    """The official rule, position by position in float64: ``attn_out`` (B, H, N, D) is this layer's ``A v``,
    ``values`` the group's values so far ``[v^1, ..., v^l]`` (B, H_kv, N, D); a query head reads key/value head
    ``h // (H / H_kv)``."""
    B, H, N, D = attn_out.shape
    group = H // values[0].shape[1]
    u = attn_out.double().clone()
    if len(values) == 1:
        return u
    for b in range(B):
        for h in range(H):
            for i in range(N):
                u[b, h, i] += alpha * (values[0][b, h // group, i].double() - values[-1][b, h // group, i].double())
    return u


# ================================================================================================ core
def test_method_is_registered_with_the_official_presets():
    method = pid_plugins.get_method(NAME)
    assert isinstance(method, NeuTRENOMethod) and NAME in pid_plugins.list_methods()
    assert method.state_fields == ("v_first",) and method.additive
    assert {z: method.configure(None, z).alpha for z in ("timm", "mmseg", "hf", "fairseq")} == {
        "timm": 0.6, "mmseg": 0.6, "hf": 0.4, "fairseq": 0.4}
    assert NeuTRENOConfig.preset("segmenter") == NeuTRENOConfig(alpha=0.6)
    assert method.is_identity(NeuTRENOConfig(alpha=0.0)) and not method.is_identity(NeuTRENOConfig())
    cfg = NeuTRENOConfig(alpha=0.25, warmup_steps=3)
    assert NeuTRENOConfig.from_dict(cfg.to_dict()) == cfg
    # every term is per position: nothing to refuse (causal, cached, dropout after A, grouped-query)
    method.check(cfg, AttentionContext(causal=True, cached=True, dropout=True, grouped=True))


@pytest.mark.parametrize("bad, match", [
    ({"alpha": -0.1}, "alpha must be a finite number >= 0"),
    ({"alpha": float("inf")}, "alpha must be a finite number >= 0"),
    ({"alpha": "0.6"}, "alpha must be float"),
    ({"warmup_steps": -2}, "warmup_steps must be a whole number"),
    ({"beta": 1.0}, r"unknown NeuTRENOConfig field\(s\) \['beta'\]"),
    ("wikitext", "unknown NeuTRENOConfig preset 'wikitext'"),
])
def test_bad_parameters_are_refused_saying_what_to_change(bad, match):
    with pytest.raises(ValueError, match=match):
        pid_plugins.get_method(NAME).configure(bad, "timm")


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_rule_against_its_loop_statement_and_pid(kv_heads):
    """Four layers of random ``A v`` and values, the state threaded as adapters thread it: the loop statement, and
    PID with gains (alpha, 0, 0, beta=1) under both first-layer conventions (bit for bit)."""
    method, alpha = pid_plugins.get_method(NAME), 0.6
    g = torch.Generator().manual_seed(0)
    outs = [torch.randn(2, 4, 5, 8, generator=g) for _ in range(4)]
    values = [torch.randn(2, kv_heads, 5, 8, generator=g) for _ in range(4)]
    state, pid_states = None, [None, None]
    for layer, (a, v) in enumerate(zip(outs, values)):
        got, state = method.update(NeuTRENOConfig(alpha=alpha), a, v, state, None, -3)
        assert len(state) == 1 and state[0] is values[0]
        torch.testing.assert_close(got.double(), naive_neutreno(a, values[:layer + 1], alpha), rtol=1e-6, atol=1e-6)
        for k, first in enumerate((True, False)):
            pid, pid_states[k] = pid_update(a, v, pid_states[k], (alpha, 0.0, 0.0, 1.0, first))
            assert torch.equal(got, pid)  # the same float operations: bit for bit
        if layer == 0:
            assert torch.equal(got, a)


def test_warmup_scale_term_and_half_precision():
    method = pid_plugins.get_method(NAME)
    cfg = NeuTRENOConfig(alpha=0.4)
    g = torch.Generator().manual_seed(1)
    a, v1, v2 = (torch.randn(1, 2, 3, 4, generator=g) for _ in range(3))
    state = method.update(cfg, a, v1, None, None, -3)[1]
    scale = torch.tensor(0.5, dtype=torch.float64)
    got = method.update(cfg, a, v2, state, scale, -3)[0]
    torch.testing.assert_close(got, a + 0.2 * (v1 - v2), rtol=1e-6, atol=1e-7)
    assert torch.equal(method.update(cfg, a, v2, state, torch.zeros((), dtype=torch.float64), -3)[0], a)
    term = method.term(cfg, v2, state, None)[0]
    torch.testing.assert_close(term, 0.4 * (v1 - v2), rtol=1e-6, atol=1e-7)
    # float16: the term in float32, the output rounded once
    half = method.update(cfg, a.half(), v2.half(), (v1.half(),), None, -3)[0]
    assert half.dtype == torch.float16
    want = (a.half().float() + 0.4 * (v1.half().float() - v2.half().float())).half()
    assert torch.equal(half, want)
    with pytest.raises(ValueError, match="values of one shape"):
        method.update(cfg, a, v2[..., :2, :], state, None, -3)


# ================================================================================================ timm
def _timm():
    timm = pytest.importorskip("timm")
    import pid_plugins.timm  # noqa: F401  (registers the pid_* models and the fan_* names)

    return timm


DEIT = dict(img_size=32, patch_size=8, embed_dim=48, depth=3, num_heads=3, num_classes=10)
FAN = dict(img_size=64, embed_dim=48, depth=3, num_heads=4, num_classes=10)
TIMM = {"deit": ("pid_deit_tiny_patch16_224", "deit_tiny_patch16_224", DEIT),
        "fan": ("pid_fan_tiny_12_p16_224", "fan_tiny_12_p16_224", FAN)}


def timm_pair(kind, alpha=0.6, seed=0, **method):
    """(NeuTRENO model, stock model) with the same weights; ``method``: more NeuTRENO parameters."""
    timm = _timm()
    name, base, cfg = TIMM[kind]
    torch.manual_seed(seed)
    stock = timm.create_model(base, **cfg)
    model = timm.create_model(name, attention=NAME, attention_cfg={"alpha": alpha, **method}, **cfg)
    model.load_state_dict(stock.state_dict())  # strict: NeuTRENO adds no parameters
    return model.eval(), stock.eval()


def images(kind, n=2, seed=1):
    size = TIMM[kind][2]["img_size"]
    return torch.randn(n, 3, size, size, generator=torch.Generator().manual_seed(seed))


def timm_reference(kind, stock, x, alpha):
    """The stock model's modules in float64, attention by hand, the term from :func:`naive_neutreno`."""
    if kind == "deit":
        h = stock.norm_pre(stock._pos_embed(stock.patch_embed(x)))
    else:
        h, Hp, Wp = stock._embed(x)
    values = []
    for blk in stock.blocks:
        a = blk.attn
        B, N, C = h.shape
        t = blk.norm1(h)
        if kind == "deit":
            q, k, v = a.qkv(t).reshape(B, N, 3, a.num_heads, a.head_dim).permute(2, 0, 3, 1, 4)
        else:
            q = a.q(t).reshape(B, N, a.num_heads, -1).transpose(1, 2)
            k, v = a.kv(t).reshape(B, N, 2, a.num_heads, -1).permute(2, 0, 3, 1, 4)
        values.append(v)
        u = naive_neutreno(torch.softmax(q @ k.transpose(-1, -2) * a.head_dim ** -0.5, -1) @ v, values, alpha)
        y = a.proj(u.transpose(1, 2).reshape(B, N, C))
        if kind == "deit":
            h = h + y
            h = h + blk.mlp(blk.norm2(h))
        else:
            h = h + blk.gamma1 * y
            h = h + blk.gamma2 * blk.mlp(blk.norm2(h), Hp, Wp)
    if kind == "deit":
        return stock.forward_head(stock.norm(h))
    return stock.forward_head(stock.norm(stock.forward_cls(h)))


@pytest.mark.parametrize("kind", sorted(TIMM))
def test_timm_matches_a_float64_reference(kind):
    model, stock = timm_pair(kind, alpha=0.6)
    assert model.pid == NeuTRENOConfig(alpha=0.6) and model.attention_method.name == NAME
    model, stock = model.double(), stock.double()
    x = images(kind).double()
    with torch.no_grad():
        want = timm_reference(kind, stock, x, 0.6)
        torch.testing.assert_close(model(x), want, rtol=1e-10, atol=1e-10)
        assert (stock(x) - want).abs().max() > 1e-3


@pytest.mark.parametrize("kind", sorted(TIMM))
def test_timm_alpha_zero_is_the_stock_model_bit_for_bit(kind):
    model, stock = timm_pair(kind, alpha=0.0)
    x = images(kind)
    for fused in (True, False):
        for m in (model, stock):
            for blk in m.blocks:
                blk.attn.fused_attn = fused
        with torch.no_grad():
            assert torch.equal(model(x), stock(x))


@pytest.mark.parametrize("kind", sorted(TIMM))
def test_timm_checkpointing_compile_and_save_reload(kind, tmp_path):
    timm = _timm()
    name, _, cfg = TIMM[kind]
    ref, _ = timm_pair(kind)
    x = images(kind)
    # gradient checkpointing, both of timm's modes
    previous = timm.layers.use_reentrant_ckpt()
    try:
        results = []
        for ckpt, reentrant in ((False, False), (True, False), (True, True)):
            ref.zero_grad(set_to_none=True)
            ref.set_grad_checkpointing(ckpt)
            timm.layers.set_reentrant_ckpt(reentrant)
            inp = x.clone().requires_grad_()
            out = ref(inp)
            out.square().mean().backward()
            results.append([out.detach(), inp.grad] + [p.grad for p in ref.parameters()])
        ref.set_grad_checkpointing(False)
    finally:
        timm.layers.set_reentrant_ckpt(previous)
    for other in results[1:]:
        for a, b in zip(results[0], other):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # torch.compile(fullgraph=True)
    torch._dynamo.reset()
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(ref, fullgraph=True, backend="aot_eager")(x), ref(x),
                                   rtol=1e-5, atol=1e-6)
    # timm's save/load (weights only)
    path = tmp_path / "model.pth"
    torch.save(ref.state_dict(), path)
    other = timm.create_model(name, attention=NAME, attention_cfg={"alpha": 0.6}, **cfg).eval()
    timm.models.load_checkpoint(other, str(path))
    with torch.no_grad():
        assert torch.equal(other(x), ref(x))


def test_timm_warmup_starts_at_the_stock_model_and_reaches_the_method():
    model, stock = timm_pair("deit", alpha=0.6, warmup_steps=2)
    full, _ = timm_pair("deit", alpha=0.6)
    x = images("deit")
    assert model.pid_warmup is not None and model.pid_warmup.warmup_steps == 2
    model.train()
    with torch.no_grad():
        assert torch.equal(model(x), stock(x))  # t = 0
        model(x)
        model.eval()
        torch.testing.assert_close(model(x), full(x), rtol=1e-6, atol=1e-6)  # t = 2: full alpha


# ================================================================================================ transformers
def _hf():
    transformers = pytest.importorskip("transformers")
    import pid_plugins.hf  # noqa: F401  (every registered method becomes an attn_implementation)

    return transformers


V = 96


def llama_twins(alpha=0.4, layers=3):
    T = _hf()
    args = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0)
    torch.manual_seed(0)
    model = T.LlamaForCausalLM(T.LlamaConfig(**args, attn_implementation=NAME, neutreno={"alpha": alpha})).eval()
    stock = T.LlamaForCausalLM(T.LlamaConfig(**args, attn_implementation="sdpa")).eval()
    stock.load_state_dict(model.state_dict())
    return model, stock


def token_ids(n=2, length=8, seed=1):
    return torch.randint(3, V, (n, length), generator=torch.Generator().manual_seed(seed))


def test_hf_llama_matches_a_float64_reference():
    """Llama (grouped-query, rotary, causal) by hand: each query head reads its key/value head's v^1 - v^l."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    model, stock = llama_twins(alpha=0.4)
    from pid_plugins.hf import model_method_config

    assert model_method_config(model.config) == NeuTRENOConfig(alpha=0.4)
    model.double()
    m = stock.double().model
    x = token_ids()
    B, N = x.shape
    with torch.no_grad():
        got = model(x).logits
        h = m.embed_tokens(x)
        cos, sin = m.rotary_emb(h, torch.arange(N)[None])
        causal = torch.full((N, N), float("-inf"), dtype=torch.float64).triu(1)
        values = []
        for layer in m.layers:
            a = layer.self_attn
            D = a.head_dim
            t = layer.input_layernorm(h)
            q, k, v = (p(t).view(B, N, -1, D).transpose(1, 2) for p in (a.q_proj, a.k_proj, a.v_proj))
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            r = q.shape[1] // k.shape[1]
            out = torch.softmax(q @ k.repeat_interleave(r, 1).transpose(-1, -2) * D ** -0.5 + causal, -1)
            values.append(v)
            u = naive_neutreno(out @ v.repeat_interleave(r, 1), values, 0.4)
            h = h + a.o_proj(u.transpose(1, 2).reshape(B, N, -1))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        want = stock.lm_head(m.norm(h))
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    assert (got - stock(x).logits).abs().max() > 1e-3


def test_hf_llama_alpha_zero_checkpointing_and_compile():
    zero, stock = llama_twins(alpha=0.0)
    x = token_ids()
    with torch.no_grad():
        assert torch.equal(zero(x).logits, stock(x).logits)
    model, _ = llama_twins()
    model.train()

    def grads():
        model.zero_grad()
        out = model(x, labels=x)
        out.loss.backward()
        return out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    plain_logits, plain = grads()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ckpt_logits, ckpt = grads()
    torch.testing.assert_close(ckpt_logits, plain_logits, rtol=0, atol=0)
    for name in plain:
        torch.testing.assert_close(ckpt[name], plain[name], rtol=1e-6, atol=1e-7)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    with pytest.raises(ValueError, match="use_reentrant': False"):
        model(x, labels=x)
    model.gradient_checkpointing_disable()
    model.eval()
    torch._dynamo.reset()
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(model, fullgraph=True, backend="aot_eager")(x).logits,
                                   model(x).logits, rtol=1e-5, atol=1e-5)


def test_hf_cached_generation_equals_recomputation_and_is_causal():
    model, _ = llama_twins()
    x = token_ids(length=6)
    with torch.no_grad():
        seq = x
        for _ in range(6):
            seq = torch.cat([seq, model(seq, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)], 1)
        assert torch.equal(model.generate(x, max_new_tokens=6, do_sample=False, pad_token_id=0), seq)
        static = model.generate(x, max_new_tokens=6, do_sample=False, cache_implementation="static", pad_token_id=0)
        assert torch.equal(static, seq)
        full = model(seq).logits
        for j in (2, 7):
            y = seq.clone()
            y[:, j] = (y[:, j] + 1) % V
            other = model(y).logits
            torch.testing.assert_close(other[:, :j], full[:, :j], rtol=0, atol=0)
            assert not torch.allclose(other[:, j:], full[:, j:])


def test_hf_save_and_reload(tmp_path):
    T = _hf()
    from pid_plugins.hf import model_method_config

    model, _ = llama_twins(alpha=0.3)
    model.save_pretrained(tmp_path)
    again = T.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert again.config._attn_implementation == NAME
    assert model_method_config(again.config) == NeuTRENOConfig(alpha=0.3)
    x = token_ids()
    with torch.no_grad():
        assert torch.equal(again(x).logits, model(x).logits)


def hooked_reference(stock, groups, alpha, heads, **inputs):
    """The stock model (float64, eager) with the rule added by hooks: ``groups`` lists, per group of self-attention
    layers, ``(value projection, output projection)`` pairs; the term is added to the output projection's input
    (the heads' outputs concatenated, the layout of the value projection's output, no grouped-query)."""
    handles, values = [], {}

    def record(key):
        def hook(module, args, out):
            values[key] = out
        return hook

    def add_term(group, index):
        def hook(module, args):
            (x,) = args
            B, N, C = x.shape
            per_head = [values[(group, i)].view(B, N, heads, -1).transpose(1, 2) for i in range(index + 1)]
            a = x.view(B, N, heads, -1).transpose(1, 2)
            return (naive_neutreno(a, per_head, alpha).transpose(1, 2).reshape(B, N, C),)
        return hook

    for g, group in enumerate(groups):
        for i, (v_proj, out_proj) in enumerate(group):
            handles.append(v_proj.register_forward_hook(record((g, i))))
            handles.append(out_proj.register_forward_pre_hook(add_term(g, i)))
    try:
        with torch.no_grad():
            return stock(**inputs)
    finally:
        for handle in handles:
            handle.remove()


@pytest.mark.parametrize("family", ["bert", "bart"])
def test_hf_encoder_and_encoder_decoder_match_a_float64_reference(family):
    """BERT (an encoder: one group) and BART (the encoder's and the decoder's self-attention stacks are two groups,
    cross-attention untouched), against the hooked stock model; alpha = 0 is the stock model bit for bit; the
    encoder-decoder's cached decoding equals recomputation."""
    T = _hf()
    import pid_plugins.hf as ph

    if family == "bert":
        cfg = T.BertConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                           intermediate_size=64, max_position_embeddings=32)
        cls = T.BertModel
    else:
        cfg = T.BartConfig(vocab_size=V, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                           decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
                           max_position_embeddings=32, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                           decoder_start_token_id=1, forced_eos_token_id=None)
        cls = T.BartForConditionalGeneration
    torch.manual_seed(0)
    stock = cls(cfg).eval()
    model = cls(cfg).eval()
    model.load_state_dict(stock.state_dict())
    x = dict(input_ids=token_ids(length=7))
    if family == "bart":
        x["decoder_input_ids"] = token_ids(length=5, seed=2)

    def main(out):
        return out.logits if family == "bart" else out.last_hidden_state

    with torch.no_grad():
        want = main(stock(**x))
        ph.to_pid(model, {"alpha": 0.0}, method=NAME)
        assert torch.equal(main(model(**x)), want)
        ph.to_pid(model, {"alpha": 0.6}, method=NAME)
        got = main(model.double()(**x))
    stock.double().set_attn_implementation("eager")
    if family == "bert":
        groups = [[(layer.attention.self.value, layer.attention.output.dense) for layer in stock.encoder.layer]]
    else:
        groups = [[(layer.self_attn.v_proj, layer.self_attn.out_proj) for layer in stock.model.encoder.layers],
                  [(layer.self_attn.v_proj, layer.self_attn.out_proj) for layer in stock.model.decoder.layers]]
    reference = main(hooked_reference(stock, groups, 0.6, 4, **x, **({"use_cache": False} if family == "bart" else {})))
    torch.testing.assert_close(got, reference, rtol=1e-10, atol=1e-10)
    with torch.no_grad():
        assert (main(stock(**x)) - reference).abs().max() > 1e-3
    if family == "bart":  # cached decoding equals recomputation
        model.float()
        dec, cache = x["decoder_input_ids"][:, :2], None
        for _ in range(3):
            with torch.no_grad():
                full = model(input_ids=x["input_ids"], decoder_input_ids=dec, use_cache=False).logits[:, -1]
                out = model(input_ids=x["input_ids"], decoder_input_ids=dec if cache is None else dec[:, -1:],
                            past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            torch.testing.assert_close(out.logits[:, -1], full, rtol=1e-4, atol=1e-5)
            dec = torch.cat([dec, full.argmax(-1, keepdim=True)], 1)


# ================================================================================================ mmseg
BACKBONE = dict(img_size=(32, 32), patch_size=8, embed_dims=48, num_layers=3, num_heads=3, drop_path_rate=0.0,
                final_norm=True, with_cls_token=True, norm_cfg=dict(type="LN", eps=1e-6))
HEAD = dict(in_channels=48, channels=48, num_classes=5, num_layers=2, num_heads=3, embed_dims=48,
            dropout_ratio=0.0, drop_path_rate=0.0, norm_cfg=dict(type="LN"))


def mm_build(type, args, seed=0, **kw):
    pytest.importorskip("mmseg")
    import pid_plugins.mmseg  # noqa: F401  (registers the PID types)
    from mmseg.registry import MODELS

    torch.manual_seed(seed)
    model = MODELS.build(dict(type=type, **args, **kw))
    model.init_weights()
    model.eval()
    return model


def mm_pair(part, seed=0, **method):
    """(NeuTRENO part, stock part) with the stock part's weights."""
    args, pid_type, stock_type = ((BACKBONE, "PIDVisionTransformer", "VisionTransformer") if part == "backbone"
                                  else (HEAD, "PIDSegmenterMaskTransformerHead", "SegmenterMaskTransformerHead"))
    stock = mm_build(stock_type, args, seed)
    model = mm_build(pid_type, args, seed + 1, attention=NAME, **method)
    model.load_state_dict(stock.state_dict(), strict=True)
    return model, stock


def mm_input(part, dtype=torch.float32):
    g = torch.Generator().manual_seed(1)
    if part == "backbone":
        return torch.randn(2, 3, 32, 32, generator=g, dtype=dtype)
    return [torch.randn(2, 48, 4, 4, generator=g, dtype=dtype)]


def mm_out(part, model, x):
    return model(x)[0] if part == "backbone" else model(x)


def naive_mm_layers(layers, h, heads, alpha):
    """mmseg ``TransformerEncoderLayer``s (pre-norm, packed in_proj, FFN) as one NeuTRENO group, by hand."""
    values = []
    for layer in layers:
        mha = layer.attn.attn
        B, N, C = h.shape
        qkv = (layer.norm1(h) @ mha.in_proj_weight.T + mha.in_proj_bias).reshape(B, N, 3, heads, C // heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        values.append(v)
        u = naive_neutreno(torch.softmax(q @ k.transpose(-1, -2) * (C // heads) ** -0.5, -1) @ v, values, alpha)
        h = h + mha.out_proj(u.transpose(1, 2).reshape(B, N, C))
        h = layer.ffn(layer.norm2(h), identity=h)
    return h


@pytest.mark.parametrize("part", ["backbone", "head"])
def test_mmseg_matches_a_float64_reference_and_alpha_zero_is_stock(part):
    model, stock = mm_pair(part, attention_cfg={"alpha": 0.6})
    assert model.pid == NeuTRENOConfig(alpha=0.6) == mm_pair(part)[0].pid  # the segmenter preset
    model, stock = model.double(), stock.double()
    x = mm_input(part, torch.float64)
    with torch.no_grad():
        got = mm_out(part, model, x)
        if part == "backbone":
            h, hw = stock.patch_embed(x)
            h = stock._pos_embeding(torch.cat([stock.cls_token.expand(2, -1, -1), h], 1), hw, stock.pos_embed)
            h = stock.norm1(naive_mm_layers(stock.layers, h, 3, 0.6))
            want = h[:, 1:].reshape(2, 4, 4, 48).permute(0, 3, 1, 2)
        else:
            h = stock.dec_proj(x[0].flatten(2).transpose(1, 2))
            h = torch.cat([h, stock.cls_emb.expand(2, -1, -1)], 1)
            h = stock.decoder_norm(naive_mm_layers(stock.layers, h, 3, 0.6))  # the decoder's own group
            patches = F.normalize(stock.patch_proj(h[:, :-5]), dim=2)
            classes = F.normalize(stock.classes_proj(h[:, -5:]), dim=2)
            want = stock.mask_norm(patches @ classes.transpose(1, 2)).transpose(1, 2).reshape(2, 5, 4, 4)
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
        assert (got - mm_out(part, stock, x)).abs().max() > 1e-3
    zero, stock = mm_pair(part, attention_cfg={"alpha": 0.0})
    with torch.no_grad():
        assert torch.equal(mm_out(part, zero, mm_input(part)), mm_out(part, stock, mm_input(part)))


@pytest.mark.parametrize("part", ["backbone", "head"])
def test_mmseg_with_cp_equals_no_checkpointing(part):
    ref, _ = mm_pair(part)
    ckpt, _ = mm_pair(part)
    for layer in ckpt.layers:
        layer.with_cp = True
    results = []
    for model in (ref, ckpt):
        model.train()
        x = mm_input(part)
        x = x.requires_grad_() if part == "backbone" else [x[0].requires_grad_()]
        y = mm_out(part, model, x)
        (y.square().mean() + y.mean()).backward()
        results.append([y.detach(), (x if part == "backbone" else x[0]).grad] + [p.grad for p in model.parameters()])
    for a, b in zip(*results):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_mmseg_compile_warmup_and_save_reload(tmp_path):
    model, stock = mm_pair("backbone")
    x = mm_input("backbone")
    torch._dynamo.reset()
    try:
        with torch.no_grad():
            compiled = torch.compile(model.forward, fullgraph=True, backend="eager")(x)[0]
            torch.testing.assert_close(compiled, model(x)[0], rtol=1e-6, atol=1e-6)
    finally:
        torch._dynamo.reset()
    # warm-up: mmseg's fused attention plus the method's term, scaled by t / N
    warm, _ = mm_pair("backbone", attention_cfg={"warmup_steps": 2})
    warm.train()
    with torch.no_grad():
        assert torch.equal(warm(x)[0], stock(x)[0])  # t = 0: the stock backbone
        warm(x)
        warm.eval()
        torch.testing.assert_close(warm(x)[0], model(x)[0], rtol=1e-5, atol=1e-6)
    # save / reload through mmengine's checkpoint functions (weights only)
    from mmengine.runner.checkpoint import load_checkpoint, save_checkpoint

    path = tmp_path / "iter_1.pth"
    save_checkpoint({"state_dict": model.state_dict(), "meta": {}}, str(path))
    again, _ = mm_pair("backbone", seed=7)
    load_checkpoint(again, str(path), map_location="cpu", strict=True)
    with torch.no_grad():
        assert torch.equal(again(x)[0], model(x)[0])


# ================================================================================================ fairseq
TINY = ["--decoder-layers", "3", "--decoder-embed-dim", "32", "--decoder-ffn-embed-dim", "64",
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
    import pid_plugins.fairseq as pf
    from fairseq import options, tasks

    args = options.parse_args_and_arch(options.get_training_parser(), [
        str(data_dir), "--task", "language_modeling", "--arch", arch, "--user-dir", pf.USER_DIR, *TINY, *extra])
    task = tasks.setup_task(args)
    torch.manual_seed(seed)
    model = task.build_model(args)
    model.eval()
    return model, task, args


def neutreno_args(alpha=None):
    return ["--attention-method", NAME] + ([] if alpha is None else ["--attention-cfg", json.dumps({"alpha": alpha})])


def fs_tokens(n=2, length=10, seed=1):
    return torch.randint(4, 44, (n, length), generator=torch.Generator().manual_seed(seed))


def fs_logits(model, toks, **kw):
    with torch.no_grad():
        return model(toks, **kw)[0]


def test_fairseq_matches_a_float64_reference_and_alpha_zero_is_stock(data_dir):
    alpha = 0.4
    stock, _, _ = fs_build(data_dir, arch="transformer_lm")
    default, _, _ = fs_build(data_dir, extra=neutreno_args())
    assert default.decoder.layers[0].self_attn.pid == NeuTRENOConfig(alpha=0.4)  # the lm preset
    zero, _, _ = fs_build(data_dir, extra=neutreno_args(0.0), seed=1)
    zero.load_state_dict(stock.state_dict(), strict=True)
    toks = fs_tokens()
    assert torch.equal(fs_logits(zero, toks), fs_logits(stock, toks))
    model, _, _ = fs_build(data_dir, extra=neutreno_args(alpha), seed=1)
    model.load_state_dict(stock.state_dict(), strict=True)
    stock, model = stock.double(), model.double()
    got = fs_logits(model, toks)
    dec = stock.decoder
    B, N = toks.shape
    with torch.no_grad():
        x = dec.embed_scale * dec.embed_tokens(toks)
        if dec.project_in_dim is not None:
            x = dec.project_in_dim(x)
        x = (x + dec.embed_positions(toks)).transpose(0, 1)  # (N, B, C)
        causal = torch.triu(torch.ones(N, N, dtype=torch.bool), 1)
        values = []
        for layer in dec.layers:
            attn = layer.self_attn
            H, D = attn.num_heads, attn.head_dim
            residual = x
            h = layer.self_attn_layer_norm(x) if layer.normalize_before else x
            q, k, v = (p(h).view(N, B, H, D).permute(1, 2, 0, 3) for p in (attn.q_proj, attn.k_proj, attn.v_proj))
            a = torch.softmax(((q @ k.transpose(-1, -2)) / math.sqrt(D)).masked_fill(causal, float("-inf")), -1) @ v
            values.append(v)
            u = naive_neutreno(a, values, alpha)
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
        want = dec.output_layer(x)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    assert (got - fs_logits(stock, toks)).abs().max() > 1e-3


def test_fairseq_incremental_decoding_causality_and_compile(data_dir):
    model, _, _ = fs_build(data_dir, extra=neutreno_args(0.6))
    toks = fs_tokens(length=9)
    full = fs_logits(model, toks)
    state, steps = {}, []
    with torch.no_grad():
        for t in range(1, toks.size(1) + 1):
            steps.append(model(toks[:, :t], incremental_state=state)[0][:, -1])
    torch.testing.assert_close(torch.stack(steps, 1), full, rtol=1e-5, atol=1e-5)
    for j in (3, 6):
        changed = toks.clone()
        changed[:, j] = (changed[:, j] - 4 + 7) % 40 + 4
        other = fs_logits(model, changed)
        torch.testing.assert_close(other[:, :j], full[:, :j], rtol=0, atol=0)
        assert not torch.allclose(other[:, j:], full[:, j:])
    torch._dynamo.reset()
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(model.decoder, fullgraph=True, backend="eager")(toks)[0], full,
                                   rtol=1e-5, atol=1e-5)


def test_fairseq_save_reload_and_checkpointing_refusal(data_dir, tmp_path):
    from fairseq import checkpoint_utils
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from omegaconf import OmegaConf

    with pytest.raises(ValueError, match="--checkpoint-activations is not supported by transformer_lm_pid"):
        fs_build(data_dir, extra=[*neutreno_args(0.4), "--checkpoint-activations"])
    model, task, args = fs_build(data_dir, extra=neutreno_args(0.3))
    path = str(tmp_path / "checkpoint.pt")
    checkpoint_utils.torch_persistent_save({
        "cfg": OmegaConf.to_container(convert_namespace_to_omegaconf(args), resolve=True, enum_to_str=True),
        "args": None, "model": model.state_dict(),
        "optimizer_history": [{"criterion_name": "CrossEntropyCriterion", "optimizer_name": "Adam",
                               "lr_scheduler_state": {}, "num_updates": 0}],
        "extra_state": {"train_iterator": {"epoch": 1}}, "last_optimizer_state": None,
    }, path)
    (loaded,), _ = checkpoint_utils.load_model_ensemble([path], task=task)
    loaded.eval()
    assert loaded.decoder.layers[0].self_attn.pid == NeuTRENOConfig(alpha=0.3)
    toks = fs_tokens()
    assert torch.equal(fs_logits(loaded, toks), fs_logits(model, toks))
