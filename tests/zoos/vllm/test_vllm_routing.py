"""Which class serves a method checkpoint in vLLM, decided where vLLM resolves the architecture
(pid_plugins.vllm.routing: no vLLM needed). The check itself runs against real vLLM in make test-vllm
(tests/vllm_serving/: the refusals come from ``LLM(...)`` before any engine starts); here: every route of the
decision, on configs as vLLM holds them.
"""
from types import SimpleNamespace

import pytest

from pid_plugins.versions import InternalChanged
from pid_plugins.vllm import routing
from pid_plugins.vllm.internals import SUPPORTED_VLLM, check_release


def model_config(attention=None, params=None, method=None, impl="auto", runner="generate", convert="none"):
    """What vLLM's ModelConfig holds of a checkpoint: hf_config with ``_attn_implementation`` and ``<method>``."""
    hf = SimpleNamespace(_attn_implementation=attention)
    if method is not None:
        setattr(hf, method, params)
    return SimpleNamespace(model="ckpt", hf_config=hf, hf_text_config=hf, model_impl=impl, runner_type=runner,
                           convert_type=convert)


def route(architecture, config, resolved):
    choice = routing.plan([architecture], config)
    if choice is not None:
        routing.confirm(choice, [architecture], config, resolved)
    return choice


@pytest.mark.parametrize("attention", [None, "sdpa", "eager", "softmax"])
def test_a_stock_checkpoint_is_vllms_alone(attention):
    config = model_config(attention)
    assert route("Phi3ForCausalLM", config, "Phi3ForCausalLM") is None
    assert config.model_impl == "auto"


def test_zero_gains_are_the_stock_model():
    config = model_config("pid", {"lambda_p": 0.0, "lambda_i": 0.0, "lambda_d": 0.0}, method="pid")
    assert route("Phi3ForCausalLM", config, "Phi3ForCausalLM") is None


@pytest.mark.parametrize("architecture", ["LlamaForCausalLM", "Qwen3ForCausalLM"])
def test_a_native_architecture_keeps_the_plugins_class(architecture):
    config = model_config("pid", method="pid")
    assert route(architecture, config, architecture).method.name == "pid"
    assert config.model_impl == "auto"


@pytest.mark.parametrize("architecture, option", [("MistralForCausalLM", "llama_4_scaling"),
                                                  ("Qwen2ForCausalLM", "dual_chunk_attention_config"),
                                                  ("LlamaForCausalLM", "is_causal")])
def test_a_family_option_the_native_loop_does_not_run_is_refused_where_vllm_resolves_the_class(architecture, option):
    """In the process the user launched (vLLM resolves the class there too), not only where the model is built."""
    config = model_config("pid", method="pid")
    setattr(config.hf_config, option, False if option == "is_causal" else {"on": True})
    with pytest.raises(ValueError, match=f"config.{option}"):
        route(architecture, config, architecture)
    config.model_impl = "transformers"
    if option != "is_causal":
        route(architecture, config, "TransformersForCausalLM")


@pytest.mark.parametrize("method", ["pid", "neutreno", "value_residual"])
def test_another_architecture_falls_back_to_the_transformers_backend(method):
    config = model_config(method, method=method)
    assert routing.plan(["Phi3ForCausalLM"], config).method.name == method
    assert config.model_impl == "transformers"  # vLLM then resolves TransformersForCausalLM
    routing.confirm(routing.plan(["Phi3ForCausalLM"], config), ["Phi3ForCausalLM"], config, "TransformersForCausalLM")


@pytest.mark.parametrize("impl, resolved, named", [
    ("vllm", "Phi3ForCausalLM", "vLLM's own Phi3ForCausalLM class"),  # vLLM's own class asked for
    ("transformers", "LlamaForCausalLM", "vLLM's own LlamaForCausalLM class"),  # the backend could not take it
    ("auto", "Kolibri1ForCausalLM", "vLLM's own Kolibri1ForCausalLM class"),  # vLLM maps it to its backend itself
    ("transformers", "TransformersMultiModalForCausalLM", "Transformers backend class TransformersMultiModal"),
    ("terratorch", "Terratorch", "vLLM's own Terratorch class"),
])
def test_what_would_serve_softmax_is_refused_naming_method_architecture_and_class(impl, resolved, named):
    config = model_config("neutreno", method="neutreno", impl=impl)
    with pytest.raises(ValueError) as error:
        route("Phi3ForCausalLM", config, resolved)
    message = str(error.value)
    assert "attention method 'neutreno'" in message and "(Phi3ForCausalLM)" in message and named in message
    assert "softmax" in message


@pytest.mark.parametrize("runner, convert", [("pooling", "embed"), ("pooling", "classify")])
def test_pooling_is_refused(runner, convert):
    config = model_config("pid", method="pid", runner=runner, convert=convert)
    with pytest.raises(ValueError, match=f"runner '{runner}' with convert '{convert}'"):
        route("LlamaForCausalLM", config, "LlamaForCausalLM")


@pytest.mark.parametrize("attention", [None, "sdpa"])
def test_parameters_without_their_method_are_refused(attention):
    config = model_config(attention, {"lambda_p": 0.3}, method="pid")
    with pytest.raises(ValueError, match=r"config\.pid\) but attn_implementation="):
        route("LlamaForCausalLM", config, "LlamaForCausalLM")


@pytest.mark.parametrize("method, reason", [("elliptical", "with mean='sequence' is not causal")])
def test_an_unservable_method_is_refused_before_vllm_resolves_anything(method, reason):
    config = model_config(method, method=method)  # (Elliptical's hf preset: the whole-sequence mean)
    with pytest.raises(ValueError, match=f"attention method '{method}' {reason}"):
        routing.plan(["Phi3ForCausalLM"], config)
    assert config.model_impl == "auto"


def test_a_multimodal_text_config_naming_the_method_is_checked():
    config = model_config()
    config.hf_text_config = SimpleNamespace(_attn_implementation="pid")
    assert routing.plan(["LlavaForConditionalGeneration"], config).method.name == "pid"


@pytest.mark.parametrize("version", ["0.31.2", SUPPORTED_VLLM[1], "1.0.0"])
def test_a_vllm_outside_the_supported_range_serves_no_method(version):
    with pytest.raises(InternalChanged, match=f"vLLM {version}, whose internals it has not checked"):
        check_release("here", version)


@pytest.mark.parametrize("version", ["0.32.0", "0.32.3", "0.33.0", "0.33.1+cpu"])
def test_the_supported_range(version):
    check_release("here", version)


class Registry:
    """vLLM's ModelRegistry as the plugin uses it: resolution, and the lookup of one registered architecture."""

    def __init__(self):
        self.calls = []

    def inspect_model_cls(self, architectures, model_config):
        self.calls.append((list(architectures), model_config.model_impl))
        if model_config.model_impl == "transformers":
            return "info", "TransformersForCausalLM"
        return "info", architectures[0]

    def resolve_model_cls(self, architectures, model_config):
        return "class", architectures[0]

    def _try_inspect_model_cls(self, model_arch):
        return f"info of {model_arch}"

    def _try_load_model_cls(self, model_arch):
        return f"class {model_arch}"


def test_install_wraps_the_registry_once():
    registry = Registry()
    routing.install(registry)
    routing.install(registry)
    config = model_config("pid", method="pid")
    assert registry.inspect_model_cls(["Phi3ForCausalLM"], config) == ("info of PidPluginsTransformersForCausalLM",
                                                                      "PidPluginsTransformersForCausalLM")
    assert registry.calls == [(["Phi3ForCausalLM"], "transformers")]  # the fallback was set before vLLM resolved
    with pytest.raises(ValueError, match="vLLM's own Phi3ForCausalLM class"):
        registry.resolve_model_cls(["Phi3ForCausalLM"], model_config("pid", method="pid", impl="vllm"))
    assert registry.resolve_model_cls(["Phi3ForCausalLM"], model_config()) == ("class", "Phi3ForCausalLM")


@pytest.mark.parametrize("named", ["LlamaForCausalLM", "PidPluginsLlamaForCausalLM"])
def test_a_method_checkpoint_is_served_by_the_plugins_class_under_its_own_name(named):
    """The stock architecture name, or the plugin's (a checkpoint may name it)."""
    registry = Registry()
    routing.install(registry)
    config = model_config("neutreno", method="neutreno")
    assert registry.resolve_model_cls([named], config) == ("class PidPluginsLlamaForCausalLM",
                                                           "PidPluginsLlamaForCausalLM")
    assert registry.inspect_model_cls([named], config) == ("info of PidPluginsLlamaForCausalLM",
                                                           "PidPluginsLlamaForCausalLM")
    assert registry.calls == [(["LlamaForCausalLM"], "auto")]


@pytest.mark.parametrize("attention, params", [(None, None), ("sdpa", None),
                                               ("pid", {"lambda_p": 0.0, "lambda_i": 0.0, "lambda_d": 0.0})])
def test_a_stock_checkpoint_resolves_to_vllms_own_class(attention, params):
    """vLLM's own resolution, untouched (the plugin's name in a checkpoint stands for vLLM's class then)."""
    registry = Registry()
    routing.install(registry)
    config = model_config(attention, params, method="pid" if params else None)
    assert registry.resolve_model_cls(["LlamaForCausalLM"], config) == ("class", "LlamaForCausalLM")
    assert registry.inspect_model_cls(["PidPluginsLlamaForCausalLM"], config) == ("info", "LlamaForCausalLM")


def test_the_preset_is_written_where_vllm_reads_and_hashes_the_models_config():
    """A checkpoint naming a method without its parameters (the preset)."""
    from pid_plugins.core import PIDConfig
    from pid_plugins.vllm.config import method_choice

    config = model_config("pid", method="pid")
    choice = routing.plan(["LlamaForCausalLM"], config)
    assert choice.config == PIDConfig.preset("lm")
    assert config.hf_config.pid == PIDConfig.preset("lm").to_dict()
    assert method_choice(config.hf_config, "here") == choice
    given = {"lambda_p": 0.3}
    config = model_config("pid", dict(given), method="pid")
    routing.plan(["LlamaForCausalLM"], config)
    assert config.hf_config.pid == given  # parameters the checkpoint gives are left as they are


def test_transformers_loads_a_folder_naming_the_plugins_architecture(tmp_path):
    """A method checkpoint whose config.json names the plugin's vLLM class (docs/checkpoints.md)."""
    import json

    import torch
    transformers = pytest.importorskip("transformers")
    import pid_plugins.hf  # noqa: F401

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="pid").eval()
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["architectures"] == ["LlamaForCausalLM"]
    saved["architectures"] = ["PidPluginsLlamaForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(saved))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(loaded) is type(model) and loaded.config._attn_implementation == "pid"
    ids = torch.tensor([[1, 5, 9, 2, 7]])
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
