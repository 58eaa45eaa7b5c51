"""A method's parameters as a keyword of ``from_pretrained`` and ``from_config`` (issue 34, part 3):
``from_pretrained(path, attn_implementation="pid", pid={...})``, ``value_residual={...}``, saved as ``config.<method>``
and reloaded; the model runs the given parameters (the model whose ``config.<method>`` was set by hand); a keyword
that does not match ``attn_implementation`` is refused before anything is loaded."""
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
import transformers as T  # noqa: E402

import pid_plugins.hf as ph  # noqa: E402
from zoo_cases import bert_config, hf_ids, llama_config  # noqa: E402

PARAMS = {"pid": {"lambda_p": 0.3, "beta": 0.6}, "value_residual": {"lambda_1": 0.2, "lambda_2": 0.7}}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A stock (sdpa) tiny Llama saved with save_pretrained."""
    path = tmp_path_factory.mktemp("stock")
    torch.manual_seed(0)
    T.LlamaForCausalLM(llama_config()).save_pretrained(path)
    return path


def by_hand(path, method, params):
    """The model built with ``config.<method>`` set by hand, with the checkpoint's weights."""
    config = T.AutoConfig.from_pretrained(path)
    config._attn_implementation = method
    setattr(config, method, params)
    model = T.LlamaForCausalLM(config).eval()
    model.load_state_dict(T.AutoModelForCausalLM.from_pretrained(path).state_dict())
    return model


def logits(model, x):
    with torch.no_grad():
        return model.eval()(x).logits


@pytest.mark.parametrize("method", PARAMS)
@pytest.mark.parametrize("loader", ["auto", "class"])
def test_from_pretrained_takes_the_parameters_saves_and_reloads_them(checkpoint, method, loader, tmp_path):
    cls = T.AutoModelForCausalLM if loader == "auto" else T.LlamaForCausalLM
    model = cls.from_pretrained(checkpoint, attn_implementation=method, **{method: PARAMS[method]})
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
def test_from_config_takes_the_parameters(method):
    config = bert_config()
    torch.manual_seed(0)
    model = T.AutoModel.from_config(config, attn_implementation=method, **{method: PARAMS[method]}).eval()
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


def test_a_dict_overrides_the_parameters_a_saved_model_has(checkpoint, tmp_path):
    T.AutoModelForCausalLM.from_pretrained(checkpoint, attn_implementation="pid", pid=PARAMS["pid"]).save_pretrained(
        tmp_path)
    model = T.AutoModelForCausalLM.from_pretrained(tmp_path, pid={"lambda_i": 0.2})  # runs PID: config.json says so
    assert (model.config.pid["lambda_p"], model.config.pid["beta"], model.config.pid["lambda_i"]) == (0.3, 0.6, 0.2)


def test_learnable_gains_by_keyword_are_built_and_loaded(checkpoint, tmp_path):
    model = T.AutoModelForCausalLM.from_pretrained(checkpoint, attn_implementation="pid",
                                                   pid={"learnable": True, "lambda_p": 0.5})
    gains = {n: p for n, p in model.named_parameters() if ".attention_params." in n}
    assert len(gains) == 9
    with torch.no_grad():
        for p in gains.values():
            p.add_(0.125)  # "trained"
    model.save_pretrained(tmp_path)
    again = T.AutoModelForCausalLM.from_pretrained(tmp_path, pid={"learnable": True})
    assert all(torch.equal(p, gains[n]) for n, p in again.named_parameters() if ".attention_params." in n)
    x = hf_ids()
    assert torch.equal(logits(again, x), logits(model, x))


def test_a_keyword_that_does_not_match_attn_implementation_is_refused_before_loading(checkpoint):
    missing = checkpoint / "not-there"  # refused before the path is read
    with pytest.raises(ValueError, match=r"pid=\.\.\. sets the parameters of attention method 'pid', but the model is "
                                         r"built with attn_implementation='neutreno'.*neutreno=\.\.\."):
        T.AutoModelForCausalLM.from_pretrained(missing, attn_implementation="neutreno", pid={"lambda_p": 0.3})
    with pytest.raises(ValueError, match="a model runs one attention method"):
        T.AutoModelForCausalLM.from_pretrained(missing, attn_implementation="pid", pid={}, neutreno={})
    with pytest.raises(ValueError, match="PIDConfig.beta"):
        T.AutoModelForCausalLM.from_pretrained(missing, attn_implementation="pid", pid={"beta": 0})
    with pytest.raises(ValueError, match=r"unknown NeuTRENOConfig field\(s\) \['learnable'\]"):
        T.AutoModelForCausalLM.from_pretrained(missing, attn_implementation="neutreno", neutreno={"learnable": True})
    # the checkpoint runs sdpa and no attn_implementation is given: refused when its config is read
    with pytest.raises(ValueError, match="attn_implementation='sdpa': pass attn_implementation='pid'"):
        T.AutoModelForCausalLM.from_pretrained(checkpoint, pid={"lambda_p": 0.3})
    config = llama_config()
    with pytest.raises(ValueError, match="LlamaForCausalLM.from_config: value_residual=.*'twicing'"):
        T.AutoModelForCausalLM.from_config(config, attn_implementation="twicing", value_residual={})
    assert "value_residual" not in vars(config)  # the config given is unchanged
