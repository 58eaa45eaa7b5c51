"""The zoo contract: one parametrised test per property, run on every zoo (pid_plugins.testing's models: timm DeiT
and FAN, a transformers Llama with grouped-query attention and BERT, mmseg's whole Segmenter, fairseq's
transformer_lm) with every built-in method (tests/method_cases.py: fixed, learnable where it has learnable
parameters, with warm-up where it takes one) and the toy a user registers.

Properties: ``convert`` of a stock model (in place, the same tensors) is the model the zoo builds with the method;
method -> method is the model built with the second; back to ``softmax`` is the stock model bit for bit (its classes,
attributes, state_dict keys and outputs); learnable parameters are made on the model's dtype and mode, at the built
model's initial values, get gradients, are kept as trained and go with fixed parameters; ``finish_warmup`` keeps the
warmed-up function without the counter; refusals change nothing. The zero parameters (stock bit for bit) and the
save/load round trip run per method and model in tests/core/test_method_contract.py (the kit's cases). A zoo's own
files keep what is specific to it.
"""
from __future__ import annotations

import logging

import pytest
import torch

import pid_plugins
from method_cases import BUILTIN, METHODS, variants
from pid_plugins.core.warmup import GainWarmup
from pid_plugins.testing import MODELS, SEGMENTOR

pytestmark = pytest.mark.usefixtures("one_thread")

ZOOS = {n: MODELS[n] for n in ("timm-deit", "timm-fan", "hf-llama", "hf-bert", "fairseq-lm")}
ZOOS[SEGMENTOR.name] = SEGMENTOR
N = 3


@pytest.fixture(autouse=True)
def toy_registered():
    import toy_method  # noqa: F401


def variants_on(zoo, **kw):
    """The built-in methods with their "on" parameters on ``zoo`` (mmseg: its backbone's), learnable too."""
    return variants("mmseg-backbone" if zoo.name == SEGMENTOR.name else zoo.name, **kw)


def grid(select=lambda key, method, cfg: True, **kw):
    return [pytest.param(zoo, key, method, cfg, id=f"{zoo.name}-{key}") for zoo in ZOOS.values()
            for key, (method, cfg) in variants_on(zoo, **kw).items() if select(key, method, cfg)]


def layout(model, attributes=True):
    """Everything nn.Module keeps, per module below the root: class, plain attributes (transformers' converted and
    built models mark their own modules differently: ``attributes=False``), submodule/parameter/buffer names,
    train/eval mode."""
    return sorted((name, type(m).__name__, sorted(vars(m)) if attributes else [], sorted(m._modules),
                   sorted(m._parameters), sorted(m._buffers), m.training) for name, m in model.named_modules() if name)


def keys(zoo, model):
    """The state_dict's keys in order (FAN's own ``__init__`` makes its warm-up counter first, convert last)."""
    return (sorted if zoo.name == "timm-fan" else list)(model.state_dict())


def snapshot(zoo, model):
    """What a refused convert must leave unchanged, and what softmax must give back."""
    config = model.config.to_dict() if zoo.zoo == "hf" else None
    return (type(model), layout(model), list(model.state_dict()), config,
            {n: p.data_ptr() for n, p in model.named_parameters()})


def out(zoo, model, x=None):
    with torch.no_grad():
        return zoo.out(model, zoo.inputs() if x is None else x)


def gains(model):
    return {n: p for n, p in model.named_parameters() if ".attention_params." in n}


def counters(model):
    return {k: int(v) for k, v in model.state_dict().items() if k.endswith("attention_warmup.step")}


def n_layers(zoo, model):
    return model.config.num_hidden_layers if zoo.zoo == "hf" else len(zoo.attention_layers(model))


def train(zoo, model, steps):
    """``steps`` SGD steps of the zoo's training loss in training mode, then eval mode."""
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    model.train()
    for step in range(steps):
        opt.zero_grad()
        zoo.loss(model, zoo.inputs(next(model.parameters()).dtype, seed=2 + step)).backward()
        opt.step()
    model.eval()
    return model


# ================================================================================================ convert
@pytest.mark.parametrize("zoo, key, method, cfg", grid(warmup_steps=4))
def test_a_stock_model_converted_in_place_is_the_model_built_with_the_method(zoo, key, method, cfg):
    model = zoo.stock()
    params, root = dict(model.named_parameters()), type(model)
    y_stock = out(zoo, model)
    assert zoo.convert(model, method, cfg) is model and type(model) is root  # the root keeps its class
    assert all(p is params[n] for n, p in model.named_parameters() if n in params)  # the same tensors
    assert not any(m.training for m in model.modules())  # new modules follow the model's mode
    built = zoo.build(method, cfg, seed=7)
    # below the root: what the method's classes make, nothing else; the built model's keys, in its order
    assert layout(model, zoo.zoo != "hf") == layout(built, zoo.zoo != "hf") and keys(zoo, model) == keys(zoo, built)
    learned = BUILTIN[method].learned if (cfg or {}).get("learnable") else ()
    assert set(gains(model)) == set(gains(built)) and len(gains(model)) == len(learned) * n_layers(zoo, model)
    assert all(torch.equal(p, gains(built)[n]) for n, p in gains(model).items())  # at their initial values
    assert bool(counters(model)) == bool((cfg or {}).get("warmup_steps"))
    built.load_state_dict(model.state_dict(), strict=True)
    y = out(zoo, model)
    assert torch.equal(y, out(zoo, built))
    if counters(model):  # warm-up at t = 0: the stock function
        torch.testing.assert_close(y, y_stock, rtol=1e-6, atol=1e-6)
        train(zoo, model, 2), train(zoo, built, 2)  # a scale neither 0 nor 1, and trained weights
        assert set(counters(model).values()) == {2}
        built.load_state_dict(model.state_dict(), strict=True)
        assert torch.equal(out(zoo, model), out(zoo, built))
        zoo.convert(model, method, {**cfg, "warmup_steps": 8})  # another N: t carries over
        assert set(counters(model).values()) == {2}
        zoo.convert(model, method, {**cfg, "warmup_steps": 0})  # no warm-up: the counter goes
        assert not counters(model)
    else:
        assert not torch.equal(y, y_stock)  # the method is on


@pytest.mark.parametrize("zoo, key, method, cfg", grid(lambda key, method, cfg: key in (
    "pid", "learnable_pid", "pid_warmup", "twicing", "elliptical", "learnable_value_residual"), warmup_steps=4))
def test_back_to_softmax_is_the_stock_model_bit_for_bit(zoo, key, method, cfg):
    model = zoo.stock()
    pristine, y_stock = snapshot(zoo, model), out(zoo, model)
    zoo.convert(model, method, cfg)
    zoo.convert(model, "neutreno", variants_on(zoo)["neutreno"][1])  # method -> method, in place
    zoo.convert(model, method, cfg)
    out(zoo, model)
    assert zoo.convert(model, "softmax") is model
    assert snapshot(zoo, model) == pristine  # every class, attribute, parameter and buffer we added is gone
    assert torch.equal(out(zoo, model), y_stock)
    if zoo.zoo == "hf":
        assert model.config._attn_implementation == "sdpa" and set(vars(model.config)) == set(vars(zoo.stock().config))
    assert snapshot(zoo, zoo.convert(model, "softmax")) == pristine  # softmax on a stock model: nothing to do
    fresh = zoo.stock()  # ... which trains as the zoo's own: gradients bit for bit
    for m in (model, fresh):
        zoo.loss(m.train(), zoo.inputs()).backward()
    assert all((p.grad is None and q.grad is None) or torch.equal(p.grad, q.grad)
               for p, q in zip(model.parameters(), fresh.parameters()))
    if method == "pid":  # switched back: the zoo's preset, not the gains it had before
        preset = zoo.build("pid", None, seed=7)
        preset.load_state_dict(zoo.convert(model.eval(), "pid").state_dict(), strict=True)
        assert torch.equal(out(zoo, model), out(zoo, preset))
        assert zoo.zoo != "hf" or METHODS["pid"].config(model.config.pid, "hf") == METHODS["pid"].config(None, "hf")


@pytest.mark.parametrize("zoo", ZOOS.values(), ids=list(ZOOS))
@pytest.mark.parametrize("first, then", [("pid", "elliptical"), ("learnable_value_residual", "neutreno"),
                                         ("neutreno", "learnable_pid"), ("learnable_pid", "pid"),
                                         ("value_residual", "scaled_reference")])
def test_method_to_method_is_the_model_built_with_the_second(zoo, first, then):
    chosen = {**variants_on(zoo), "scaled_reference": ("scaled_reference", {"gamma": 0.3})}
    chosen["pid"] = ("pid", {**(chosen["pid"][1] or {}), "learnable": False})  # transformers: a dict overrides
    model = zoo.stock()
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    zoo.convert(model, *chosen[first])
    out(zoo, model)
    zoo.convert(model, *chosen[then])
    built = zoo.build(*chosen[then], seed=7)
    assert layout(model, zoo.zoo != "hf") == layout(built, zoo.zoo != "hf") and keys(zoo, model) == keys(zoo, built)
    built.load_state_dict(model.state_dict(), strict=True)
    assert torch.equal(out(zoo, model), out(zoo, built))
    assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items() if k in weights)  # stock weights


@pytest.mark.parametrize("zoo", ZOOS.values(), ids=list(ZOOS))
def test_refusals_come_before_any_change(zoo):
    model = zoo.convert(zoo.stock(), "pid", {"lambda_p": 0.3})
    before = snapshot(zoo, model)
    for args, error, match in [(("nope",), ValueError, r"unknown attention method 'nope'.*'scaled_reference'"),
                               (("pid", {"lambda_q": 1.0}), ValueError, "lambda_q"),
                               (("pid", {"lambda_d": -0.1}), ValueError, "PIDConfig.lambda_d"),
                               (("neutreno", {"learnable": True}), ValueError, "learnable"),
                               (("scaled_reference", {"gamma": float("nan")}), ValueError, "gamma must be finite")]:
        with pytest.raises(error, match=match):
            zoo.convert(model, *args)
        assert snapshot(zoo, model) == before, args
    with pytest.raises(TypeError, match="before torch.compile"):
        zoo.convert(torch.compile(model), "neutreno")
    assert snapshot(zoo, model) == before


# ================================================================================================ learnable
@pytest.mark.parametrize("zoo, key, method, cfg", grid(lambda key, method, cfg: key.startswith("learnable_")))
def test_learnable_parameters_train_are_kept_as_trained_and_go(zoo, key, method, cfg):
    """Made on the model's dtype; in float64 the model with them equals the fixed model at those values; each gets a
    gradient and moves with an optimizer step; transformers' ``convert`` keeps them as trained; ``convert`` with
    fixed parameters removes them (the stock keys again)."""
    model = zoo.stock().double()
    keys = list(model.state_dict())
    zoo.convert(model, method, cfg)
    assert gains(model) and all(p.dtype == torch.float64 for p in gains(model).values())
    fixed = zoo.convert(zoo.stock().double(), method, {k: v for k, v in cfg.items() if k != "learnable"})
    x = zoo.inputs(torch.float64)
    torch.testing.assert_close(out(zoo, model, x), out(zoo, fixed, x), rtol=1e-6, atol=1e-7)
    before = {n: p.clone() for n, p in gains(model).items()}
    train(zoo, model, 1)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in gains(model).values())
    moved = [n for n, p in gains(model).items() if not torch.equal(p, before[n])]
    assert len(moved) >= len(before) // 2, moved
    if zoo.zoo == "hf":  # a dict overrides the model's config.<method>: still learnable, kept as trained
        trained = {n: p.clone() for n, p in gains(model).items()}
        zoo.convert(model, method, {})
        assert gains(model).keys() == trained.keys()
        assert all(torch.equal(p, trained[n]) for n, p in gains(model).items())
    zoo.convert(model.train(), method, cfg)  # made in the model's mode
    assert all(m.training for n, m in model.named_modules() if n.endswith("attention_params"))
    zoo.convert(model.eval(), method, {**cfg, "learnable": False})
    assert not gains(model) and [k for k in model.state_dict() if "pid_plugins_method" not in k] == keys


def per_layer(model, method, cfg):
    """Distinct values in each layer's learnable parameters (float64 model); the float64 rule that reads them."""
    import math

    import zoo_cases as zc

    layers = [m for n, m in model.named_modules() if n.endswith("attention_params")]
    values = []
    with torch.no_grad():
        for i, g in enumerate(layers):
            if method == "pid":
                values.append((0.6 - 0.1 * i, 0.2 + 0.15 * i, 0.05 + 0.1 * i))
                for name, gain in zip(("lambda_p_raw", "lambda_i_raw", "lambda_d_raw"), values[-1]):
                    getattr(g, name).fill_(gain + math.log(-math.expm1(-gain)))  # softplus(raw) = gain
            else:
                values.append((0.3 + 0.2 * i, 0.9 - 0.15 * i))
                g.lambda_1.fill_(values[-1][0]), g.lambda_2.fill_(values[-1][1])
    assert len(layers) >= 2 and set(BUILTIN) - {"pid", "value_residual"} == {
        n for n, m in BUILTIN.items() if not m.learnable}, "a new learnable method: give it values and a rule here"
    if method == "value_residual":
        return zc.value_residual_rule(values)
    from reference import naive_pid_stack

    beta = METHODS["pid"].config(cfg, "hf").beta
    return zc.on_outputs(lambda outs, vs: naive_pid_stack(outs, vs, *values[len(outs) - 1], beta)[-1])


@pytest.mark.parametrize("model_case", MODELS.values(), ids=list(MODELS))
@pytest.mark.parametrize("method", ["pid", "value_residual"])
def test_learned_values_per_layer_follow_the_rule_in_float64(model_case, method):
    """Each layer reads its own learnable parameters: set apart per layer, the model matches the float64 rule with
    each layer's values (the stock modules by hand, tests/zoo_cases.py), and differs from its initial values."""
    cfg = {**(variants(model_case.name)[method][1] or {}), "learnable": True}
    model, stock = (m.double() for m in model_case.pair(method, cfg))
    x = model_case.inputs(torch.float64)
    initial = out(model_case, model, x)
    rule = per_layer(model, method, cfg)
    with torch.no_grad():
        want = model_case.reference(stock, x, rule)
    got = out(model_case, model, x)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    assert (got - initial).abs().max() > 1e-6


# ================================================================================================ finish_warmup
@pytest.mark.parametrize("converted", [False, True], ids=["built", "converted"])
@pytest.mark.parametrize("zoo, key, method, cfg", grid(lambda key, method, cfg: METHODS[method].warmup))
def test_finish_warmup_keeps_the_warmed_up_function_without_the_counter(zoo, key, method, cfg, converted, tmp_path):
    """Trained past N warm-up steps, then finished: the same outputs, no counter (a training forward counts nothing),
    ``warmup_steps=0`` in the config, learnable parameters as trained; the model built without warm-up, loaded with
    its weights, computes the same (timm and transformers bit for bit; mmseg and fairseq keep their stock-plus-term
    form, up to the rounding of the fused attention)."""
    warm = {**(cfg or {}), "warmup_steps": N}
    model = zoo.convert(zoo.stock(), method, warm) if converted else zoo.build(method, warm)
    train(zoo, model, N + 1)
    assert set(counters(model).values()) == {N + 1}
    want, trained = out(zoo, model), {n: p.clone() for n, p in gains(model).items()}
    assert pid_plugins.finish_warmup(model) is model
    assert not counters(model) and not any("attention_warmup" in k for k in model.state_dict())
    held = [(n, k) for n, m in model.named_modules() for k, v in {**vars(m), **m._modules}.items()
            if isinstance(v, GainWarmup)]  # timm's converted root: blocks.warmup_counter, attention_warmup
    assert not held, held
    if zoo.zoo == "hf":
        assert getattr(model.config, method)["warmup_steps"] == 0
    else:
        assert all(config.warmup_steps == 0 for _, config in zoo.configs(model))
    assert torch.equal(out(zoo, model), want)
    assert all(torch.equal(p, trained[n]) for n, p in gains(model).items())
    plain = zoo.build(method, cfg, seed=1)
    assert keys(zoo, model) == keys(zoo, plain)
    plain.load_state_dict(model.state_dict(), strict=True)
    tol = (0, 0) if zoo.zoo in ("timm", "hf") else (1e-5, 1e-5)
    torch.testing.assert_close(out(zoo, plain), want, rtol=tol[0], atol=tol[1])
    if zoo.zoo == "hf":
        model.save_pretrained(tmp_path)
        reloaded = type(model).from_pretrained(tmp_path).eval()
        assert getattr(reloaded.config, method)["warmup_steps"] == 0 and not counters(reloaded)
        assert torch.equal(out(zoo, reloaded), want)
    train(zoo, model, 1)
    assert not counters(model)


@pytest.mark.parametrize("zoo", ZOOS.values(), ids=list(ZOOS))
def test_finish_warmup_stopped_early_warns_and_a_stock_model_is_refused(zoo, caplog):
    """Stopped at t = 1 of N: one warning, the model at its final parameters (the same weights at t = N); a model
    without warm-up is unchanged; a stock model is refused."""
    model = train(zoo, zoo.build("pid", {"warmup_steps": N}), 1)
    at_the_end = zoo.build("pid", {"warmup_steps": N}, seed=1)
    at_the_end.load_state_dict({k: v.clone().fill_(N) if k.endswith("attention_warmup.step") else v
                                for k, v in model.state_dict().items()})
    with caplog.at_level(logging.WARNING):
        pid_plugins.finish_warmup(model)
    assert f"had warmed up 1 of {N} steps" in caplog.text
    assert torch.equal(out(zoo, model), out(zoo, at_the_end))
    fixed = zoo.build("pid", None)
    want, keys = out(zoo, fixed), list(fixed.state_dict())
    assert pid_plugins.finish_warmup(fixed) is fixed
    assert list(fixed.state_dict()) == keys and torch.equal(out(zoo, fixed), want)
    if zoo.name != "timm-fan":  # fan_* names build pid-plugins' own FAN class
        with pytest.raises(TypeError, match="has no attention method of pid-plugins"):
            pid_plugins.finish_warmup(zoo.stock())
