"""``pid_plugins.hf.convert(model, attention, attention_cfg, base=...)``."""
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
import transformers as T  # noqa: E402

import pid_plugins.hf as ph  # noqa: E402
import toy_method  # noqa: E402,F401  (registers the toy method a user registers, scaled_reference)
from zoo_cases import bert_config, hf_ids, llama_config  # noqa: E402

FAMILIES = {"llama": (llama_config, T.LlamaForCausalLM), "bert": (bert_config, T.BertModel)}


def build(family, attn_implementation=None, seed=0, **kw):
    make, cls = FAMILIES[family]
    config = make(**kw)
    if attn_implementation is not None:
        config._attn_implementation = attn_implementation
    torch.manual_seed(seed)
    return cls(config).eval()


def twin(model, family, attn_implementation=None, **kw):
    """A model of ``family`` built with ``attn_implementation`` and ``model``'s weights (only the keys it has)."""
    other = build(family, attn_implementation, seed=1, **kw)
    own = other.state_dict()
    other.load_state_dict({k: v for k, v in model.state_dict().items() if k in own}, strict=False)
    return other


def out(model, x):
    with torch.no_grad():
        result = model(x)
    return result.logits if hasattr(result, "logits") else result.last_hidden_state


def snapshot(model):
    """What a refused convert must leave unchanged."""
    return (list(model.state_dict()), json.dumps(model.config.to_dict(), sort_keys=True, default=str),
            model.config._attn_implementation, {n: p.data_ptr() for n, p in model.named_parameters()})


def test_an_eager_model_returns_to_eager_also_after_save_and_reload(tmp_path):
    stock = build("llama", "eager")
    model = twin(stock, "llama", "eager")
    x = hf_ids()
    ph.convert(model, "neutreno")
    model.save_pretrained(tmp_path)
    reloaded = T.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert reloaded.config._attn_implementation == "neutreno" and reloaded.config.stock_attention == "eager"
    for m in (model, reloaded):
        ph.convert(m, "softmax")
        assert m.config._attn_implementation == "eager"
        assert torch.equal(out(m, x), out(stock, x))
    model.save_pretrained(tmp_path)  # nothing of ours in the stock model's config.json
    saved = json.loads((tmp_path / "config.json").read_text())
    assert not any(k.startswith(("pid", "neutreno", "stock_attention")) for k in saved)


def test_a_base_that_is_not_there_or_not_taken_is_refused_before_anything_changes():
    model = build("llama")
    ph.convert(model, "pid", {"lambda_p": 0.3})
    before = snapshot(model)
    for args, kwargs, match in [(("pid",), {"base": "flash"}, "base attention 'flash'"),
                                (("pid", {"beta": 0}), {}, "PIDConfig.beta"),
                                (("softmax",), {"base": "eager"}, "takes none")]:
        with pytest.raises(ValueError, match=match):
            ph.convert(model, *args, **kwargs)
        assert snapshot(model) == before, args


def test_a_base_the_model_cannot_run_is_refused_before_anything_changes():
    model = T.GPT2LMHeadModel(T.GPT2Config(vocab_size=96, n_embd=32, n_layer=2, n_head=4, n_positions=32)).eval()
    before = snapshot(model)
    with pytest.raises(ValueError, match="does not support flex attention"):
        ph.convert(model, "pid", {"lambda_p": 0.3}, base="flex_attention")
    assert snapshot(model) == before


def test_a_family_outside_the_attention_interface_is_refused_before_anything_changes():
    """GPT-Neo picks its attention class from its own table: refused naming the table, the model unchanged."""
    config = T.GPTNeoConfig(vocab_size=96, hidden_size=32, num_layers=2, num_heads=4,
                            attention_types=[[["global", "local"], 1]], window_size=4, max_position_embeddings=32)
    model = T.GPTNeoForCausalLM(config).eval()
    before = snapshot(model)
    with pytest.raises(ValueError, match="GPT_NEO_ATTENTION_CLASSES"):
        ph.convert(model, "pid")
    assert snapshot(model) == before


def test_convert_with_the_models_own_method_applies_a_changed_config():
    """The one way to apply a changed ``config.<method>`` (learnable parameters, a warm-up: they add modules) to a
    built model: ``convert(model, method_of(model.config).name)``, which keeps the config's parameters."""
    stock = build("llama")
    model, other = twin(stock, "llama"), twin(stock, "llama")
    ph.convert(model, "neutreno", base="eager")
    model.config.neutreno = {"alpha": 0.3, "warmup_steps": 4}
    assert ph.convert(model, ph.method_of(model.config).name) is model
    ph.convert(other, "neutreno", {"alpha": 0.3, "warmup_steps": 4}, base="eager")
    assert model.config.to_dict() == other.config.to_dict()
    assert model.state_dict().keys() == other.state_dict().keys()
    assert "attention_warmup.step" in model.state_dict()
    x = hf_ids()
    assert torch.equal(out(model, x), out(other, x))


def test_one_name_per_thing():
    """convert is the one switching verb; the adapter's earlier names and attention.py's re-exports are gone."""
    from pid_plugins.hf import attention, discovery

    for name in ("to_pid", "install_pid_hooks", "PIDForwardState", "pid_attention_forward", "pid_mask",
                 "model_pid_config"):
        assert not hasattr(ph, name) and not hasattr(attention, name) and not hasattr(discovery, name), name
    for name in ("convert", "BASE_ATTR", "method_of", "model_method_config"):
        assert not hasattr(attention, name), name
    assert "rediscover" not in ph.__all__ and not hasattr(ph, "rediscover")
    assert T.AttentionInterface._global_mapping["pid"] is ph.method_attention_forward
    assert T.AttentionMaskInterface._global_mapping["pid"] is ph.method_mask
