"""Activation checkpointing by torch's own wrappers on a transformers model (issue 43, "What to build" 4), for every
method: ``apply_activation_checkpointing`` / ``checkpoint_wrapper``, torch's composable ``checkpoint(module)``,
``torch.utils.checkpoint.checkpoint`` by hand, and FSDP2's ``fully_shard`` over checkpointed layers.

* non-reentrant, ``use_cache=False``: gradients equal the uncheckpointed model's;
* reentrant (it runs the first forward without autograd, so a method's state carries no gradient between layers):
  refused before the forward for the wrapper, in the first attention call for ``torch.utils.checkpoint`` by hand;
* ``use_cache`` left on (the config's default): the recomputation would append the keys to the cache a second time;
  one message telling the user to pass ``use_cache=False``, before the forward in training with a wrapper, at the
  recomputation otherwise.
"""
from __future__ import annotations

import functools

import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl, apply_activation_checkpointing, checkpoint_wrapper,
)
from torch.utils.checkpoint import checkpoint

from zoo_cases import hf_ids, import_transformers, llama_config

T = import_transformers()
from transformers.models.llama.modeling_llama import LlamaDecoderLayer  # noqa: E402

import pid_plugins.hf  # noqa: E402,F401
from method_cases import variants  # noqa: E402

METHOD_CFG = {key: cfg for key, (_, cfg) in variants("hf-llama", learnable=False).items()}
X = hf_ids(2, 8)
USE_CACHE_MESSAGE = (r"activation checkpointing.* recomputes each layer in the backward, and with a KV cache the "
                     r"recomputation appends the layer's keys and values to the cache a second time: pass "
                     r"use_cache=False to the forward")


def llama(name):
    torch.manual_seed(0)
    return T.LlamaForCausalLM(llama_config(name, METHOD_CFG[name], tie_word_embeddings=False)).train()


def grads(model, **kwargs):
    """(logits, {parameter name without wrapper prefixes: full gradient})."""
    model.zero_grad()
    out = model(X, labels=X, **kwargs)
    out.loss.backward()
    found = {}
    for n, p in model.named_parameters():
        grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        found[n.replace("_checkpoint_wrapped_module.", "").replace("inner.", "")] = grad.clone()
    return out.logits.detach(), found


def assert_same(got, want):
    (logits, g), (logits0, g0) = got, want
    torch.testing.assert_close(logits, logits0, rtol=0, atol=0)
    assert g.keys() == g0.keys()
    for key in g0:
        torch.testing.assert_close(g[key], g0[key], rtol=1e-6, atol=1e-7, msg=key)


def wrapped(name, impl=CheckpointImpl.NO_REENTRANT):
    model = llama(name)
    apply_activation_checkpointing(model, checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper,
                                                                                  checkpoint_impl=impl),
                                   check_fn=lambda m: isinstance(m, LlamaDecoderLayer))
    return model


def composable(name):
    from torch.distributed._composable import checkpoint as composable_checkpoint

    model = llama(name)
    for layer in model.model.layers:
        composable_checkpoint(layer)
    return model


class ByHand(torch.nn.Module):
    """A decoder layer checkpointed by ``torch.utils.checkpoint.checkpoint`` in a user's own wrapper (the keyword
    arguments closed over: reentrant checkpointing takes none)."""

    def __init__(self, inner, reentrant):
        super().__init__()
        self.inner, self.reentrant = inner, reentrant

    def forward(self, hidden, **kwargs):
        return checkpoint(lambda h: self.inner(h, **kwargs), hidden, use_reentrant=self.reentrant)


def by_hand(name, reentrant):
    model = llama(name)
    for i, layer in enumerate(model.model.layers):
        model.model.layers[i] = ByHand(layer, reentrant)
    return model


@pytest.mark.parametrize("build", ["checkpoint_wrapper", "composable", "by_hand"])
@pytest.mark.parametrize("name", METHOD_CFG)
def test_non_reentrant_checkpointing_gives_the_uncheckpointed_gradients(name, build):
    make = {"checkpoint_wrapper": wrapped, "composable": composable,
            "by_hand": functools.partial(by_hand, reentrant=False)}[build]
    assert_same(grads(make(name), use_cache=False), grads(llama(name), use_cache=False))


@pytest.mark.parametrize("name", METHOD_CFG)
def test_composable_checkpoint_of_a_whole_model(name):
    """torch's composable ``checkpoint(module)`` applied to a whole model."""
    from torch.distributed._composable import checkpoint as composable_checkpoint

    for kwargs in ({"use_cache": False}, {}):
        model = llama(name)
        assert model.config.use_cache
        composable_checkpoint(model)
        assert_same(grads(model, **kwargs), grads(llama(name), **kwargs))
    model = llama(name)
    composable_checkpoint(model.model)
    assert_same(grads(model, use_cache=False), grads(llama(name), use_cache=False))
    with pytest.raises(ValueError, match=r"activation checkpointing \(torch's checkpoint at LlamaModel\) recomputes "
                                         r"each layer.*pass use_cache=False"):
        model(X, labels=X)


@pytest.mark.parametrize("name", METHOD_CFG)
def test_the_reentrant_wrapper_is_refused_before_the_forward(name):
    model = wrapped(name, CheckpointImpl.REENTRANT)
    for kwargs in ({"use_cache": False}, {}):
        with pytest.raises(ValueError, match=rf"attention method '{name}' needs non-reentrant activation "
                                             r"checkpointing, but LlamaModel\.layers\.0 is wrapped by torch's "
                                             r"checkpoint_wrapper with checkpoint_impl=CheckpointImpl\.REENTRANT"):
            model(X, labels=X, **kwargs)
    with torch.no_grad():  # nothing to differentiate: reentrant checkpointing is the plain forward
        model(X, use_cache=False)


@pytest.mark.parametrize("name", METHOD_CFG)
def test_reentrant_checkpoint_by_hand_is_refused_in_the_forward(name):
    model = by_hand(name, reentrant=True)
    with pytest.raises(ValueError, match=rf"attention method '{name}': LlamaAttention ran without autograd inside a "
                                         r"forward that began with it: reentrant activation checkpointing "
                                         r"\(torch\.utils\.checkpoint\.checkpoint\(\.\.\., use_reentrant=True\)"):
        model(X, labels=X, use_cache=False)


@pytest.mark.parametrize("name", METHOD_CFG)
def test_use_cache_left_on_gets_one_message(name):
    """Training with a wrapper."""
    model = wrapped(name)
    assert model.config.use_cache
    with pytest.raises(ValueError, match=r"activation checkpointing \(torch's checkpoint_wrapper at "
                                         r"LlamaModel\.layers\.0\) recomputes each layer"):
        model(X, labels=X)
    model.eval()
    out = model(X, labels=X)
    assert len(out.past_key_values) == 3
    with pytest.raises(ValueError, match=USE_CACHE_MESSAGE):
        out.loss.backward()
    model = by_hand(name, reentrant=False)
    out = model(X, labels=X)
    with pytest.raises(ValueError, match=USE_CACHE_MESSAGE):
        out.loss.backward()


@pytest.mark.slow
def test_fsdp2_fully_shard_over_checkpointed_layers(tmp_path):
    """FSDP2 (one process, gloo) over ``apply_activation_checkpointing``'d layers."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        for name in METHOD_CFG:
            want = grads(llama(name), use_cache=False)
            for impl in (CheckpointImpl.NO_REENTRANT, CheckpointImpl.REENTRANT):
                model = wrapped(name, impl)
                for layer in model.model.layers:
                    fully_shard(layer)
                fully_shard(model)
                if impl is CheckpointImpl.NO_REENTRANT:
                    assert_same(grads(model, use_cache=False), want)
                else:
                    with pytest.raises(ValueError, match="CheckpointImpl.REENTRANT"):
                        model(X, labels=X, use_cache=False)
    finally:
        dist.destroy_process_group()
