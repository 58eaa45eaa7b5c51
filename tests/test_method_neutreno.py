"""NeuTRENO (``attention="neutreno"``) in every zoo: the rule against its loop statement, float64 references written
from the official rule (github.com/tamnguyen9520/NeuTRENO_NeurIPS2024: ``DeiT/neutreno.py``,
``segmenter/segm/model/blocks_neutreno.py``, ``wikitext103/src/mem_transformer.py``: layer 1 computes ``A v`` and
records ``v^1``; layers l >= 2 compute ``A v + alpha (v^1 - v^l)``), alpha = 0 equals the stock model bit for bit,
checkpointing, torch.compile, cached decoding, causality, save/reload and warm-up.

The references never call pid_plugins' code: attention written out by hand from the stock modules' weights (or the
stock model with hooks that add the term at its output projection), the term from :func:`naive_neutreno`.
"""
import pytest
import torch

import pid_plugins
from pid_plugins import pid_update
from pid_plugins.core import AttentionContext
from pid_plugins.core.siblings.neutreno import NeuTRENOConfig, NeuTRENOMethod
from zoo_cases import (TIMM, assert_equal_or_both_none, bart_config, bert_config, causal_lm_loss,  # noqa: F401
                       data_dir, fairseq_reference, fs_build, fs_incremental_logits, fs_logits, fs_method,
                       fs_save_and_reload, fs_tokens, hf_checkpointing_grads, hf_ids, import_timm,
                       import_transformers, llama_reference, mm_compiled, mm_inputs, mm_out,
                       mm_with_cp_runs, mmseg_reference, on_outputs, set_fused, timm_images,
                       timm_reference)
from zoo_cases import llama_twins as zoo_llama_twins
from zoo_cases import mm_pair as zoo_mm_pair
from zoo_cases import timm_pair as zoo_timm_pair

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
def neutreno_rule(alpha):
    """The by-hand rule for the zoo references: this layer's ``A v`` plus the term from :func:`naive_neutreno`."""
    return on_outputs(lambda attn_outs, values: naive_neutreno(attn_outs[-1], values, alpha))


def timm_pair(kind, alpha=0.6, seed=0, **method):
    """(NeuTRENO model, stock model) with the same weights; ``method``: more NeuTRENO parameters."""
    return zoo_timm_pair(kind, seed, attention=NAME, attention_cfg={"alpha": alpha, **method})


@pytest.mark.parametrize("kind", sorted(TIMM))
def test_timm_matches_a_float64_reference(kind):
    model, stock = timm_pair(kind, alpha=0.6)
    assert model.attention_config == NeuTRENOConfig(alpha=0.6) and model.attention_method.name == NAME
    model, stock = model.double(), stock.double()
    x = timm_images(kind).double()
    with torch.no_grad():
        want = timm_reference(kind, stock, x, neutreno_rule(0.6))
        torch.testing.assert_close(model(x), want, rtol=1e-10, atol=1e-10)
        assert (stock(x) - want).abs().max() > 1e-3


@pytest.mark.parametrize("kind", sorted(TIMM))
def test_timm_alpha_zero_is_the_stock_model_bit_for_bit(kind):
    model, stock = timm_pair(kind, alpha=0.0)
    x = timm_images(kind)
    for fused in (True, False):
        set_fused((model, stock), fused)
        with torch.no_grad():
            assert torch.equal(model(x), stock(x))


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(TIMM))
def test_timm_checkpointing_compile_and_save_reload(kind, tmp_path):
    timm = import_timm()
    name, _, cfg = TIMM[kind]
    ref, _ = timm_pair(kind)
    x = timm_images(kind)
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
    x = timm_images("deit")
    assert model.attention_warmup is not None and model.attention_warmup.warmup_steps == 2
    model.train()
    with torch.no_grad():
        assert torch.equal(model(x), stock(x))  # t = 0
        model(x)
        model.eval()
        torch.testing.assert_close(model(x), full(x), rtol=1e-6, atol=1e-6)  # t = 2: full alpha


# ================================================================================================ transformers
V = 96


def llama_twins(alpha=0.4, layers=3):
    return zoo_llama_twins(NAME, {"alpha": alpha}, layers=layers, vocab=V)


def token_ids(n=2, length=8, seed=1):
    return hf_ids(n, length, seed, vocab=V)


def test_hf_llama_matches_a_float64_reference():
    """Llama (grouped-query, rotary, causal) by hand: each query head reads its key/value head's v^1 - v^l."""
    model, stock = llama_twins(alpha=0.4)
    from pid_plugins.hf import model_method_config

    assert model_method_config(model.config) == NeuTRENOConfig(alpha=0.4)
    model.double()
    stock.double()
    x = token_ids()
    with torch.no_grad():
        got = model(x).logits
        want = llama_reference(stock, x, neutreno_rule(0.4))
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    assert (got - stock(x).logits).abs().max() > 1e-3


@pytest.mark.slow
def test_hf_llama_alpha_zero_checkpointing_and_compile():
    zero, stock = llama_twins(alpha=0.0)
    x = token_ids()
    with torch.no_grad():
        assert torch.equal(zero(x).logits, stock(x).logits)
    model, _ = llama_twins()
    model.train()
    hf_checkpointing_grads(model, causal_lm_loss(x))
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
    T = import_transformers()
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
    T = import_transformers()
    import pid_plugins.hf as ph

    if family == "bert":
        cfg, cls = bert_config(V), T.BertModel
    else:
        cfg = bart_config(V, pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1,
                          forced_eos_token_id=None)
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
def mm_pair(part, seed=0, **method):
    """(NeuTRENO part, stock part) with the stock part's weights."""
    return zoo_mm_pair(part, seed=seed, attention=NAME, **method)


@pytest.mark.parametrize("part", ["backbone", "head"])
def test_mmseg_matches_a_float64_reference_and_alpha_zero_is_stock(part):
    model, stock = mm_pair(part, attention_cfg={"alpha": 0.6})
    # the segmenter preset
    assert model.attention_config == NeuTRENOConfig(alpha=0.6) == mm_pair(part)[0].attention_config
    model, stock = model.double(), stock.double()
    x = mm_inputs(part, torch.float64)
    with torch.no_grad():
        got = mm_out(part, model, x)
        want = mmseg_reference(part, stock, x, neutreno_rule(0.6))
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
        assert (got - mm_out(part, stock, x)).abs().max() > 1e-3
    zero, stock = mm_pair(part, attention_cfg={"alpha": 0.0})
    with torch.no_grad():
        assert torch.equal(mm_out(part, zero, mm_inputs(part)), mm_out(part, stock, mm_inputs(part)))


@pytest.mark.parametrize("part", ["backbone", "head"])
def test_mmseg_with_cp_equals_no_checkpointing(part):
    _, results = mm_with_cp_runs(part, lambda: mm_pair(part)[0])
    assert_equal_or_both_none(*results)


@pytest.mark.slow
def test_mmseg_compile_warmup_and_save_reload(tmp_path):
    model, stock = mm_pair("backbone")
    x = mm_inputs("backbone")
    compiled = mm_compiled(model, x, "eager")
    with torch.no_grad():
        torch.testing.assert_close(compiled, model(x)[0], rtol=1e-6, atol=1e-6)
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
def neutreno_args(alpha=None):
    return fs_method(NAME, None if alpha is None else {"alpha": alpha})


def test_fairseq_matches_a_float64_reference_and_alpha_zero_is_stock(data_dir):
    alpha = 0.4
    stock, _, _ = fs_build(data_dir, arch="transformer_lm")
    default, _, _ = fs_build(data_dir, extra=neutreno_args())
    assert default.decoder.layers[0].self_attn.attention_config == NeuTRENOConfig(alpha=0.4)  # the lm preset
    zero, _, _ = fs_build(data_dir, extra=neutreno_args(0.0), seed=1)
    zero.load_state_dict(stock.state_dict(), strict=True)
    toks = fs_tokens()
    assert torch.equal(fs_logits(zero, toks), fs_logits(stock, toks))
    model, _, _ = fs_build(data_dir, extra=neutreno_args(alpha), seed=1)
    model.load_state_dict(stock.state_dict(), strict=True)
    stock, model = stock.double(), model.double()
    got = fs_logits(model, toks)
    with torch.no_grad():
        want = fairseq_reference(stock, toks, neutreno_rule(alpha))
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    assert (got - fs_logits(stock, toks)).abs().max() > 1e-3


@pytest.mark.slow
def test_fairseq_incremental_decoding_causality_and_compile(data_dir):
    model, _, _ = fs_build(data_dir, extra=neutreno_args(0.6))
    toks = fs_tokens(length=9)
    full = fs_logits(model, toks)
    torch.testing.assert_close(fs_incremental_logits(model, toks), full, rtol=1e-5, atol=1e-5)
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


@pytest.mark.slow
def test_fairseq_save_reload_and_checkpointing_refusal(data_dir, tmp_path):
    with pytest.raises(ValueError, match="--checkpoint-activations is not supported by transformer_lm_pid"):
        fs_build(data_dir, extra=[*neutreno_args(0.4), "--checkpoint-activations"])
    model, task, args = fs_build(data_dir, extra=neutreno_args(0.3))
    loaded = fs_save_and_reload(model, task, args, str(tmp_path / "checkpoint.pt"))
    assert loaded.decoder.layers[0].self_attn.attention_config == NeuTRENOConfig(alpha=0.3)
    toks = fs_tokens()
    assert torch.equal(fs_logits(loaded, toks), fs_logits(model, toks))
