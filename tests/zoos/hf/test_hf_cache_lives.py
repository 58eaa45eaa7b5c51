"""The KV cache's other lives (issue 43, "Why" 7)."""
from __future__ import annotations

import copy
import pickle

import pytest
import torch

from method_cases import BUILTIN, CAUSAL_METHODS
from zoo_cases import GQA_PROMPT, gqa_llama, import_transformers

T = import_transformers()
from pid_plugins.hf.cache import SlotLayer  # noqa: E402

METHODS, PROMPT = CAUSAL_METHODS, GQA_PROMPT
P = PROMPT.shape[1]
SLOT = [name for name, method in BUILTIN.items() if name in METHODS and method.impl.cache_slot]


def uncached(model, ids):
    with torch.no_grad():
        return model(ids, use_cache=False).logits


def close(got, want):
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


@pytest.mark.parametrize("name", METHODS)
def test_early_exit_assisted_decoding_equals_recomputation_and_restores_the_layer_count(name, monkeypatch):
    """``assistant_early_exit=2``."""
    from transformers.generation import candidate_generator

    model = gqa_llama(name)
    drafts = []
    original = candidate_generator.EarlyExitCandidateGenerator.get_candidates

    def recorded(self, input_ids, **kwargs):
        drafts.append(original(self, input_ids, **kwargs))
        return drafts[-1]

    monkeypatch.setattr(candidate_generator.EarlyExitCandidateGenerator, "get_candidates", recorded)
    for _ in range(2):
        with torch.no_grad():
            out = model.generate(PROMPT[:1], max_new_tokens=10, do_sample=False, assistant_early_exit=2,
                                 output_logits=True, return_dict_in_generate=True, pad_token_id=0)
        assert model.config.num_hidden_layers == 4
        close(torch.stack(out.logits, 1), uncached(model, out.sequences)[:, P - 1:-1])
    model.config.num_hidden_layers = 2
    try:
        drafted = [(ids, logits) for ids, logits in drafts if logits is not None]
        assert len(drafted) >= 4
        for ids, logits in drafted:
            close(logits, uncached(model, ids)[:, -logits.shape[1] - 1:-1])
    finally:
        model.config.num_hidden_layers = 4


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("name", METHODS)
def test_beam_search_logits_equal_recomputation(name, cache):
    """Beam search reorders the cache every step (``reorder_cache``)."""
    model = gqa_llama(name)
    with torch.no_grad():
        out = model.generate(PROMPT, max_new_tokens=6, do_sample=False, num_beams=3, num_return_sequences=2,
                             cache_implementation=cache, output_logits=True, return_dict_in_generate=True,
                             pad_token_id=0)
    full = uncached(model, out.sequences)
    rows = []
    for i in range(out.sequences.shape[0]):
        for t in range(out.sequences.shape[1] - P):
            beam = int(out.beam_indices[i, t])
            if beam >= 0:
                rows.append((out.logits[t][beam], full[i, P - 1 + t]))
    assert len(rows) == out.sequences.shape[0] * 6
    assert len({int(b) for b in out.beam_indices[:, 1:].flatten()}) > 2  # the beams were reordered
    close(torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows]))


@pytest.mark.parametrize("name", METHODS)
def test_prompt_lookup_decoding_crops_in_step(name):
    """Prompt lookup drafts from the prompt and crops the rejected positions from the cache (``crop``)."""
    model = gqa_llama(name)
    prompt = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6]])
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=10, do_sample=False, prompt_lookup_num_tokens=3,
                             output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    close(torch.stack(out.logits, 1), uncached(model, out.sequences)[:, prompt.shape[1] - 1:-1])


@pytest.mark.parametrize("name", METHODS)
def test_a_plain_forward_returns_a_cache_decoding_continues_from(name):
    """``model(prompt)`` without ``use_cache=`` (transformers' default: on) returns a cache; two more steps from it
    equal the uncached model on the longer sequence."""
    model = gqa_llama(name)
    with torch.no_grad():
        out = model(PROMPT)
        assert len(out.past_key_values) == 4
        step1 = model(torch.tensor([[7], [8]]), past_key_values=out.past_key_values)
        step2 = model(torch.tensor([[9], [10]]), past_key_values=step1.past_key_values)
    full = uncached(model, torch.cat([PROMPT, torch.tensor([[7, 9], [8, 10]])], 1))
    close(torch.cat([out.logits, step1.logits, step2.logits], 1), full)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("name", SLOT)
def test_a_cache_slot_method_keeps_one_cache_layer_per_model_layer(name, cache):
    """``len(cache)`` is the model's layer count (transformers documents it so) and iteration yields one
    (keys, values, window) per layer; the method's tensor (Twicing's A v) lives inside each layer, as a subclass of
    the layer's own kind."""
    model = gqa_llama(name)
    made = T.DynamicCache(config=model.config) if cache == "dynamic" else T.StaticCache(config=model.config,
                                                                                         max_cache_len=24)
    kinds = [type(layer) for layer in made.layers]
    with torch.no_grad():
        model(PROMPT, past_key_values=made, use_cache=True)
    assert len(made) == 4 and len(made.layers) == 4
    assert all(isinstance(layer, SlotLayer) and isinstance(layer, kind) for layer, kind in zip(made.layers, kinds))
    if cache == "dynamic":
        items = list(made)
        assert len(items) == 4 and all(k.shape == (2, 2, P, 16) for k, _, _ in items)


@pytest.mark.parametrize("name", METHODS)
def test_a_cache_rebuilt_from_its_tensors(name):
    """``DynamicCache(ddp_cache_data=list(cache))`` (what DDP-style gathers and cache libraries do) keeps the keys
    and values only: exact for the methods that keep nothing else; Twicing (A v per cached position) is refused,
    naming the mode."""
    model = gqa_llama(name)
    step = torch.tensor([[7], [8]])
    with torch.no_grad():
        cache = model(PROMPT, past_key_values=T.DynamicCache(config=model.config), use_cache=True).past_key_values
        rebuilt = T.DynamicCache(ddp_cache_data=list(cache))
        assert len(rebuilt) == 4
        if name in SLOT:
            with pytest.raises(ValueError, match=rf"'{name}'.*layer 0 of this cache holds 9 cached positions and the "
                                                 r"method's tensor of 0.*DynamicCache\(ddp_cache_data=\.\.\.\)"):
                model(step, past_key_values=rebuilt)
            return
        got = model(step, past_key_values=rebuilt).logits
    close(got, uncached(model, torch.cat([PROMPT, step], 1))[:, -1:])


@pytest.mark.parametrize("name", ["sdpa", *SLOT])  # the methods with a tensor in the cache; stock SDPA: the control
def test_crop_select_repeat_reset_copy_and_pickle_keep_the_method_tensor_in_step(name):
    """The cache operations transformers' generation modes use, called directly, then one decoding step each."""
    model = gqa_llama(name)
    ids = torch.cat([PROMPT, torch.tensor([[7, 9], [8, 10]])], 1)
    full = uncached(model, ids)
    step = ids[:, P:P + 1]
    with torch.no_grad():
        cache = model(ids, past_key_values=T.DynamicCache(config=model.config), use_cache=True).past_key_values
        cache.crop(-2)  # back to the prompt
        close(model(step, past_key_values=copy.deepcopy(cache)).logits, full[:, P:P + 1])
        close(model(step, past_key_values=pickle.loads(pickle.dumps(cache))).logits, full[:, P:P + 1])
        picked = copy.deepcopy(cache)
        picked.batch_select_indices(torch.tensor([1]))
        close(model(step[1:], past_key_values=picked).logits, full[1:, P:P + 1])
        cache.batch_repeat_interleave(2)
        close(model(step.repeat_interleave(2, 0), past_key_values=cache).logits, full[:, P:P + 1].repeat_interleave(2, 0))
        static = T.StaticCache(config=model.config, max_cache_len=24)
        model(PROMPT.flip(1), past_key_values=static, use_cache=True)
        static.reset()  # a static cache reused for another prompt
        close(model(ids[:, :P], past_key_values=static, use_cache=True).logits, full[:, :P])
        close(model(step, past_key_values=static, use_cache=True).logits, full[:, P:P + 1])
