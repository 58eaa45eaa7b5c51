"""``pid_plugins.hf.convert(model, attention, attention_cfg, base=...)``: in place, on a tiny Llama (GQA) and BERT.

stock -> method -> softmax is the stock model bit for bit (logits, state_dict keys, config); stock -> each registered
method is the model built with ``attn_implementation=<method>`` from the same weights; method -> other method;
learnable gains, the warm-up counter and the method record added and removed; refusals before anything changes."""
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
import transformers as T  # noqa: E402

import pid_plugins.hf as ph  # noqa: E402
import toy_method  # noqa: E402,F401  (registers the toy method a user registers, scaled_reference)
from method_cases import METHODS  # noqa: E402
from pid_plugins.core.record import decode_record  # noqa: E402
from pid_plugins.hf.record import record_key  # noqa: E402
from zoo_cases import bert_config, hf_ids, llama_config  # noqa: E402

FAMILIES = {"llama": (llama_config, T.LlamaForCausalLM), "bert": (bert_config, T.BertModel)}
GAINS = {"learnable": True, "warmup_steps": 3}


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


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("cfg", [None, GAINS], ids=["fixed", "learnable_warmup"])
def test_stock_to_pid_to_softmax_is_the_stock_model_bit_for_bit(family, cfg, tmp_path):
    stock = build(family)
    model = twin(stock, family)
    x = hf_ids()
    want = out(stock, x)
    tensors = {n: p.data_ptr() for n, p in model.named_parameters()}
    assert ph.convert(model, "pid", cfg) is model
    assert model.config._attn_implementation == "pid" and model.config.stock_attention == "sdpa"
    if cfg is None:
        assert not torch.allclose(out(model, x), want)
    else:  # warm-up at t = 0: the stock function
        assert torch.equal(out(model, x), want)
    added = set(model.state_dict()) - set(stock.state_dict())
    assert decode_record(model.state_dict()[record_key(model)]) == {"method": "pid", "config": model.config.pid}
    added.remove(record_key(model))  # the method record, always; learnable gains (3 per layer) and the warm-up counter
    assert bool(added) == (cfg is not None)
    if cfg is not None:
        layers = stock.config.num_hidden_layers
        assert len([k for k in added if ".attention_params." in k]) == 3 * layers and "attention_warmup.step" in added
        assert not model.attention_warmup.training and all(not m.training for m in model.modules())
    assert ph.convert(model, "softmax") is model
    assert model.config._attn_implementation == "sdpa"
    assert list(model.state_dict()) == list(stock.state_dict())
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == tensors  # the same tensors throughout
    assert model.config.to_dict() == stock.config.to_dict()
    assert set(vars(model.config)) == set(vars(stock.config))
    for (name, mine), (_, theirs) in zip(model.named_modules(), stock.named_modules()):
        assert set(vars(mine)) == set(vars(theirs)), name  # no attribute of ours left on any module
    assert torch.equal(out(model, x), want)
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert not any(k.startswith("pid") for k in saved) and saved.get("attn_implementation") is None


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


def test_softmax_on_a_stock_model_changes_nothing():
    model = build("llama", "eager")
    before = snapshot(model)
    ph.convert(model, "softmax")
    assert snapshot(model) == before


#: causal parameters for the methods whose transformers default is a vision preset (twicing: a 3-layer model)
CAUSAL = {"elliptical": "lm", "twicing": {"from_layer": 1}}


@pytest.mark.parametrize("method", sorted(METHODS))  # the method table: every built-in method and the toy
def test_stock_to_each_method_equals_the_model_built_with_it(method):
    stock = build("llama")
    model = twin(stock, "llama")
    ph.convert(model, method, CAUSAL.get(method))
    built = twin(stock, "llama", method, **({method: CAUSAL[method]} if method in CAUSAL else {}))
    assert built.config._attn_implementation == method
    x = hf_ids()
    assert torch.equal(out(model, x), out(built, x))
    assert not torch.allclose(out(model, x), out(stock, x))


def test_bert_to_pid_equals_the_model_built_with_it():
    stock = build("bert")
    model = twin(stock, "bert")
    ph.convert(model, "pid", {"lambda_p": 0.4})
    built = build("bert", "pid", pid={"lambda_p": 0.4})
    built.load_state_dict(stock.state_dict())
    x = hf_ids()
    assert torch.equal(out(model, x), out(built, x))


def test_method_to_another_method_is_the_model_built_with_that_method():
    stock = build("llama")
    model = twin(stock, "llama")
    ph.convert(model, "pid", GAINS)
    ph.convert(model, "neutreno", {"alpha": 0.4})
    assert "pid" not in vars(model.config) and model.config.neutreno["alpha"] == 0.4
    # the learnable gains and the counter went with PID; the record is NeuTRENO's
    keys = list(stock.state_dict())
    assert keys[0] == "model.embed_tokens.weight" and record_key(model) == "model.embed_tokens.pid_plugins_method"
    assert list(model.state_dict()) == [keys[0], record_key(model), *keys[1:]]
    assert decode_record(model.state_dict()[record_key(model)]) == {"method": "neutreno", "config": model.config.neutreno}
    built = twin(stock, "llama", "neutreno", neutreno={"alpha": 0.4})
    x = hf_ids()
    assert torch.equal(out(model, x), out(built, x))
    ph.convert(model, "pid")  # back: PID's preset, not the parameters it had before
    assert torch.equal(out(model, x), out(twin(stock, "llama", "pid"), x))
    assert model.config.stock_attention == "sdpa"  # still the stock implementation recorded at the start


def test_learnable_gains_are_added_kept_as_trained_and_removed():
    model = build("llama").double()
    ph.convert(model, "pid", {"learnable": True, "lambda_p": 0.5})
    gains = {n: p for n, p in model.named_parameters() if ".attention_params." in n}
    assert len(gains) == 9 and all(p.dtype == torch.float64 for p in gains.values())
    with torch.no_grad():
        next(iter(gains.values())).add_(0.25)  # "trained"
    trained = {n: p.clone() for n, p in gains.items()}
    ph.convert(model, "pid", {"lambda_d": 0.2})  # a dict overrides the model's config.pid: still learnable
    assert all(torch.equal(p, trained[n]) for n, p in model.named_parameters() if ".attention_params." in n)
    assert model.config.pid["learnable"] is True and model.config.pid["lambda_p"] == 0.5
    ph.convert(model, "pid", {"learnable": False})
    assert not [n for n, _ in model.named_parameters() if ".attention_params." in n]


@pytest.mark.parametrize("family", FAMILIES)
def test_refusals_before_anything_changes(family):
    model = build(family)
    ph.convert(model, "pid", {"lambda_p": 0.3})
    before = snapshot(model)
    cases = [
        (("pidd",), {}, ValueError, "unknown attention method 'pidd'"),
        (("pid", {"beta": 0}), {}, ValueError, "PIDConfig.beta"),
        (("pid", {"lambda_q": 1.0}), {}, ValueError, "lambda_q"),
        (("neutreno", {"learnable": True}), {}, ValueError, "learnable"),
        (("pid",), {"base": "flash"}, ValueError, "base attention 'flash'"),
        (("softmax",), {"base": "eager"}, ValueError, "takes none"),
    ]
    for args, kwargs, error, match in cases:
        with pytest.raises(error, match=match):
            ph.convert(model, *args, **kwargs)
        assert snapshot(model) == before, args
    with pytest.raises(TypeError, match="before torch.compile"):
        ph.convert(torch.compile(model), "neutreno")
    assert snapshot(model) == before


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
