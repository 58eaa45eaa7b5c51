"""peft on attention-method models in transformers (issue 32)."""
from __future__ import annotations

import pytest
import torch
from peft import IA3Config, LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file
from transformers import AttentionInterface, AutoModelForCausalLM, LlamaForCausalLM, Trainer, TrainingArguments

import pid_plugins.hf as ph
from pid_plugins.core import GainWarmup
from pid_plugins.core.pid import PIDGains
from method_cases import variants
from zoo_cases import hf_ids, llama_config

LAYERS = 3
METHOD_CFG = {key: cfg for key, (_, cfg) in variants("hf-llama", learnable=False).items()}
ADAPTERS = {  # name: (config, the substring every trainable parameter's name carries)
    "lora": (lambda **kw: LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                                     **kw), "lora_"),
    "ia3": (lambda **kw: IA3Config(target_modules=["k_proj", "v_proj", "down_proj"],
                                   feedforward_modules=["down_proj"], **kw), "ia3_"),
}
LEARN = {"lambda_p": 0.6, "lambda_i": 0.3, "lambda_d": 0.1, "beta": 0.4, "learnable": True}


def build(name="pid", cfg=None, seed=0):
    """A tiny GQA Llama running ``name`` (``"sdpa"``: stock), weights from ``seed``, eval mode."""
    torch.manual_seed(seed)
    cfg = METHOD_CFG.get(name) if cfg is None else cfg
    return LlamaForCausalLM(llama_config(name, cfg, layers=LAYERS)).eval()


def stock_twin(model):
    """The stock SDPA Llama holding ``model``'s weights (the method's extra state, gains and counter, left out)."""
    stock = build("sdpa")
    own = stock.state_dict()
    stock.load_state_dict({k: v for k, v in model.state_dict().items() if k in own}, strict=True)
    return stock


def logits(model, x):
    with torch.no_grad():
        return model(input_ids=x).logits


def greedy(model, x):
    with torch.no_grad():
        return model.generate(input_ids=x, max_new_tokens=6, do_sample=False, pad_token_id=0)


def train(model, x, steps=3, lr=1e-2):
    """``steps`` AdamW steps (no weight decay: a parameter changes only if it gets a gradient) in training mode."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    model.train()
    for _ in range(steps):
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
    model.eval()


def snapshot(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.fixture
def calls(monkeypatch):
    """Every call of a registered method's attention function."""
    seen = []
    for name in METHOD_CFG:
        original = AttentionInterface._global_mapping[name]

        def record(module, *args, _name=name, _original=original, **kwargs):
            run = kwargs.get("method_state")
            assert run is not None and run.method.name == _name  # the forward's method state reached the layer
            scale = None if run.scale is None else float(run.scale)
            seen.append((_name, module.layer_idx, not run.zero, scale, args[0].shape[-2]))
            return _original(module, *args, **kwargs)

        monkeypatch.setitem(AttentionInterface._global_mapping, name, record)
    return seen


def assert_method_ran(calls, name, forwards):
    """The last ``forwards`` forwards each ran ``name``, active, at every layer, in order."""
    assert [c[:4] for c in calls[-forwards * LAYERS:]] == [(name, i, True, None) for _ in range(forwards)
                                                           for i in range(LAYERS)]


@pytest.mark.slow
@pytest.mark.parametrize("adapter", ADAPTERS)
@pytest.mark.parametrize("name", METHOD_CFG)
def test_adapter_wraps_trains_saves_reloads_merges_and_generates_with_the_method_on(name, adapter, calls, tmp_path):
    make, marker = ADAPTERS[adapter]
    x = hf_ids(2, 8)
    model = build(name)
    before = logits(model, x)
    assert not torch.allclose(before, logits(stock_twin(model), x), rtol=0, atol=1e-4)  # the method is on

    wrapped = get_peft_model(model, make())
    assert wrapped.base_model.model is model and model.config._attn_implementation == name
    calls.clear()
    assert torch.equal(logits(wrapped, x), before)  # an adapter at its initialisation is the identity
    assert_method_ran(calls, name, 1)

    trainable = {n for n, p in wrapped.named_parameters() if p.requires_grad}
    assert trainable and all(marker in n for n in trainable)
    start = snapshot(wrapped)
    calls.clear()
    train(wrapped, x, steps=3)
    assert_method_ran(calls, name, 3)
    for n, p in wrapped.named_parameters():
        assert torch.equal(p, start[n]) != (n in trainable), n
    trained = logits(wrapped, x)
    assert not torch.allclose(trained, before, rtol=0, atol=1e-4)
    assert model.config._attn_implementation == name

    wrapped.save_pretrained(tmp_path / "adapter")
    files = {p.name for p in (tmp_path / "adapter").iterdir()}
    assert "adapter_model.safetensors" in files and "adapter_model.bin" not in files
    saved = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert saved and all(marker[:-1] in k for k in saved)  # the adapter's weights, nothing of the base
    calls.clear()
    reloaded = PeftModel.from_pretrained(build(name), tmp_path / "adapter").eval()
    assert torch.equal(logits(reloaded, x), trained)
    assert_method_ran(calls, name, 1)
    on_stock = PeftModel.from_pretrained(stock_twin(build(name)), tmp_path / "adapter").eval()
    assert not torch.allclose(logits(on_stock, x), trained, rtol=0, atol=1e-4)

    tokens = greedy(wrapped, x)
    merged = wrapped.merge_and_unload()
    assert type(merged) is LlamaForCausalLM and merged.config._attn_implementation == name
    assert not any(marker in n for n, _ in merged.named_parameters())
    calls.clear()
    merged_logits = logits(merged, x)
    assert_method_ran(calls, name, 1)
    torch.testing.assert_close(merged_logits, trained, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(logits(stock_twin(merged), x), merged_logits, rtol=0, atol=1e-4)
    calls.clear()
    assert torch.equal(greedy(merged, x), tokens) and tokens.shape == (2, 14)
    assert [c[:4] for c in calls] == [(name, i, True, None) for _ in range(6) for i in range(LAYERS)]
    assert [c[4] for c in calls] == [8] * LAYERS + [1] * 5 * LAYERS


def gains_named(model):
    """{layer.kind: the gain's raw parameter} of the gains modules the attention layers use (through peft)."""
    out = {}
    for i, layer in enumerate(model.model.layers):
        gains = layer.self_attn.attention_params
        for k in "pid":
            out[f"{i}.{k}"] = getattr(gains, f"lambda_{k}_raw")
    return out


def test_learnable_gains_train_beside_the_adapter_and_are_saved_reloaded_and_merged(calls, tmp_path):
    x = hf_ids(2, 8)
    model = build("pid", LEARN)
    initial = {k: v.detach().clone() for k, v in gains_named(model).items()}
    assert len(initial) == 3 * LAYERS and len(ph.gain_parameter_names(model)) == 3 * LAYERS
    before = logits(model, x)
    wrapped = get_peft_model(model, ADAPTERS["lora"][0](modules_to_save=["attention_params"]))
    assert torch.equal(logits(wrapped, x), before)

    trainable = {n for n, p in wrapped.named_parameters() if p.requires_grad}
    gain_names = {n for n in trainable if ".attention_params." in n}
    assert gain_names == {f"base_model.model.model.layers.{i}.self_attn.attention_params.modules_to_save.default."
                          f"lambda_{k}_raw" for i in range(LAYERS) for k in "pid"}
    assert all("lora_" in n for n in trainable - gain_names)
    frozen_originals = {n for n, p in wrapped.named_parameters() if ".attention_params.original_module." in n}
    assert len(frozen_originals) == 3 * LAYERS and not frozen_originals & trainable

    wrapped.train()
    wrapped(input_ids=x, labels=x).loss.backward()
    grads = {n: p.grad for n, p in wrapped.named_parameters() if n in gain_names}
    assert all(g is not None for g in grads.values())
    zero = {n for n, g in grads.items() if torch.count_nonzero(g) == 0}
    assert zero == {"base_model.model.model.layers.0.self_attn.attention_params.modules_to_save.default.lambda_d_raw"}
    wrapped.zero_grad()
    start = snapshot(wrapped)
    train(wrapped, x, steps=3)
    for n, p in wrapped.named_parameters():
        assert torch.equal(p, start[n]) == (n not in trainable or n in zero), n
    learned = {k: v.detach().clone() for k, v in gains_named(model).items()}
    assert sum(not torch.equal(learned[k], initial[k]) for k in learned) == 3 * LAYERS - 1
    trained = logits(wrapped, x)
    assert calls and all(c[0] == "pid" and c[2] for c in calls)
    wrappers = [layer.self_attn.attention_params for layer in model.model.layers]
    assert all(type(w).__name__ == "ModulesToSaveWrapper" for w in wrappers)
    ph.convert(model, "pid")
    assert [layer.self_attn.attention_params for layer in model.model.layers] == wrappers
    assert torch.equal(logits(wrapped, x), trained)

    wrapped.save_pretrained(tmp_path / "adapter")
    saved = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    for i in range(LAYERS):
        for k in "pid":
            key = f"base_model.model.model.layers.{i}.self_attn.attention_params.lambda_{k}_raw"
            assert torch.equal(saved[key], learned[f"{i}.{k}"]), key
    fresh = build("pid", LEARN)
    assert all(torch.equal(v, initial[k]) for k, v in gains_named(fresh).items())
    reloaded = PeftModel.from_pretrained(fresh, tmp_path / "adapter").eval()
    assert all(torch.equal(v, learned[k]) for k, v in gains_named(fresh).items())
    assert torch.equal(logits(reloaded, x), trained)

    merged = reloaded.merge_and_unload()
    assert all(isinstance(layer.self_attn.attention_params, PIDGains) for layer in merged.model.layers)
    assert all(torch.equal(v, learned[k]) for k, v in gains_named(merged).items())
    assert len(ph.gain_parameter_names(merged)) == 3 * LAYERS
    torch.testing.assert_close(logits(merged, x), trained, rtol=1e-5, atol=1e-5)
    merged.save_pretrained(tmp_path / "merged")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    assert again.config._attn_implementation == "pid" and again.config.pid["learnable"] is True
    assert torch.equal(logits(again, x), logits(merged, x))


@pytest.mark.slow
def test_trainer_keeps_the_gains_peft_trains_out_of_weight_decay(tmp_path):
    """NoGainDecayTrainerMixin over a PeftModel."""
    wrapped = get_peft_model(build("pid", LEARN), ADAPTERS["lora"][0](modules_to_save=["attention_params"]))
    args = TrainingArguments(output_dir=str(tmp_path), weight_decay=0.1, report_to="none", use_cpu=True)
    names = {id(p): n for n, p in wrapped.named_parameters()}

    def groups(trainer_cls):
        opt = trainer_cls(model=wrapped, args=args).create_optimizer()
        return {g["weight_decay"]: {names[id(p)] for p in g["params"]} for g in opt.param_groups}

    class PIDTrainer(ph.NoGainDecayTrainerMixin, Trainer):
        pass

    gains = {n for n, p in wrapped.named_parameters() if p.requires_grad and ".attention_params." in n}
    plain, ours = groups(Trainer), groups(PIDTrainer)
    assert len(gains) == 3 * LAYERS and gains <= plain[0.1]  # the plain Trainer decays them
    assert ours[0.0] == plain.get(0.0, set()) | gains and ours[0.1] == plain[0.1] - gains
    originals = {n.replace(".modules_to_save.default.", ".original_module.") for n in gains}
    assert set(ph.gain_parameter_names(wrapped)) == gains | originals


N = 3


@pytest.mark.parametrize("save_counter", [True, False], ids=["counter-in-adapter", "counter-in-base"])
def test_warm_up_advances_through_the_peft_model_as_without_it(save_counter, calls, tmp_path):
    x = hf_ids(2, 8)
    warm = {**LEARN, "warmup_steps": N}  # learnable gains too, trained beside the adapter
    plain = build("pid", warm)
    model = build("pid", warm)
    assert torch.equal(logits(model, x), logits(stock_twin(model), x))  # t = 0: the stock model
    saved_modules = ["attention_params", "attention_warmup"] if save_counter else ["attention_params"]
    wrapped = get_peft_model(model, ADAPTERS["lora"][0](modules_to_save=saved_modules))
    assert int(wrapped.attention_warmup.step) == 0 and wrapped.attention_warmup.warmup_steps == N

    def scales(seen):
        return [c[3] for c in seen if c[1] == 0]

    calls.clear()
    train(plain, x, steps=N + 1)
    without_peft = scales(calls)
    calls.clear()
    train(wrapped, x, steps=N + 1)
    assert scales(calls) == without_peft == [k / N for k in range(N)] + [1.0]
    assert int(wrapped.attention_warmup.step) == int(plain.attention_warmup.step) == N + 1
    trained = logits(wrapped, x)
    greedy(wrapped, x)  # eval forwards and generation do not count
    assert int(wrapped.attention_warmup.step) == N + 1
    calls.clear()
    logits(wrapped, x)
    assert scales(calls) == [1.0]

    wrapped.save_pretrained(tmp_path / "adapter")
    saved = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert ("base_model.model.attention_warmup.step" in saved) == save_counter
    reloaded = PeftModel.from_pretrained(build("pid", warm), tmp_path / "adapter").eval()
    if save_counter:  # t is restored with the adapter
        assert int(reloaded.attention_warmup.step) == N + 1
    else:  # the fresh base's counter starts at 0, so the reloaded model is the stock model plus the adapter...
        assert int(reloaded.attention_warmup.step) == 0
        assert not torch.allclose(logits(reloaded, x), trained, rtol=0, atol=1e-4)
        reloaded.attention_warmup.step.fill_(N)  # ... until t is set (through the PeftModel) to the end of the warm-up
    assert torch.equal(logits(reloaded, x), trained)

    merged = reloaded.merge_and_unload()
    assert isinstance(merged.attention_warmup, GainWarmup) and int(merged.attention_warmup.step) >= N
    torch.testing.assert_close(logits(merged, x), trained, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_the_counter_swap_is_found_once_and_a_plain_warm_up_model_is_not_rediscovered(monkeypatch):
    """Discovery runs again only when the counter module was replaced (peft wrapping it, merge_and_unload
    unwrapping it), once; a warm-up model whose counter moved to the outer model while it was built is not
    rediscovered at its first forward (a first forward under torch.compile traces no discovery)."""
    import pid_plugins.hf.discovery as discovery

    x = hf_ids(1, 5)
    model = build("pid", {**METHOD_CFG["pid"], "warmup_steps": N})
    runs = []
    original = discovery.discover
    monkeypatch.setattr(discovery, "discover", lambda m, *a, **kw: runs.append(type(m).__name__) or
                        original(m, *a, **kw))
    logits(model, x)
    assert runs == []
    wrapped = get_peft_model(model, ADAPTERS["lora"][0](modules_to_save=["attention_warmup"]))
    logits(wrapped, x), logits(wrapped, x)
    assert runs == ["LlamaForCausalLM"]
    merged = wrapped.merge_and_unload()
    logits(merged, x), logits(merged, x)
    assert runs == ["LlamaForCausalLM"] * 2


def test_gradient_checkpointing_under_peft_gives_the_same_gradients_and_refuses_reentrant():
    """Non-reentrant checkpointing gives the adapter's and the gains' gradients without it; reentrant is refused
    before any gradient, as without peft."""
    x = hf_ids(2, 8)

    def adapter_grads(checkpointing):
        model = build("pid", LEARN)
        if checkpointing is not None:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpointing)
        wrapped = get_peft_model(model, ADAPTERS["lora"][0](modules_to_save=["attention_params"]))
        wrapped.train()
        wrapped(input_ids=x, labels=x).loss.backward()
        return {n: p.grad for n, p in wrapped.named_parameters() if p.requires_grad}

    want = adapter_grads(None)
    got = adapter_grads({"use_reentrant": False})
    assert got.keys() == want.keys() and any(".attention_params." in n for n in got)
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-5, atol=1e-6, msg=n)
    with pytest.raises(ValueError, match="use_reentrant"):
        adapter_grads({"use_reentrant": True})
