"""The language-model methods in transformers (issue 31): Twicing with grouped-query attention and the KV cache,
Elliptical's causal prefix mean, value residual (ResFormer), and the families that cannot run a method.

The subject is a causal Llama with 4 query heads and 2 key/value heads. Each method is checked against a float64
statement written here from the official rule (no pid_plugins method code), its cached decoding (dynamic, static,
beam search) against recomputation, causality, compile, checkpointing and save/reload.
"""
from __future__ import annotations

import pytest
import torch
import torch._dynamo

from zoo_cases import elliptical_prefix_rule, hf_grads, hf_ids, import_transformers, llama_config, llama_reference, \
    llama_twins, scores64, value_residual_rule

T = import_transformers()
import pid_plugins.hf as ph  # noqa: E402

V = 96


# =========================================================================== the rules, from the official code
def twicing_rule(qs, ks, vs, mask):
    """``A v + A (v - A v)`` per query head (values repeated for the query heads, as GQA repeats them)."""
    a = torch.softmax(scores64(qs[-1], ks[-1], mask), -1)
    v = vs[-1].double().repeat_interleave(qs[-1].shape[1] // vs[-1].shape[1], 1)
    av = a @ v
    return av + a @ (v - av)


METHODS = {  # name: (parameters, rule)
    "twicing": ({"from_layer": 0}, twicing_rule),
    "elliptical": ({"mean": "prefix"}, elliptical_prefix_rule(5.0)),
    "value_residual": (None, value_residual_rule([(0.5, 0.5)] * 3)),
}


def twins(name, **kw):
    return llama_twins(name, METHODS[name][0], **kw)


def greedy(model, x, **kw):
    with torch.no_grad():
        return model.generate(x, max_new_tokens=5, do_sample=False, pad_token_id=0, **kw)


# ======================================================================================== the rule, generation
@pytest.mark.parametrize("name", METHODS)
def test_grouped_query_llama_matches_the_float64_rule(name):
    model, stock = twins(name)
    assert model.config.num_key_value_heads == 2 and model.config.num_attention_heads == 4
    x = hf_ids(2, 8)
    with torch.no_grad():
        got = model(x).logits
        want = llama_reference(stock.double(), x, METHODS[name][1])
        # the method changes the model by more than the reference's tolerance
        assert not torch.allclose(got, stock.float()(x).logits, rtol=0, atol=5e-5)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", METHODS)
def test_cached_generation_equals_recomputation(name):
    """Greedy with the dynamic and the static cache, beam search (the cache reordered), and decoding by hand with
    a cache the model made itself: all equal recomputing the prefix at every step."""
    model, _ = twins(name)
    x = hf_ids(2, 8)
    want = greedy(model, x, use_cache=False)
    assert torch.equal(greedy(model, x), want)
    assert torch.equal(greedy(model, x, cache_implementation="static"), want)
    beams = dict(num_beams=3, num_return_sequences=3)
    assert torch.equal(greedy(model, x, **beams), greedy(model, x, use_cache=False, **beams))
    with torch.no_grad():
        full = model(x).logits
        first = model(x[:, :5], use_cache=True)
        rest = model(x[:, 5:], past_key_values=first.past_key_values).logits
    torch.testing.assert_close(torch.cat([first.logits, rest], 1), full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", METHODS)
def test_no_position_reads_a_later_token(name):
    model, _ = twins(name)
    x = hf_ids(2, 8)
    with torch.no_grad():
        full = model(x).logits
        for j in (2, 5):
            y = x.clone()
            y[:, j] = (y[:, j] + 1 - 3) % (V - 3) + 3
            other = model(y).logits
            torch.testing.assert_close(other[:, :j], full[:, :j], rtol=0, atol=0)
            assert not torch.allclose(other[:, j:], full[:, j:])


@pytest.mark.parametrize("name", METHODS)
def test_left_padding_counts_no_padded_position(name):
    """A left-padded row (positions given by the mask) equals the row alone, and its cached generation equals
    recomputation: the prefix mean, the first layer's values and A v never read a padded position."""
    model, _ = twins(name)
    x = hf_ids(2, 8)
    padded, mask = x.clone(), torch.ones_like(x)
    padded[1, :3], mask[1, :3] = 0, 0
    positions = (mask.cumsum(1) - 1).clamp_min(0)
    with torch.no_grad():
        got = model(padded, attention_mask=mask, position_ids=positions).logits[1, 3:]
        alone = model(x[1:, 3:]).logits[0]
    torch.testing.assert_close(got, alone, rtol=1e-5, atol=1e-5)
    assert torch.equal(greedy(model, padded, attention_mask=mask),
                       greedy(model, padded, attention_mask=mask, use_cache=False))


@pytest.mark.parametrize("name", METHODS)
def test_sliding_window_cache_equals_recomputation(name):
    """Mistral with a 4-token window over 8 + 6 tokens: the dynamic sliding-window cache drops old keys (and the
    method's slot with them, in step)."""
    cfg = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, sliding_window=4,
               attn_implementation=name)
    if METHODS[name][0] is not None:
        cfg[name] = METHODS[name][0]
    torch.manual_seed(0)
    model = T.MistralForCausalLM(T.MistralConfig(**cfg)).eval()
    x = hf_ids(2, 8)
    assert torch.equal(greedy(model, x), greedy(model, x, use_cache=False))


DECODERS = {
    "qwen2": lambda **kw: T.Qwen2ForCausalLM(T.Qwen2Config(**kw)),
    "qwen3": lambda **kw: T.Qwen3ForCausalLM(T.Qwen3Config(**kw, head_dim=8)),
    "gemma": lambda **kw: T.GemmaForCausalLM(T.GemmaConfig(**kw, head_dim=8)),
    "gemma2": lambda **kw: T.Gemma2ForCausalLM(T.Gemma2Config(**kw, head_dim=8, sliding_window=4)),
    "phi3": lambda **kw: T.Phi3ForCausalLM(T.Phi3Config(**kw)),
    "starcoder2": lambda **kw: T.Starcoder2ForCausalLM(T.Starcoder2Config(**kw)),
    "olmo2": lambda **kw: T.Olmo2ForCausalLM(T.Olmo2Config(**kw)),
    "granite": lambda **kw: T.GraniteForCausalLM(T.GraniteConfig(**kw)),
}


@pytest.mark.parametrize("family", DECODERS)
def test_twicing_runs_grouped_query_families_with_the_cache(family):
    """Families with grouped-query attention run Twicing (no refusal) and decode with the cache as they recompute."""
    torch.manual_seed(0)
    model = DECODERS[family](vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0,
                             attn_implementation="twicing").eval()
    x = hf_ids(2, 6)
    assert torch.equal(greedy(model, x), greedy(model, x, use_cache=False))


# ========================================================================================= off switch, refusals
def test_value_residual_off_is_the_stock_model_bit_for_bit():
    model, stock = llama_twins("value_residual", {"lambda_1": 0.0, "lambda_2": 1.0})
    x = hf_ids(2, 8)
    with torch.no_grad():
        assert torch.equal(model(x).logits, stock(x).logits)
        assert torch.equal(greedy(model, x), greedy(stock, x))


def test_elliptical_sequence_mean_is_refused_in_a_causal_model_naming_prefix():
    model, _ = llama_twins("elliptical", {"mean": "sequence"})
    with torch.no_grad(), pytest.raises(ValueError, match="'elliptical' with mean='sequence' is not causal.*mean='prefix'"):
        model(hf_ids(1, 4))


def test_twicing_refuses_attention_dropout_in_training_only():
    model, _ = llama_twins("twicing", {"from_layer": 0}, attention_dropout=0.1)
    x = hf_ids(1, 4)
    with torch.no_grad():
        model(x)  # eval: no dropout drawn
    with pytest.raises(ValueError, match="'twicing'.*set the attention dropout to 0"):
        model.train()(x)


@pytest.mark.parametrize("method", ["pid", "neutreno", "twicing", "elliptical", "value_residual"])
@pytest.mark.parametrize("family", ["gpt_neo", "falcon"])
def test_families_with_their_own_attention_tables_are_refused_while_built(family, method):
    """GPT-Neo and Falcon pick their attention classes from their own tables (transformers 5.23 and 5.24; GPT-J did
    until 5.23): refused before any layer exists, with a message that names attn_implementation, the method, the
    family and why (never a bare KeyError)."""
    config = {"gpt_neo": lambda: T.GPTNeoConfig(vocab_size=V, hidden_size=32, num_layers=2, num_heads=4,
                                                attention_types=[[["global", "local"], 1]], window_size=4),
              "falcon": lambda: T.FalconConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2,
                                               num_attention_heads=4)}[family]()
    model_cls = {"gpt_neo": T.GPTNeoForCausalLM, "falcon": T.FalconForCausalLM}[family]
    config._attn_implementation = method
    with pytest.raises(ValueError, match=rf"attn_implementation='{method}'.*\({family}\).*own table .*_ATTENTION_CLASSES"
                                         rf".*attention method '{method}' cannot reach"):
        model_cls(config)
    with pytest.raises(ValueError, match=rf"attn_implementation='{method}'.*{family}"):
        T.AutoModelForCausalLM.from_config(config, attn_implementation=method)


# ============================================================================== compile, checkpointing, reload
@pytest.mark.slow
@pytest.mark.parametrize("name", METHODS)
def test_static_cache_decoding_compiles_fullgraph_without_recompiles(name):
    torch._dynamo.reset()
    model, _ = twins(name, layers=2)
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    prompt = hf_ids(2, 5)

    def decode(step, steps=4):
        cache = T.StaticCache(config=model.config, max_cache_len=16)
        logits = []
        with torch.no_grad():
            out = step(input_ids=prompt, past_key_values=cache, use_cache=True).logits
            logits.append(out)
            for i in range(steps):
                with torch._dynamo.config.patch(error_on_recompile=i >= 1):  # prefill and step 1 compile once each
                    out = step(input_ids=out[:, -1:].argmax(-1), past_key_values=cache, use_cache=True).logits
                logits.append(out)
        return torch.cat(logits, dim=1)

    try:
        torch.testing.assert_close(decode(compiled), decode(model), rtol=1e-5, atol=1e-5)
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("use_cache", [False, True])
@pytest.mark.parametrize("name", METHODS)
def test_gradient_checkpointing_gives_the_same_gradients(name, use_cache):
    """Also with ``use_cache=True`` in training: transformers' checkpointed layers drop the cache, and the method's
    cache slot follows them (a slot filled by the recomputation too would hold every position twice)."""
    x = hf_ids(2, 8)
    results = []
    for checkpointing in (False, True):
        model, _ = twins(name)
        model.train()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        results.append(hf_grads(model, lambda m: (lambda out: (out.logits, out.loss))(m(x, labels=x,
                                                                                      use_cache=use_cache))))
    (logits0, grads0), (logits1, grads1) = results
    torch.testing.assert_close(logits1, logits0, rtol=0, atol=0)
    assert grads0.keys() == grads1.keys() and len(grads0) > 0
    for key in grads0:
        torch.testing.assert_close(grads1[key], grads0[key], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name", METHODS)
def test_save_and_reload_keeps_the_method_and_its_parameters(name, tmp_path):
    params = {"twicing": {"from_layer": 1}, "elliptical": {"mean": "prefix", "delta": 2.0},
              "value_residual": {"lambda_1": 0.3, "lambda_2": 0.9}}[name]
    torch.manual_seed(0)
    model = T.LlamaForCausalLM(llama_config(name, params)).eval()
    x = hf_ids(2, 6)
    with torch.no_grad():
        want = model(x).logits
    model.save_pretrained(tmp_path)
    loaded = T.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.config._attn_implementation == name
    assert ph.model_method_config(loaded.config).to_dict() == {**ph.model_method_config(model.config).to_dict()}
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, want)


@pytest.mark.parametrize("name", ["elliptical", "value_residual"])
def test_a_cache_mixing_sliding_and_full_layers_is_refused_for_methods_reading_all_key_positions(name):
    """Gemma 3 (a sliding-window layer, then a full one): the first layer's / previous layer's values at every key
    position are not in its cache; refused before the forward, naming the method. Without a cache it runs."""
    cfg = T.Gemma3TextConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0,
                             head_dim=8, sliding_window=4, layer_types=["sliding_attention", "full_attention"],
                             attn_implementation=name)
    setattr(cfg, name, METHODS[name][0])
    model = T.Gemma3ForCausalLM(cfg).eval()
    x = hf_ids(2, 8)
    with torch.no_grad():
        model(x, use_cache=False)
        with pytest.raises(ValueError, match=rf"'{name}' reads earlier layers' values.*mixes sliding-window"):
            model.generate(x, max_new_tokens=2, do_sample=False)
