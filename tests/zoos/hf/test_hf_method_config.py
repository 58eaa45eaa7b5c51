"""A method's parameters as ``config.<method>``, the transformers way, with no loader keyword and no wrapper around
the loaders: ``config = AutoConfig.from_pretrained(path)``, ``config.pid = {...}``, ``from_pretrained(path,
config=config, attn_implementation="pid")`` (and ``from_config``); saved as ``config.<method>`` and reloaded; the model
runs the given parameters (the model whose ``config.<method>`` was set by hand); a folder saved with a method takes a
``<method>={...}`` keyword natively (transformers sets a keyword that names a config attribute on the config); bad
parameters are refused while the model is built, before any weight is loaded."""
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
import transformers as T  # noqa: E402

import pid_plugins.hf as ph  # noqa: E402,F401
from zoo_cases import bert_config, hf_ids, llama_config  # noqa: E402

PARAMS = {"pid": {"lambda_p": 0.3, "beta": 0.6}, "value_residual": {"lambda_1": 0.2, "lambda_2": 0.7}}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A stock (sdpa) tiny Llama saved with save_pretrained."""
    path = tmp_path_factory.mktemp("stock")
    torch.manual_seed(0)
    T.LlamaForCausalLM(llama_config()).save_pretrained(path)
    return path


def with_params(path, method, params):
    config = T.AutoConfig.from_pretrained(path)
    setattr(config, method, params)
    return config


def by_hand(path, method, params):
    """The model built with ``config.<method>`` set by hand, with the checkpoint's weights."""
    config = with_params(path, method, params)
    config._attn_implementation = method
    model = T.LlamaForCausalLM(config).eval()
    model.load_state_dict(T.AutoModelForCausalLM.from_pretrained(path).state_dict())
    return model


def logits(model, x):
    with torch.no_grad():
        return model.eval()(x).logits


@pytest.mark.parametrize("method", PARAMS)
@pytest.mark.parametrize("loader", ["auto", "class"])
def test_from_pretrained_with_the_parameters_in_the_config_saves_and_reloads_them(checkpoint, method, loader,
                                                                                  tmp_path):
    cls = T.AutoModelForCausalLM if loader == "auto" else T.LlamaForCausalLM
    model = cls.from_pretrained(checkpoint, config=with_params(checkpoint, method, PARAMS[method]),
                                attn_implementation=method)
    assert model.config._attn_implementation == method
    assert getattr(model.config, method) == {**getattr(model.config, method), **PARAMS[method]}
    x = hf_ids()
    want = logits(by_hand(checkpoint, method, PARAMS[method]), x)
    assert torch.equal(logits(model, x), want)
    preset = cls.from_pretrained(checkpoint, attn_implementation=method)
    assert not torch.allclose(logits(preset, x), want)  # the parameters are used, not the preset's
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["attn_implementation"] == method and saved[method] == getattr(model.config, method)
    reloaded = T.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert reloaded.config._attn_implementation == method
    assert torch.equal(logits(reloaded, x), want)


@pytest.mark.parametrize("method", PARAMS)
def test_from_config_with_the_parameters_in_the_config(method):
    config = bert_config()
    setattr(config, method, PARAMS[method])
    torch.manual_seed(0)
    model = T.AutoModel.from_config(config, attn_implementation=method).eval()
    assert model.config._attn_implementation == method
    hand = bert_config()
    hand._attn_implementation = method
    setattr(hand, method, PARAMS[method])
    other = T.BertModel(hand).eval()
    other.load_state_dict(model.state_dict())
    preset = T.AutoModel.from_config(bert_config(), attn_implementation=method).eval()
    preset.load_state_dict(model.state_dict())
    x = hf_ids()
    with torch.no_grad():
        got = model(x).last_hidden_state
        assert torch.equal(got, other(x).last_hidden_state)
        assert not torch.allclose(got, preset(x).last_hidden_state)


def test_a_folder_saved_with_a_method_takes_its_parameters_as_a_keyword(checkpoint, tmp_path):
    """transformers itself sets a loader keyword that names a config attribute on the config."""
    T.AutoModelForCausalLM.from_pretrained(checkpoint, config=with_params(checkpoint, "pid", PARAMS["pid"]),
                                           attn_implementation="pid").save_pretrained(tmp_path)
    model = T.AutoModelForCausalLM.from_pretrained(tmp_path, pid={**PARAMS["pid"], "lambda_i": 0.2})
    assert model.config._attn_implementation == "pid"  # config.json says so
    assert (model.config.pid["lambda_p"], model.config.pid["beta"], model.config.pid["lambda_i"]) == (0.3, 0.6, 0.2)
    x = hf_ids()
    assert torch.equal(logits(model, x), logits(by_hand(tmp_path, "pid", {**PARAMS["pid"], "lambda_i": 0.2}), x))


def test_learnable_gains_in_the_config_are_built_and_loaded(checkpoint, tmp_path):
    model = T.AutoModelForCausalLM.from_pretrained(
        checkpoint, config=with_params(checkpoint, "pid", {"learnable": True, "lambda_p": 0.5}),
        attn_implementation="pid")
    gains = {n: p for n, p in model.named_parameters() if ".attention_params." in n}
    assert len(gains) == 9
    with torch.no_grad():
        for p in gains.values():
            p.add_(0.125)  # "trained"
    model.save_pretrained(tmp_path)
    again = T.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert all(torch.equal(p, gains[n]) for n, p in again.named_parameters() if ".attention_params." in n)
    x = hf_ids()
    assert torch.equal(logits(again, x), logits(model, x))


def test_bad_parameters_are_refused_while_the_model_is_built(checkpoint):
    for method, params, message in (("pid", {"beta": 0}, "PIDConfig.beta"),
                                    ("neutreno", {"learnable": True}, r"unknown NeuTRENOConfig field\(s\) \['learnable'\]")):
        with pytest.raises(ValueError, match=message):
            T.AutoModelForCausalLM.from_pretrained(checkpoint, config=with_params(checkpoint, method, params),
                                                   attn_implementation=method)
