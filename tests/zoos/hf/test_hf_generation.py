"""Every method's cached generation against recomputation, by logits, on the transformers version installed (make test:
the newest we support; make test-compat: the lowest).

The subject is the one a new user meets: a Llama with grouped-query attention (4 layers, 4 query / 2 key-value
heads), greedy ``generate()`` with the dynamic and the static cache, its logits at every step compared with one
uncached forward over the generated sequence. Stock SDPA is the control. transformers 5.24 renamed the forward's
cache keyword (``past_key_values`` -> ``cache``): a method that lost the cache computed other logits silently.
"""
from __future__ import annotations

import pytest
import torch

from method_cases import CAUSAL_METHODS
from zoo_cases import GQA_PROMPT, gqa_llama, import_transformers, without_record

T = import_transformers()

METHODS, PROMPT = CAUSAL_METHODS, GQA_PROMPT


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("name", METHODS)
def test_greedy_generation_logits_equal_recomputation(name, cache):
    model = gqa_llama(name)
    with torch.no_grad():
        out = model.generate(PROMPT, max_new_tokens=10, do_sample=False, cache_implementation=cache,
                             output_logits=True, return_dict_in_generate=True, pad_token_id=0)
        full = model(out.sequences, use_cache=False).logits[:, PROMPT.shape[1] - 1:-1]
    steps = torch.stack(out.logits, 1)
    assert steps.shape == full.shape == (2, 10, 128)
    torch.testing.assert_close(steps, full, rtol=0, atol=1e-4)
    if name != "sdpa":  # the method is on: its logits are not the stock model's
        stock = gqa_llama("sdpa")
        stock.load_state_dict(without_record(model.state_dict()))
        with torch.no_grad():
            assert (stock(out.sequences, use_cache=False).logits - model(out.sequences, use_cache=False).logits
                    ).abs().max() > 1e-3


@pytest.mark.parametrize("name", [n for n in METHODS if n != "sdpa"])
def test_a_static_cache_prefill_reads_no_later_token(name):
    """Prefilled into a static cache (transformers passes no attention mask then), no position changes when a later
    token changes, and the prefill's logits are the uncached forward's."""
    model = gqa_llama(name)
    x = PROMPT[:1]
    y = x.clone()
    y[0, 6] = 20
    with torch.no_grad():
        logits = []
        for ids in (x, y):
            cache = T.StaticCache(config=model.config, max_cache_len=32)
            logits.append(model(ids, past_key_values=cache, use_cache=True).logits)
        uncached = model(x, use_cache=False).logits
    torch.testing.assert_close(logits[0], uncached, rtol=0, atol=1e-5)
    torch.testing.assert_close(logits[1][:, :6], logits[0][:, :6], rtol=0, atol=0)
    assert not torch.allclose(logits[1][:, 6:], logits[0][:, 6:])


@pytest.mark.parametrize("name", METHODS)
def test_a_static_cache_in_chunks_and_after_reset_equals_the_uncached_model(name):
    """A user's ``StaticCache``."""
    model = gqa_llama(name)
    x = PROMPT
    with torch.no_grad():
        want = model(x, use_cache=False).logits
        cache = T.StaticCache(config=model.config, max_cache_len=24)
        runs = []
        for _ in range(2):
            parts = [model(x[:, :5], past_key_values=cache, use_cache=True).logits,
                     model(x[:, 5:8], past_key_values=cache, use_cache=True).logits,
                     model(x[:, 8:], past_key_values=cache, use_cache=True).logits]
            runs.append(torch.cat(parts, 1))
            cache.reset()
    torch.testing.assert_close(runs[0], want, rtol=0, atol=1e-4)
    torch.testing.assert_close(runs[1], runs[0], rtol=0, atol=0)
