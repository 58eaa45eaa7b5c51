"""NeuTRENO (``attention="neutreno"``; github.com/tamnguyen9520/NeuTRENO_NeurIPS2024): layer 1 computes ``A v`` and
records ``v^1``, layers l >= 2 ``A v + alpha (v^1 - v^l)``."""
from functools import partial

import pytest
import torch

import pid_plugins
from pid_plugins import pid_update
from pid_plugins.core import AttentionContext
from pid_plugins.core.siblings.neutreno import NeuTRENOConfig, NeuTRENOMethod
from zoo_cases import bart_config, hf_ids, import_transformers, mm_inputs, naive_neutreno, timm_images
from zoo_cases import mm_pair as zoo_mm_pair
from zoo_cases import timm_pair as zoo_timm_pair

NAME = "neutreno"


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one torch thread (tests/conftest.py)


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
    # float16: the term in float32, the output rounded once
    half = method.update(cfg, a.half(), v2.half(), (v1.half(),), None, -3)[0]
    assert half.dtype == torch.float16
    want = (a.half().float() + 0.4 * (v1.half().float() - v2.half().float())).half()
    assert torch.equal(half, want)
    with pytest.raises(ValueError, match="values of one shape"):
        method.update(cfg, a, v2[..., :2, :], state, None, -3)


@pytest.mark.parametrize("zoo", ["timm", "mmseg"])
def test_warmup_starts_at_the_stock_model_and_reaches_the_method(zoo):
    """t = 0 is the stock model bit for bit, t = N the method (timm's DeiT, mmseg's fused backbone)."""
    pair = partial(zoo_timm_pair, "deit", 0) if zoo == "timm" else partial(zoo_mm_pair, "backbone")
    x, tol = (timm_images("deit"), 1e-6) if zoo == "timm" else (mm_inputs("backbone"), 1e-5)
    full, stock = pair(attention=NAME, attention_cfg={"alpha": 0.6})
    warm, _ = pair(attention=NAME, attention_cfg={"alpha": 0.6, "warmup_steps": 2})
    assert warm.attention_warmup.warmup_steps == 2
    out = (lambda m: m(x)) if zoo == "timm" else (lambda m: m(x)[0])
    warm.train()
    with torch.no_grad():
        assert torch.equal(out(warm), out(stock))  # t = 0
        warm(x)
        warm.eval()
        torch.testing.assert_close(out(warm), out(full), rtol=tol, atol=1e-6)  # t = 2: full alpha


def test_hf_encoder_decoder_matches_a_float64_reference_and_decodes_with_its_cache():
    """BART: the encoder's and the decoder's self-attention stacks are two groups (cross-attention untouched),
    against the stock model (float64, eager) with the term added by hooks on each out_proj's input; alpha = 0 is
    the stock model bit for bit; cached decoding equals recomputation (BERT: the contract's reference)."""
    T = import_transformers()
    import pid_plugins.hf as ph

    cfg = bart_config(96, pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1,
                      forced_eos_token_id=None)
    torch.manual_seed(0)
    stock = T.BartForConditionalGeneration(cfg).eval()
    model = T.BartForConditionalGeneration(cfg).eval()
    model.load_state_dict(stock.state_dict())
    x = dict(input_ids=hf_ids(length=7), decoder_input_ids=hf_ids(length=5, seed=2))
    with torch.no_grad():
        want = stock(**x).logits
        ph.convert(model, NAME, {"alpha": 0.0})
        assert torch.equal(model(**x).logits, want)
        ph.convert(model, NAME, {"alpha": 0.6})
        got = model.double()(**x).logits
    stock.double().set_attn_implementation("eager")
    handles, values = [], {}
    for g, stack in enumerate((stock.model.encoder.layers, stock.model.decoder.layers)):
        for i, layer in enumerate(stack):
            def record(module, args, out, key=(g, i)):
                values[key] = out

            def add_term(module, args, g=g, i=i):
                B, N, C = args[0].shape
                heads = [values[(g, j)].view(B, N, 4, -1).transpose(1, 2) for j in range(i + 1)]
                a = args[0].view(B, N, 4, -1).transpose(1, 2)
                return (naive_neutreno(a, heads, 0.6).transpose(1, 2).reshape(B, N, C),)

            handles += [layer.self_attn.v_proj.register_forward_hook(record),
                        layer.self_attn.out_proj.register_forward_pre_hook(add_term)]
    with torch.no_grad():
        reference = stock(**x, use_cache=False).logits
        for handle in handles:
            handle.remove()
        torch.testing.assert_close(got, reference, rtol=1e-10, atol=1e-10)
        assert (stock(**x).logits - reference).abs().max() > 1e-3
    model.float()  # cached decoding equals recomputation
    dec, cache = x["decoder_input_ids"][:, :2], None
    for _ in range(3):
        with torch.no_grad():
            full = model(input_ids=x["input_ids"], decoder_input_ids=dec, use_cache=False).logits[:, -1]
            out = model(input_ids=x["input_ids"], decoder_input_ids=dec if cache is None else dec[:, -1:],
                        past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        torch.testing.assert_close(out.logits[:, -1], full, rtol=1e-4, atol=1e-5)
        dec = torch.cat([dec, full.argmax(-1, keepdim=True)], 1)
