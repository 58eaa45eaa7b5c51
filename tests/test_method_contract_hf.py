"""The adapter contract, transformers: a method registered by a user (the toy ``scaled_reference``) is an
``attn_implementation`` with no adapter change, and passes the tests PID passes."""
import pytest
import torch

transformers = pytest.importorskip("transformers")

import transformers as T  # noqa: E402

import pid_plugins  # noqa: E402
import pid_plugins.hf as ph  # noqa: E402
from toy_method import NAME, ScaledReferenceConfig, toy_rule  # noqa: E402
from zoo_cases import (bart_config, bert_config, causal_lm_loss, hf_checkpointing_grads, llama_config,  # noqa: E402
                       llama_reference)
from zoo_cases import hf_ids as ids  # noqa: E402
from zoo_cases import llama_twins  # noqa: E402

V = 96  # the tiny models' vocabulary (zoo_cases' default)


def twins(gamma=0.3, layers=3):
    return llama_twins(NAME, {"gamma": gamma}, layers=layers)


def reference_llama(model, x, gamma):
    """The whole (float64) Llama by hand: the stock modules for embeddings, norms, rotary and MLP, attention
    written out (softmax of masked scores), and the toy rule from its loop statement."""
    return llama_reference(model, x, toy_rule(gamma))


def test_registered_method_is_an_attn_implementation():
    assert NAME in pid_plugins.list_methods()
    model, _ = twins()
    assert model.config._attn_implementation == NAME
    assert ph.method_of(model.config) is pid_plugins.get_method(NAME)
    assert ph.model_method_config(model.config) == ScaledReferenceConfig(gamma=0.3)


def test_float64_reference():
    model, _ = twins(gamma=0.7)
    model.double()
    x = ids()
    with torch.no_grad():
        got = model(x).logits
        want = reference_llama(model, x, 0.7)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_switched_off_is_the_stock_model_bit_for_bit():
    model, stock = twins(gamma=0.0)
    x = ids()
    with torch.no_grad():
        assert torch.equal(model(x).logits, stock(x).logits)
    on, _ = twins(gamma=0.3)
    with torch.no_grad():
        assert not torch.allclose(on(x).logits, stock(x).logits)


def test_gradient_checkpointing_equals_no_checkpointing():
    model, _ = twins()
    model.train()
    x = ids()
    hf_checkpointing_grads(model, causal_lm_loss(x))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    with pytest.raises(ValueError, match="use_reentrant': False"):
        model(x, labels=x)


@pytest.mark.slow
def test_compiled_fullgraph_equals_eager():
    model, _ = twins()
    x = ids()
    with torch.no_grad():
        want = model(x).logits
        got = torch.compile(model, fullgraph=True, backend="aot_eager")(x).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_cached_generation_equals_recomputation_and_no_future_leak():
    model, _ = twins()
    x = ids(length=6)
    with torch.no_grad():
        cached = model.generate(x, max_new_tokens=6, do_sample=False, use_cache=True, pad_token_id=0)
        seq = x
        for _ in range(6):
            step = model(seq, use_cache=False).logits[:, -1]
            seq = torch.cat([seq, step.argmax(-1, keepdim=True)], 1)
        assert torch.equal(cached, seq)
        static = model.generate(x, max_new_tokens=6, do_sample=False, cache_implementation="static", pad_token_id=0)
        assert torch.equal(static, seq)
        # causal: changing the last token changes no earlier position's logits
        y = x.clone()
        y[:, -1] = (y[:, -1] + 1) % V
        torch.testing.assert_close(model(x).logits[:, :-1], model(y).logits[:, :-1], rtol=0, atol=0)


def test_save_and_reload(tmp_path):
    model, _ = twins(gamma=0.4)
    x = ids()
    model.save_pretrained(tmp_path)
    again = T.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert again.config._attn_implementation == NAME
    assert ph.model_method_config(again.config) == ScaledReferenceConfig(gamma=0.4)
    with torch.no_grad():
        assert torch.equal(again(x).logits, model(x).logits)


def test_to_pid_converts_to_a_registered_method_and_refuses_bad_input():
    torch.manual_seed(0)
    stock = T.LlamaForCausalLM(llama_config("sdpa")).eval()
    model = T.LlamaForCausalLM(llama_config("sdpa")).eval()
    model.load_state_dict(stock.state_dict())
    ph.to_pid(model, {"gamma": 0.0}, method=NAME)
    x = ids()
    with torch.no_grad():
        assert torch.equal(model(x).logits, stock(x).logits)
    with pytest.raises(ValueError, match="unknown attention method 'nope'.*scaled_reference"):
        ph.to_pid(model, method="nope")
    with pytest.raises(ValueError, match="unknown ScaledReferenceConfig field.*learnable"):
        ph.to_pid(model, {"learnable": True}, method=NAME)


def test_encoder_and_encoder_decoder_families():
    """BERT (encoder) and BART (PID-style self-attention stacks, cross-attention untouched): switched off equals
    stock bit for bit, switched on changes the output."""
    for cls, cfg in (
        (T.BertModel, bert_config()),
        (T.BartModel, bart_config()),
    ):
        torch.manual_seed(0)
        stock = cls(cfg).eval()
        x = ids()
        with torch.no_grad():
            want = stock(x).last_hidden_state
            ph.to_pid(stock, {"gamma": 0.0}, method=NAME)
            assert torch.equal(stock(x).last_hidden_state, want)
            ph.to_pid(stock, {"gamma": 0.5}, method=NAME)
            assert not torch.allclose(stock(x).last_hidden_state, want)
