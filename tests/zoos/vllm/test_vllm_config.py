"""What the vLLM plugin reads from a checkpoint's config and what it refuses (pid_plugins.vllm.config: no vLLM needed).

The serving itself is tested against real vLLM in .venv-vllm (make test-vllm, tests/vllm_serving/); here: the method
and parameters are read as the transformers adapter reads them (its own function on the same config, where
transformers is installed), stock checkpoints keep vLLM's model, and every refusal names the method or setting.
"""
import re
from types import SimpleNamespace

import pytest

from method_cases import BUILTIN, MODELS
from pid_plugins.core import AttentionMethod, PIDConfig, get_method
from pid_plugins.vllm.config import check_engine, method_choice, unservable_reason

WHERE = "vLLM serving ckpt (LlamaForCausalLM)"
SERVED = {name: method for name, method in BUILTIN.items() if unservable_reason(get_method(name)) is None}


def _params():
    """Every served method with no parameters (the hf preset) and with each of its parameter sets on the contract's
    Llama; then PID's other spellings (a preset name, overrides, a preset with overrides) and a second NeuTRENO
    strength."""
    out = []
    for name, method in SERVED.items():
        # (None: the hf preset, unless a causal model runs the method with other parameters: causal_cfg)
        for params in ((None,) if method.causal_cfg is None else ()) + tuple(method.on(MODELS["hf-llama"])):
            if (name, params) not in out:
                out.append((name, params))
    extra = [("pid", "deit"), ("pid", {"lambda_p": 0.3, "beta": 0.4}), ("pid", {"preset": "deit", "beta": 0.5}),
             ("neutreno", {"alpha": 0.25})]
    return out + [case for case in extra if case not in out]


PARAMS = _params()


def hf_config(method, params=None, **extra):
    """What vLLM's hf_config carries of a checkpoint saved by pid_plugins.hf."""
    config = SimpleNamespace(_attn_implementation=method, **extra)
    if method is not None:
        setattr(config, method, params)
    return config


@pytest.mark.parametrize("method, params", PARAMS)
def test_the_parameters_are_read_as_the_transformers_adapter_reads_them(method, params):
    choice = method_choice(hf_config(method, params), WHERE)
    assert choice.method is get_method(method)
    assert choice.config == get_method(method).configure(params, "hf")
    try:
        from pid_plugins.hf.config import model_method_config
    except ImportError:  # no transformers here (the vLLM env's is older than the adapter supports)
        return
    assert choice.config == model_method_config(hf_config(method, params))


def test_pid_without_parameters_is_the_lm_preset():
    assert method_choice(hf_config("pid"), WHERE).config == PIDConfig.preset("lm")


@pytest.mark.parametrize("name", [None, "sdpa", "eager", "flash_attention_2", "flex_attention", "softmax",
                                  "kernels-community/flash-attn", "paged|sdpa"])
def test_a_stock_checkpoint_keeps_vllms_own_model(name):
    assert method_choice(hf_config(name), WHERE) is None


@pytest.mark.parametrize("method, params", [(name, m.zero) for name, m in SERVED.items() if m.zero is not None
                                            and get_method(name).is_identity(get_method(name).configure(m.zero))])
def test_parameters_that_compute_the_stock_attention_keep_vllms_own_model(method, params):
    assert method_choice(hf_config(method, params), WHERE) is None


def test_a_method_reading_the_visible_keys_is_refused_unless_it_is_elliptical():
    """vLLM's paged attention does not expose which keys a query sees: only Elliptical's prefix mean is served (its
    mean of |v^l - v^{l-1}| / delta over them is a paged attention of its own, pid_plugins.vllm.elliptical)."""
    reader = type("Reader", (AttentionMethod,), {"name": "reader", "reads_visible": True})()
    assert "reads which keys each query attends to" in unservable_reason(reader)
    assert unservable_reason(get_method("elliptical")) is None
    keeper = type("Keeper", (AttentionMethod,), {"name": "keeper", "keys_state": True})()  # no mixes_values
    assert "its state holds the values of every key position" in unservable_reason(keeper)


@pytest.mark.parametrize("method", [name for name, m in BUILTIN.items() if m.causal_cfg is not None])
def test_a_preset_refused_in_causal_models_is_refused_before_serving(method):
    """The hf preset of a method refused in a causal model decoding with a cache (Elliptical's whole-sequence mean):
    refused by the method's own check, with the checkpoint named; its causal parameters are served."""
    with pytest.raises(ValueError, match=rf"{re.escape(WHERE)}: attention method '{method}' with mean='sequence' is "
                                         "not causal"):
        method_choice(hf_config(method), WHERE)
    assert method_choice(hf_config(method, BUILTIN[method].causal_cfg), WHERE).method is get_method(method)


@pytest.mark.parametrize("method, params", [(name, {"learnable": True}) for name, m in SERVED.items() if m.learnable])
def test_learnable_parameters_are_refused(method, params):
    with pytest.raises(ValueError, match=rf"learnable gains are not supported here \({method}, learnable=True\)"):
        method_choice(hf_config(method, params), WHERE)


@pytest.mark.parametrize("method", [name for name, m in SERVED.items() if m.warmup])
def test_an_unfinished_gain_warmup_is_refused(method):
    with pytest.raises(ValueError, match=rf"config.{method} has warmup_steps=5, an unfinished gain warm-up.*"
                                         r"pid_plugins.finish_warmup\(model\)"):
        method_choice(hf_config(method, {"warmup_steps": 5}), WHERE)


def test_an_unknown_attention_name_is_refused():
    with pytest.raises(ValueError, match="attn_implementation='my_method', which is neither an attention method of "
                                         "pid-plugins"):
        method_choice(hf_config("my_method"), WHERE)


def test_bad_parameters_are_refused_by_the_methods_own_validation():
    with pytest.raises(ValueError, match="PIDConfig.beta must be in"):
        method_choice(hf_config("pid", {"beta": 0.0}), WHERE)
    with pytest.raises(ValueError, match="unknown PIDConfig field"):
        method_choice(hf_config("pid", {"gain": 1.0}), WHERE)


def engine(pp=1, tp=1, speculative=None):
    return SimpleNamespace(parallel_config=SimpleNamespace(pipeline_parallel_size=pp, tensor_parallel_size=tp,
                                                           decode_context_parallel_size=1,
                                                           prefill_context_parallel_size=1),
                           speculative_config=speculative)


def test_engine_settings_the_plugin_does_not_cover_are_refused_naming_each():
    check_engine(engine(), WHERE)  # one process per replica: served
    with pytest.raises(ValueError) as info:
        check_engine(engine(pp=2, tp=2, speculative=object()), WHERE)
    message = str(info.value)
    for part in ("pipeline_parallel_size=2", "tensor_parallel_size=2", "speculative decoding"):
        assert part in message
    with pytest.raises(ValueError, match="pipeline_parallel_size=2"):
        check_engine(engine(pp=2), WHERE)
    check_engine(engine(tp=2), WHERE, tensor_parallel=True)
    with pytest.raises(ValueError, match="pipeline_parallel_size=2") as info:
        check_engine(engine(pp=2, tp=2), WHERE, tensor_parallel=True)
    assert "tensor_parallel_size" not in str(info.value)


def test_what_vllm_serves_is_read_from_the_methods_capabilities_not_its_type():
    """A user's method whose ``attend`` mixes each position's values with a state of every key position's values
    (``keys_state``, as value residual) is servable when it says the mixed values are what is cached
    (``mixes_values``), and refused, naming why, when it does not: the plugin reads the capability, never the
    method's class. Its own ``attend`` (one call, or several: each gets a paged cache of its own) is served."""
    from pid_plugins.core import AttentionMethod

    class Mixing(AttentionMethod):
        name = "my_mixing"
        config_type = PIDConfig
        state_fields = ("v_first",)

        def attend(self, params, attend, query, value, state=None, head_dim=-3):
            return attend(query, value if state is None else 0.5 * (value + state[0]))

        def update(self, params, out, value_q, state, scale, head_dim):
            return out, (value_q if state is None else state[0],)

    assert unservable_reason(Mixing()) is None
    Mixing.keys_state = True
    assert "every key position" in unservable_reason(Mixing())
    Mixing.mixes_values = True
    assert unservable_reason(Mixing()) is None
    assert get_method("value_residual").mixes_values and unservable_reason(get_method("value_residual")) is None
