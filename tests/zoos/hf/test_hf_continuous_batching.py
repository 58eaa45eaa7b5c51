"""Continuous batching (issue 43, "What to build" 7)."""
from __future__ import annotations

import pytest
import torch

from zoo_cases import import_transformers, llama_config

T = import_transformers()
import pid_plugins.hf  # noqa: E402,F401

MESSAGE = (r"attention method '{}' cannot run under continuous batching \(generate_batch, init_continuous_batching, "
           r"continuous_batching_context_manager, generate\(cache_implementation='paged'\)\)")


@pytest.mark.parametrize("name", ["pid", "twicing"])
def test_every_entry_point_is_refused_before_the_attention_is_switched(name, monkeypatch):
    from transformers.generation.continuous_batching import continuous_api

    monkeypatch.setattr(continuous_api, "is_flash_attn_2_available", lambda *a, **k: True)
    torch.manual_seed(0)
    model = T.LlamaForCausalLM(llama_config(name)).eval()
    switched = []
    monkeypatch.setattr(model, "set_attn_implementation", switched.append)
    config = T.GenerationConfig(max_new_tokens=3, do_sample=False, eos_token_id=1)
    entries = {
        "generate_batch": lambda: model.generate_batch([[5, 6, 7]], generation_config=config, warmup=False),
        "init_continuous_batching": lambda: model.init_continuous_batching(generation_config=config),
        "continuous_batching_context_manager": lambda: model.continuous_batching_context_manager(
            generation_config=config, warmup=False).__enter__(),
        "generate(cache_implementation='paged')": lambda: model.generate(
            torch.tensor([[5, 6, 7]]), max_new_tokens=3, do_sample=False, cache_implementation="paged"),
    }
    for entry, call in entries.items():
        with pytest.raises(ValueError, match=MESSAGE.format(name)):
            call()
        assert switched == [] and model.config._attn_implementation == name, entry


def test_a_stock_model_still_reaches_continuous_batching():
    torch.manual_seed(0)
    model = T.LlamaForCausalLM(llama_config("sdpa")).eval()
    manager = model.init_continuous_batching(generation_config=T.GenerationConfig(max_new_tokens=3, eos_token_id=1))
    assert type(manager).__name__ == "ContinuousBatchingManager"
