"""The transformers adapter's per-forward path (pid_plugins/hf/forward.py)."""
from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl, apply_activation_checkpointing, checkpoint_wrapper,
)

from zoo_cases import hf_ids, import_transformers, llama_config

T = import_transformers()
from transformers.models.llama.modeling_llama import LlamaDecoderLayer  # noqa: E402

import pid_plugins.hf  # noqa: E402,F401
from pid_plugins.hf import discovery  # noqa: E402

X = hf_ids(2, 8)
REENTRANT = r"needs non-reentrant gradient checkpointing"
WRAPPER = r"needs non-reentrant activation checkpointing, but LlamaModel\.layers\.0 is wrapped"
CACHE = r"activation checkpointing \(torch's (checkpoint_wrapper|checkpoint) at LlamaModel\.layers\.0\) recomputes"


def llama():
    torch.manual_seed(0)
    return T.LlamaForCausalLM(llama_config("pid", tie_word_embeddings=False)).train()


def step(model, **kwargs):
    model.zero_grad()
    out = model(X, labels=X, **kwargs)
    out.loss.backward()
    return out.logits.detach()


@pytest.fixture
def discoveries(monkeypatch):
    """The models discovered (by class name) while the test runs."""
    runs = []
    original = discovery.discover
    monkeypatch.setattr(discovery, "discover", lambda m, *a, **kw: runs.append(type(m).__name__) or
                        original(m, *a, **kw))
    return runs


def test_forwards_read_the_plan_without_walking_the_modules(monkeypatch, discoveries):
    model = llama()
    discoveries.clear()  # (those of the construction)
    step(model, use_cache=False)  # the first forward uses the plan made at construction, too
    walks = []
    for name in ("modules", "named_modules"):
        original = getattr(torch.nn.Module, name)
        monkeypatch.setattr(torch.nn.Module, name, functools.partialmethod(
            lambda self, *a, _original=original, **kw: walks.append(type(self).__name__) or _original(self, *a, **kw)))
    for _ in range(3):
        model(X, labels=X, use_cache=False)
    assert walks == [] and discoveries == []


def test_checkpointing_turned_on_after_the_first_forward_is_read_before_the_next(discoveries):
    model = llama()
    want = step(model, use_cache=False)
    discoveries.clear()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    with pytest.raises(ValueError, match=REENTRANT):
        model(X, labels=X, use_cache=False)
    model.gradient_checkpointing_disable()
    torch.testing.assert_close(step(model, use_cache=False), want, rtol=0, atol=0)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    torch.testing.assert_close(step(model, use_cache=False), want, rtol=0, atol=0)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    with pytest.raises(ValueError, match=REENTRANT):
        model(X, labels=X, use_cache=False)
    model.gradient_checkpointing_enable()  # transformers' default: non-reentrant
    torch.testing.assert_close(step(model, use_cache=False), want, rtol=0, atol=0)
    assert discoveries == []  # the plan re-read the layers' flags; their numbers stand


@pytest.mark.parametrize("how", ["deepcopy", "torch.save"])
def test_checkpointing_turned_on_in_a_copy_of_the_model_is_read_before_its_next_forward(how, tmp_path):
    """A model copied after a forward (``copy.deepcopy``, or pickled whole by ``torch.save``)."""
    model = llama()
    want = step(model, use_cache=False)
    if how == "deepcopy":
        copied = copy.deepcopy(model)
    else:
        torch.save(model, tmp_path / "model.pt")
        copied = torch.load(tmp_path / "model.pt", weights_only=False)  # (the test's own file)
    copied.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    with pytest.raises(ValueError, match=REENTRANT):
        copied(X, labels=X, use_cache=False)
    copied.gradient_checkpointing_disable()
    torch.testing.assert_close(step(copied, use_cache=False), want, rtol=0, atol=0)


@pytest.mark.parametrize("impl", [CheckpointImpl.REENTRANT, CheckpointImpl.NO_REENTRANT])
def test_a_wrapper_applied_after_the_first_forward_is_read_before_the_next(impl, discoveries):
    model = llama()
    want = step(model, use_cache=False)
    discoveries.clear()
    apply_activation_checkpointing(model, checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper,
                                                                                  checkpoint_impl=impl),
                                   check_fn=lambda m: isinstance(m, LlamaDecoderLayer))
    if impl is CheckpointImpl.REENTRANT:
        with pytest.raises(ValueError, match=WRAPPER):
            model(X, labels=X, use_cache=False)
        return
    with pytest.raises(ValueError, match=CACHE):  # the config's use_cache=True under recomputation
        model(X, labels=X)
    torch.testing.assert_close(step(model, use_cache=False), want, rtol=0, atol=0)
    assert discoveries == []  # the attention modules kept their numbers


def test_torch_composable_checkpoint_applied_after_the_first_forward_is_read_before_the_next():
    from torch.distributed._composable import checkpoint

    model = llama()
    want = step(model, use_cache=False)
    torch.nn.Linear(1, 1).register_forward_hook(lambda *a: None)  # a hook elsewhere: the registries read again, same
    step(model, use_cache=False)
    for layer in model.model.layers:
        checkpoint(layer)
    with pytest.raises(ValueError, match=CACHE):
        model(X, labels=X)
    torch.testing.assert_close(step(model, use_cache=False), want, rtol=0, atol=0)


def test_a_module_replaced_after_the_first_forward_is_discovered_again(discoveries):
    """A decoder layer replaced by a copy."""
    model = llama().eval()
    with torch.no_grad():
        want = model(X).logits
        discoveries.clear()
        model.model.layers[1] = copy.deepcopy(model.model.layers[1])
        for m in model.model.layers[1].modules():
            m.__dict__.pop("_pid_plugins_index", None)
            m.__dict__.pop("_pid_plugins_earlier", None)
        torch.testing.assert_close(model(X).logits, want, rtol=0, atol=0)
        model(X)
    assert discoveries == ["LlamaModel"]
