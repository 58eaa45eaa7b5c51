"""The method registry and the one policy every adapter applies (pid_plugins.core.methods)."""
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

import pid_plugins
from method_cases import BUILTIN
from pid_plugins import AttentionMethod, MethodConfig, PIDConfig, PIDGains, PIDState, pid_update
from pid_plugins.core import resolve_attention
from pid_plugins.core.checkpoint import check_keys, unwrap_state_dict
from pid_plugins.core.methods import LayerCall, on_register
from pid_plugins.core.pid import PIDMethod
from toy_method import NAME, ScaledReferenceConfig


def sdpa_attend(k):
    r = None

    def attend(q, v):
        nonlocal r
        r = q.shape[-3] // v.shape[-3]
        return F.scaled_dot_product_attention(q, k.repeat_interleave(r, -3), v.repeat_interleave(r, -3))
    return attend


def apply(method, cfg, attend, q, v, state, layer):
    """One layer through the one path every adapter takes (``AttentionMethod.apply``)."""
    return method.apply(cfg, None, LayerCall(attend, q, v, v, layer=layer), state)


def test_registry_lists_pid_and_user_methods():
    assert {"pid", NAME, *BUILTIN} <= set(pid_plugins.list_methods())
    assert isinstance(pid_plugins.get_method("pid"), PIDMethod)
    with pytest.raises(ValueError, match="unknown attention method 'nope'.*'softmax'.*'pid'"):
        pid_plugins.get_method("nope")


def test_register_refuses_bad_methods_and_silent_replacement():
    class Bad(AttentionMethod):
        name = "softmax"
        config_type = ScaledReferenceConfig
        state_fields = ()

    with pytest.raises(ValueError, match="'softmax' is taken by pid_plugins: the stock attention"):
        pid_plugins.register_method(Bad())
    with pytest.raises(TypeError, match="AttentionMethod instance"):
        pid_plugins.register_method(object())

    class Other(AttentionMethod):
        name = NAME
        config_type = ScaledReferenceConfig
        state_fields = ("v_first",)

    with pytest.raises(ValueError, match="already registered; pass replace=True"):
        pid_plugins.register_method(Other())


def test_listeners_see_past_and_future_registrations():
    seen = []
    on_register(lambda m: seen.append(m.name))
    assert {"pid", NAME} <= set(seen)

    @dataclass(frozen=True)
    class Cfg(MethodConfig):
        weight: float = 1.0
        PRESETS = {"default": {"weight": 1.0}}

    class Late(AttentionMethod):
        name = "late_toy"
        config_type = Cfg
        state_fields = ()
        default_presets = {"*": "default"}

        def update(self, params, out, value_q, state, scale, head_dim):
            return out * params.weight, ()

    pid_plugins.register_method(Late(), replace=True)
    assert seen[-1] == "late_toy" and "late_toy" in pid_plugins.list_methods()


def test_resolve_attention_is_the_one_policy():
    assert resolve_attention("softmax", zoo="timm") is None
    choice = resolve_attention("pid", None, zoo="mmseg")
    assert choice.config == PIDConfig.preset("segmenter")
    assert resolve_attention("pid", None, zoo="hf").config == PIDConfig.preset("lm")
    assert resolve_attention("pid", None, zoo="timm").config == PIDConfig.preset("deit")
    assert resolve_attention("pid", {"lambda_p": 0.1}, zoo="timm").config == PIDConfig.preset("deit", lambda_p=0.1)
    assert resolve_attention(None, "lm", zoo="timm").config == PIDConfig.preset("lm")
    assert resolve_attention(NAME, "strong", zoo="timm").config == ScaledReferenceConfig(gamma=2.0)
    # a method's name where its parameters go: the message names the right argument
    with pytest.raises(ValueError, match="attention_cfg='twicing' names an attention method, not parameters of 'pid': "
                                         "pass the method as attention='twicing'"):
        resolve_attention("pid", "twicing", zoo="timm")
    with pytest.raises(ValueError, match="--attention-cfg='softmax' names an attention method"):
        resolve_attention(NAME, "softmax", zoo="fairseq", params_name="--attention-cfg")
    assert resolve_attention("pid", "neutreno", zoo="timm").config == PIDConfig.preset("neutreno")  # PID's own preset
    with pytest.raises(ValueError, match="the backbone: learnable gains are not supported here"):
        resolve_attention("pid", {"learnable": True}, zoo="mmseg", learnable=False, where="the backbone")
    with pytest.raises(ValueError, match="ScaledReferenceConfig.gamma must be float"):
        resolve_attention(NAME, {"gamma": "x"}, zoo="timm")
    with pytest.raises(ValueError, match="unknown ScaledReferenceConfig preset"):
        resolve_attention(NAME, "nope", zoo="timm")


def test_softmax_ignores_the_recipes_method_parameters_in_one_warning(caplog):
    """The A/B flip: attention='softmax' with the parameters still in the recipe is the stock attention."""
    for params, named in (({"lambda_p": 1.0, "warmup_steps": 9}, "attention_cfg={'lambda_p', 'warmup_steps'}"),
                          ("deit", "attention_cfg='deit' (a preset)"), (PIDConfig(), "attention_cfg=PIDConfig(...)")):
        caplog.clear()
        with caplog.at_level("WARNING", logger="pid_plugins"):
            assert resolve_attention("softmax", params, zoo="timm", where="my model") is None
        assert [r.getMessage() for r in caplog.records] == [
            f"my model: attention='softmax', the stock attention: the method parameters also given ({named}) are "
            "not used"]
    caplog.clear()
    with caplog.at_level("WARNING", logger="pid_plugins"):
        assert resolve_attention("softmax", zoo="timm") is None
    assert not caplog.records


def test_pid_method_is_pid_update_bit_for_bit():
    torch.manual_seed(0)
    method, cfg = pid_plugins.get_method("pid"), PIDConfig.preset("deit")
    q, k = torch.randn(2, 4, 6, 8), torch.randn(2, 2, 6, 8)
    values = [torch.randn(2, 2, 6, 8) for _ in range(3)]
    state_a = state_b = None
    for i, v in enumerate(values):
        out = sdpa_attend(k)(q, v)
        want, state_a = pid_update(out, v, state_a, cfg)
        got, state_b = apply(method, cfg, sdpa_attend(k), q, v, state_b, i)
        assert torch.equal(got, want)
        # between a model's layers under grouped-query attention the state has a size-1 group dimension
        assert isinstance(state_b, PIDState) and all(
            (a is None and b is None) or (b.shape == (2, 2, 1, 6, 8) and torch.equal(a, b.reshape(a.shape)))
            for a, b in zip(state_a, state_b))
    # pid_update takes the grouped state too (a warm-up or learnable layer after a fixed-gain one), and refuses a
    # grouped state of other shapes
    assert torch.equal(pid_update(out, v, state_b, cfg)[0], pid_update(out, v, state_a, cfg)[0])
    with pytest.raises(ValueError, match="every layer of a PID group"):
        pid_update(out, v, PIDState(*(t.reshape(2, 1, 2, 6, 8) for t in state_b)), cfg)
    # learned gains: the layer's three gains, beta and the first-layer rule from the config
    learned = PIDGains(cfg.replace(learnable=True))
    lp, li, ld = learned()[:3]
    assert method.layer_params(cfg.replace(beta=0.3), learned)[3:] == (0.3, True)
    assert method.layer_params(cfg, None) is cfg
    assert method.make_learned(cfg) is None and isinstance(method.make_learned(cfg.replace(learnable=True)), PIDGains)
    # warm-up: the term scaled by the warm-up factor; the separate term of an additive method
    scale = torch.tensor(0.25, dtype=torch.float64)
    v = torch.randn(2, 4, 6, 8)
    out = sdpa_attend(v)(q, v)
    scaled, _ = method.update(cfg, out, v, None, scale, -3)
    term, _ = method.update(cfg, torch.zeros_like(v), v, None, scale, -3)  # an additive method's term
    torch.testing.assert_close(scaled, out + term, rtol=0, atol=1e-6)
    assert torch.equal(scaled, pid_update(out, v, None, cfg, scale=scale)[0])
    # the scale multiplies the term: the gains scaled instead give the same up to rounding (at scale 1 bit for bit
    # the fixed-gain one: test_core_control.py)
    torch.testing.assert_close(scaled, pid_update(out, v, None, (*(g * scale for g in cfg.gains[:3]), cfg.beta, True))[0],
                               rtol=0, atol=1e-6)


def test_method_config_round_trips_and_validates():
    cfg = ScaledReferenceConfig.coerce({"gamma": 1})
    assert cfg == ScaledReferenceConfig(gamma=1.0) and isinstance(cfg.gamma, float)
    assert ScaledReferenceConfig.from_dict(cfg.to_dict()) == cfg
    assert ScaledReferenceConfig.coerce({"preset": "strong"}).gamma == 2.0
    # (its rule against the loop statement: the contract's float64 reference in every zoo, tests/toy_method.py)
    method = pid_plugins.get_method(NAME)
    assert method.is_identity(ScaledReferenceConfig(gamma=0.0)) and not method.is_identity(cfg)
    with pytest.raises(ValueError, match="must be finite"):
        ScaledReferenceConfig(gamma=float("inf"))
    with pytest.raises(ValueError, match="unknown ScaledReferenceConfig field"):
        ScaledReferenceConfig.from_dict({"alpha": 1.0})


def test_checkpoint_unwrapping_has_one_precedence_and_strict_keys_name_the_difference():
    w = {"a": torch.zeros(1)}
    assert unwrap_state_dict(w) == w
    assert unwrap_state_dict({"model": w}) == w
    assert unwrap_state_dict({"state_dict": {"model": w}}) == w
    assert unwrap_state_dict({"state_dict": w, "model": {"b": torch.ones(1)}}) == w  # state_dict first, as timm
    with pytest.raises(ValueError, match="x.pt holds a list"):
        unwrap_state_dict([1], "x.pt")
    check_keys({"a"}, {"a"}, "M")
    with pytest.raises(ValueError, match=r"does not fit M: missing keys \['b'\]; unexpected keys \['c'\]. hint"):
        check_keys({"a", "b"}, {"a", "c"}, "M", "hint")
    check_keys({"a", "b"}, {"a"}, "M", ignore={"b"})


@pytest.mark.parametrize("name", BUILTIN)
def test_bind_update_is_update_once_bit_for_bit(name):
    """``bind_update``, the update an adapter binds to fixed parameters once per forward, is ``update_once`` bit for bit
    at every layer (grouped-query attention, heads at -2 as transformers lays them out); a subclass's own update is
    still called, and parameters that may depend on the layer bind nothing (the adapter takes ``apply``)."""
    from pid_plugins.core.methods import calls_once, update_once

    method = pid_plugins.get_method(name)
    cfg = method.configure(None, "hf")
    bound = method.bind_update(cfg, -2)
    if not calls_once(method):  # (Twicing, Elliptical, value residual: apply's path, whatever bind_update says)
        return
    assert bound is not None
    torch.manual_seed(0)
    state_a = state_b = None
    for i in range(3):
        out, v = torch.randn(2, 5, 4, 8), torch.randn(2, 5, 2, 8)  # (B, q, H, D) and the values (B, q, H_kv, D)
        want, state_a = update_once(method, cfg, out, v, state_a, -2, i)
        got, state_b = bound(out, v, state_b)
        assert torch.equal(got, want) and all(
            (a is None and b is None) or torch.equal(a, b) for a, b in zip(state_a, state_b))

    calls = []

    class Watched(type(method)):
        def update(self, *args, **kwargs):
            calls.append(1)
            return super().update(*args, **kwargs)

    Watched().bind_update(cfg, -2)(out, v, None)
    assert calls == [1]

    class PerLayer(type(method)):
        def layer_params(self, config, learned, layer=None):
            return config

    assert PerLayer().bind_update(cfg, -2) is None
