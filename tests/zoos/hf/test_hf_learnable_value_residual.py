"""Learnable value-residual lambdas under transformers (``value_residual={"learnable": True}``): made through the
method contract (``make_learned``) on every self-attention module as ``attention_params`` (``lambda_1``, ``lambda_2``),
initialised from the config also for the missing keys of a stock checkpoint, trained (every layer's reach the loss),
saved and reloaded, out of weight decay; convert adds, replaces and removes them."""
import pytest
import torch

transformers = pytest.importorskip("transformers")
import transformers as T  # noqa: E402

import pid_plugins.hf as ph  # noqa: E402
from zoo_cases import hf_ids, llama_config  # noqa: E402

LEARN = {"learnable": True, "lambda_1": 0.3, "lambda_2": 0.6}


def lambdas(model):
    return {n: p for n, p in model.named_parameters() if ".attention_params." in n}


def logits(model, x):
    with torch.no_grad():
        return model.eval()(x).logits


def test_built_with_learnable_lambdas_from_the_config_is_the_fixed_model_and_trains_every_layer():
    torch.manual_seed(0)
    model = T.LlamaForCausalLM(llama_config("value_residual", LEARN))
    got = lambdas(model)
    assert sorted(got) == sorted(f"model.layers.{i}.self_attn.attention_params.lambda_{k}"
                                 for i in range(3) for k in (1, 2))
    assert all(float(p) == pytest.approx(LEARN[n.rsplit(".", 1)[1]]) for n, p in got.items())
    fixed = T.LlamaForCausalLM(llama_config("value_residual", {"lambda_1": 0.3, "lambda_2": 0.6})).eval()
    fixed.load_state_dict({k: v for k, v in model.state_dict().items() if k in fixed.state_dict()})
    x = hf_ids()
    torch.testing.assert_close(logits(model, x), logits(fixed, x), rtol=0, atol=0)
    model.train()
    model(x, labels=x).loss.backward()
    assert all(p.grad is not None for p in got.values())  # the first layer's too (joined with weight 0)
    assert all(float(p.grad.abs().sum()) > 0 for n, p in got.items() if ".layers.0." not in n)
    assert set(ph.gain_parameter_names(model)) == set(got)
    names = [n for n, _ in model.named_parameters()]
    assert not set(ph.decay_parameter_names(names)) & set(got)


def test_a_stock_checkpoint_loads_with_the_lambdas_at_their_config_values_and_trained_ones_reload(tmp_path):
    torch.manual_seed(0)
    T.LlamaForCausalLM(llama_config()).save_pretrained(tmp_path / "stock")
    config = T.AutoConfig.from_pretrained(tmp_path / "stock")
    config.value_residual = LEARN
    model = T.AutoModelForCausalLM.from_pretrained(tmp_path / "stock", config=config,
                                                   attn_implementation="value_residual")
    assert all(float(p) == pytest.approx(LEARN[n.rsplit(".", 1)[1]]) for n, p in lambdas(model).items())
    with torch.no_grad():
        for i, p in enumerate(lambdas(model).values()):
            p.add_(0.01 * (i + 1))  # "trained"
    model.save_pretrained(tmp_path / "trained")
    again = T.AutoModelForCausalLM.from_pretrained(tmp_path / "trained")
    assert again.config._attn_implementation == "value_residual" and again.config.value_residual["learnable"]
    trained = lambdas(model)
    assert all(torch.equal(p, trained[n]) for n, p in lambdas(again).items()) and len(lambdas(again)) == 6
    x = hf_ids()
    assert torch.equal(logits(again, x), logits(model, x))


def test_convert_adds_replaces_and_removes_them():
    torch.manual_seed(0)
    stock = T.LlamaForCausalLM(llama_config()).eval()
    keys = list(stock.state_dict())
    x = hf_ids()
    want = logits(stock, x)
    ph.convert(stock, "value_residual", LEARN)
    assert len(lambdas(stock)) == 6 and all(not m.training for m in stock.modules())
    ph.convert(stock, "pid", {"learnable": True})  # another method's learnable parameters replace them
    assert len(lambdas(stock)) == 9 and all(n.endswith("_raw") for n in lambdas(stock))
    ph.convert(stock, "value_residual", LEARN)
    assert len(lambdas(stock)) == 6 and all(n[-8:] in ("lambda_1", "lambda_2") for n in lambdas(stock))
    ph.convert(stock, "softmax")
    assert list(stock.state_dict()) == keys and torch.equal(logits(stock, x), want)
