"""transformers adapter."""
import warnings

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")
import pid_plugins.hf as ph  # noqa: E402
import transformers as T  # noqa: E402

V = 96
LEARN = {"lambda_p": 0.6, "lambda_i": 0.3, "lambda_d": 0.0, "beta": 0.4, "learnable": True}  # lambda_d 0 -> 1e-4


def llama_config(pid=LEARN, **kw):
    args = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=32, pad_token_id=0)
    if pid is not None:
        args.update(attn_implementation="pid", pid=pid)
    return T.LlamaConfig(**{**args, **kw})


def ids(n=2, length=8, seed=1):
    return torch.randint(3, V, (n, length), generator=torch.Generator().manual_seed(seed))


def gains_of(model):
    return {n: p for n, p in model.named_parameters() if ".attention_params." in n}


def spread_gains(model, seed=0):
    """Give every layer's gains its own values (so a test sees which layer's gains were used)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in gains_of(model).values():
            p.copy_(torch.empty_like(p).uniform_(-2.0, 0.5, generator=g))


def learned(model, path):
    """(lambda_p, lambda_i, lambda_d) of the gains module at ``path`` as floats."""
    return tuple(F.softplus(getattr(model.get_submodule(path), f"{k}_raw")).item()
                 for k in ("lambda_p", "lambda_i", "lambda_d"))


def test_one_gains_module_per_self_attention_layer_made_at_construction_and_saved(tmp_path):
    from safetensors.torch import load_file

    model = T.LlamaForCausalLM(llama_config())
    names = {f"model.layers.{i}.self_attn.attention_params.lambda_{k}_raw" for i in range(3) for k in "pid"}
    assert set(gains_of(model)) == names
    model.save_pretrained(tmp_path)
    assert {k for k in load_file(tmp_path / "model.safetensors") if "attention_params" in k} == names
    assert all(p.shape == (1,) and p.requires_grad for p in gains_of(model).values())
    for i in range(3):  # softplus-positive, from the config; a gain 0 starts at 1e-4
        torch.testing.assert_close(torch.tensor(learned(model, f"model.layers.{i}.self_attn.attention_params")),
                                   torch.tensor([0.6, 0.3, 1e-4]), rtol=1e-5, atol=0)
    assert not gains_of(T.LlamaForCausalLM(llama_config(pid={"lambda_p": 0.6})))  # fixed gains: no parameters
    assert not gains_of(T.LlamaForCausalLM(llama_config(pid=None, attn_implementation="sdpa")))


@pytest.mark.slow
def test_torch_compile_fullgraph_trains_the_gains_like_eager():
    torch.manual_seed(0)
    model = T.LlamaForCausalLM(llama_config()).train()
    spread_gains(model)
    x = ids()
    out = model(x, labels=x)  # eager (also discovers the layers)
    out.loss.backward()
    eager = {n: p.grad.clone() for n, p in gains_of(model).items()}
    model.zero_grad()
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")  # a graph break raises
    out_c = compiled(x, labels=x)
    out_c.loss.backward()
    torch.testing.assert_close(out_c.logits, out.logits, rtol=1e-5, atol=1e-5)
    for name, grad in eager.items():
        torch.testing.assert_close(gains_of(model)[name].grad, grad, rtol=1e-4, atol=1e-7, msg=name)


def test_a_softmax_checkpoint_loads_into_learnable_pid_with_the_configs_gains(tmp_path):
    torch.manual_seed(0)
    stock = T.LlamaForCausalLM(llama_config(pid=None)).eval()
    stock.save_pretrained(tmp_path)
    config = T.AutoConfig.from_pretrained(tmp_path)
    config.pid = {**LEARN, "lambda_d": 0.2}
    model, info = T.AutoModelForCausalLM.from_pretrained(tmp_path, config=config, attn_implementation="pid",
                                                         output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]  # the gains' absence is expected
    assert len(gains_of(model)) == 9
    for i in range(3):  # transformers materialised the missing gains: they hold the config's values, not garbage
        torch.testing.assert_close(torch.tensor(learned(model, f"model.layers.{i}.self_attn.attention_params")),
                                   torch.tensor([0.6, 0.3, 0.2]), rtol=1e-6, atol=0)
    sd = stock.state_dict()
    assert all(torch.equal(sd[k], v) for k, v in model.state_dict().items() if k in sd)
    fixed = T.LlamaForCausalLM(llama_config(pid={**config.pid, "learnable": False})).eval()
    fixed.load_state_dict(sd)
    x = ids()
    with torch.no_grad():  # at init, learnable gains compute what the fixed ones do
        torch.testing.assert_close(model(x).logits, fixed(x).logits, rtol=1e-5, atol=1e-6)


def test_config_pid_made_learnable_after_the_first_forward_adds_the_gains_with_a_warning():
    model = T.LlamaForCausalLM(llama_config(pid={"lambda_p": 0.5}))
    x = ids()
    model(x)
    model.config.pid = {"learnable": True}
    with pytest.warns(UserWarning, match="before building the optimizer"):
        model(x)
    assert len(gains_of(model)) == 9
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(x)  # once


def test_trainer_weight_decay_groups(tmp_path):
    model = T.LlamaForCausalLM(llama_config())
    args = T.TrainingArguments(output_dir=str(tmp_path), weight_decay=0.1, report_to="none", use_cpu=True)
    names = {id(p): n for n, p in model.named_parameters()}

    def groups(trainer_cls):
        opt = trainer_cls(model=model, args=args).create_optimizer()
        return {g["weight_decay"]: {names[id(p)] for p in g["params"]} for g in opt.param_groups}

    plain = groups(T.Trainer)
    gains = set(gains_of(model))
    assert gains <= plain[0.1]  # transformers' Trainer alone decays them (it excludes bias / norm names only)

    class PIDTrainer(ph.NoGainDecayTrainerMixin, T.Trainer):
        pass

    ours = groups(PIDTrainer)
    assert ours[0.0] == plain[0.0] | gains and ours[0.1] == plain[0.1] - gains
    assert ph.decay_parameter_names(["a.weight", *gains]) == ["a.weight"]
    assert set(ph.gain_parameter_names(model)) == gains


def test_every_family_builds_its_gains_where_discovery_finds_self_attention_and_uses_each_one():
    """Built with a learnable config.pid, each family of test_hf_families gets gains on exactly the modules the
    first forward's discovery marks as self-attention (none on cross-attention, no late additions), and one
    backward reaches every gain (so DDP never meets an unused parameter)."""
    from test_hf_families import FAMILIES, inputs, loss_of

    from pid_plugins.hf import attention

    for family, (make, cls, _, base, _) in FAMILIES.items():
        config = make()
        config.pid, config._attn_implementation, config.attention_base = {"learnable": True}, "pid", base
        torch.manual_seed(0)
        model = cls(config).train()
        built = sorted({n.rsplit(".attention_params.", 1)[0] for n in gains_of(model)})
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no gains added at the first forward
            loss_of(model, family, inputs(family)).backward()
        roles = {n: getattr(m, attention.ROLE, None) for n, m in model.named_modules()}
        assert built == sorted(n for n, r in roles.items() if r is not None and r >= 0) and built, family
        assert any(r == -1 for r in roles.values()) == (family in ("bart", "t5", "whisper")), family
        assert all(p.grad is not None for p in gains_of(model).values()), family


def test_learnable_gains_under_warm_up_are_scaled_by_t_over_n():
    """Learnable gains and warm-up together."""
    torch.manual_seed(0)
    model = T.LlamaForCausalLM(llama_config(pid={**LEARN, "warmup_steps": 4})).double()
    spread_gains(model)
    stock = T.LlamaForCausalLM(llama_config(pid=None, attn_implementation="sdpa")).double()
    stock.load_state_dict({k: v for k, v in model.state_dict().items() if k in stock.state_dict()})
    x = ids()
    model.eval(), stock.eval()
    with torch.no_grad():
        assert torch.equal(model(x).logits, stock(x).logits)  # t = 0
    model.train()
    for _ in range(3):
        model(x).logits.sum().backward()
    assert int(model.attention_warmup.step) == 3
    model.eval()
    fixed = []  # each layer's learned gains x 3/4
    for i in range(3):
        lp, li, ld = learned(model, f"model.layers.{i}.self_attn.attention_params")
        fixed.append((0.75 * lp, 0.75 * li, 0.75 * ld))
    import pid_plugins.core.pid as A  # the PID method's update: the rule's entry

    calls = []
    original = A.PIDMethod.update

    def check(self, params, out, value, state, scale, head_dim):
        layer = len(calls)
        calls.append(layer)
        assert float(scale) == 0.75
        want, _ = original(self, (*fixed[layer], 0.4, True), out, value, state, None, head_dim)
        got, new = original(self, params, out, value, state, scale, head_dim)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        return got, new

    A.PIDMethod.update = check
    try:
        with torch.no_grad():
            model(x)
    finally:
        A.PIDMethod.update = original
    assert calls == [0, 1, 2]
