"""The language-model methods in transformers beyond the contract's hf-llama rows (tests/core/test_method_contract.py:
the float64 rule, cached and beam generation, causality, left padding, switched off, checkpointing, save/reload): the
sliding-window cache (Mistral), Twicing in other grouped-query families, static-cache decoding compiled without
recompiles, and the refusals (Twicing's attention dropout, families with their own attention tables, Gemma 3's mixed
cache)."""
from __future__ import annotations

import pytest
import torch
import torch._dynamo

from method_cases import BUILTIN, variants
from zoo_cases import hf_greedy as greedy, hf_ids, import_transformers, llama_twins

T = import_transformers()

V = 96
#: every built-in method with its parameters on the grouped-query Llama (tests/method_cases.py)
METHOD_CFG = {key: cfg for key, (_, cfg) in variants("hf-llama", learnable=False).items()}


def twins(name, **kw):
    return llama_twins(name, METHOD_CFG[name], **kw)


@pytest.mark.parametrize("name", METHOD_CFG)
def test_sliding_window_cache_equals_recomputation(name):
    """Mistral with a 4-token window over 8 + 6 tokens: the dynamic sliding-window cache drops old keys (and the
    method's slot with them, in step)."""
    cfg = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, sliding_window=4,
               attn_implementation=name)
    if METHOD_CFG[name] is not None:
        cfg[name] = METHOD_CFG[name]
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


def test_twicing_refuses_attention_dropout_in_training_only():
    model, _ = llama_twins("twicing", {"from_layer": 0}, attention_dropout=0.1)
    x = hf_ids(1, 4)
    with torch.no_grad():
        model(x)  # eval: no dropout drawn
    with pytest.raises(ValueError, match="'twicing'.*set the attention dropout to 0"):
        model.train()(x)


@pytest.mark.parametrize("method", BUILTIN)
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


@pytest.mark.slow
@pytest.mark.parametrize("name", [name for name in METHOD_CFG if BUILTIN[name].static_compile])
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


@pytest.mark.parametrize("name", [name for name, method in BUILTIN.items() if method.impl.keys_state])
def test_a_cache_mixing_sliding_and_full_layers_is_refused_for_methods_reading_all_key_positions(name):
    """Gemma 3 (a sliding-window layer, then a full one): the first layer's / previous layer's values at every key
    position are not in its cache; refused before the forward, naming the method. Without a cache it runs."""
    cfg = T.Gemma3TextConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0,
                             head_dim=8, sliding_window=4, layer_types=["sliding_attention", "full_attention"],
                             attn_implementation=name)
    setattr(cfg, name, METHOD_CFG[name])
    model = T.Gemma3ForCausalLM(cfg).eval()
    x = hf_ids(2, 8)
    with torch.no_grad():
        model(x, use_cache=False)
        with pytest.raises(ValueError, match=rf"'{name}' reads earlier layers' values.*mixes sliding-window"):
            model.generate(x, max_new_tokens=2, do_sample=False)
