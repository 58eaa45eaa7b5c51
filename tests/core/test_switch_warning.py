"""One warning before noise: trained weights switched to a method at full strength (no warm-up) log one warning naming
the method, in every zoo (convert; transformers' loader of a checkpoint saved without the method)."""
import logging

import pytest
import torch

from pid_plugins.core.layer import carries_trained_weights

ZERO_PID = {"lambda_p": 0.0, "lambda_i": 0.0, "lambda_d": 0.0}
WARMUP = {"warmup_steps": 10}


def train(model):
    """``model`` with trained-looking weights: its normalisation layers' weights vary (as after training)."""
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for module in model.modules():
            if "norm" in type(module).__name__.lower() and getattr(module, "weight", None) is not None:
                module.weight.copy_(1 + 0.1 * torch.randn(module.weight.shape, generator=gen))
    return model


def warnings_of(caplog, switch):
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="pid_plugins"):
        switch()
    return [r.getMessage() for r in caplog.records if "trained weights switched" in r.getMessage()]


def assert_warns_once(messages, method):
    assert len(messages) == 1, messages
    assert f"attention method {method!r} at full strength" in messages[0]
    assert "warmup_steps" in messages[0] and "docs/finetuning.md" in messages[0]


def test_trained_weights_are_told_from_weights_as_built():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    assert not carries_trained_weights(model)
    assert carries_trained_weights(train(model))


def test_transformers_convert_and_loader(caplog, tmp_path):
    pytest.importorskip("transformers")
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    import pid_plugins.hf as ph

    def config():  # a new one each time: convert writes the method into the model's config
        return LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2)

    torch.manual_seed(0)
    assert warnings_of(caplog, lambda: ph.convert(LlamaForCausalLM(config()), "pid")) == []  # from scratch
    stock = train(LlamaForCausalLM(config()))
    stock.save_pretrained(tmp_path / "stock")
    assert warnings_of(caplog, lambda: ph.convert(stock, "pid", ZERO_PID)) == []
    assert warnings_of(caplog, lambda: ph.convert(stock, "pid", WARMUP)) == []
    ph.convert(stock, "softmax")
    assert_warns_once(warnings_of(caplog, lambda: ph.convert(stock, "pid")), "pid")
    assert warnings_of(caplog, lambda: ph.convert(stock, "pid")) == []  # it runs PID already
    assert_warns_once(warnings_of(caplog, lambda: ph.convert(stock, "neutreno")), "neutreno")
    # the loader: a stock checkpoint with a method warns at the model's first forward (its weights are loaded then),
    # once; one with a warm-up or zero parameters (config.pid, the transformers way) does not; a checkpoint saved with
    # the method loads without one
    x = torch.randint(0, 64, (1, 4))

    def load(path, params=None, **kw):
        config = AutoConfig.from_pretrained(path)
        if params is not None:
            config.pid = params
        model = AutoModelForCausalLM.from_pretrained(path, config=config, **kw)
        with torch.no_grad():
            model(x)
            model(x)
        return model

    assert_warns_once(warnings_of(caplog, lambda: load(tmp_path / "stock", attn_implementation="pid")), "pid")
    assert warnings_of(caplog, lambda: load(tmp_path / "stock", WARMUP, attn_implementation="pid")) == []
    assert warnings_of(caplog, lambda: load(tmp_path / "stock", ZERO_PID, attn_implementation="pid")) == []
    assert warnings_of(caplog, lambda: load(tmp_path / "stock")) == []
    load(tmp_path / "stock", attn_implementation="pid").save_pretrained(tmp_path / "pid")
    assert warnings_of(caplog, lambda: load(tmp_path / "pid")) == []
    # built from the stock folder's config with its weights as built (from_config): nothing trained, no warning
    assert warnings_of(caplog, lambda: AutoModelForCausalLM.from_config(
        AutoConfig.from_pretrained(tmp_path / "stock"), attn_implementation="pid")(x)) == []


@pytest.mark.parametrize("name", ["timm-deit", "timm-fan", "mmseg-segmentor", "fairseq-lm"])
def test_convert(caplog, name):
    from pid_plugins.testing import MODELS, SEGMENTOR

    zoo = SEGMENTOR if name == SEGMENTOR.name else MODELS[name]
    assert warnings_of(caplog, lambda: zoo.convert(zoo.stock(), "pid")) == []  # from scratch
    model = zoo.stock(seed=1)
    model.load_state_dict(train(zoo.stock(seed=2)).state_dict())  # a loaded checkpoint
    assert warnings_of(caplog, lambda: zoo.convert(model, "pid", ZERO_PID)) == []
    assert warnings_of(caplog, lambda: zoo.convert(model, "pid", WARMUP)) == []
    zoo.convert(model, "softmax")
    assert_warns_once(warnings_of(caplog, lambda: zoo.convert(model, "pid")), "pid")
    assert warnings_of(caplog, lambda: zoo.convert(model, "pid")) == []  # it runs PID already
