"""Method names a zoo already holds are refused (issue 32; a method registered as ``sdpa`` would replace transformers'
attention for every model): a stock sdpa Llama's logits and transformers' attention tables are the same, bit for bit,
after every refused registration."""
from __future__ import annotations

import textwrap

import pytest
import torch

import pid_plugins
from pid_plugins.core.siblings.neutreno import NeuTRENOMethod
from pyexec import run_python_c
from zoo_cases import hf_ids, import_transformers, llama_config

T = import_transformers()
from transformers import AttentionInterface, PretrainedConfig  # noqa: E402
from transformers.masking_utils import AttentionMaskInterface  # noqa: E402


def method_named(name: str) -> NeuTRENOMethod:
    return type(f"Named_{name}", (NeuTRENOMethod,), {"name": name})()


def transformers_names():
    names = set(AttentionInterface._global_mapping) | set(AttentionMaskInterface._global_mapping) | {"eager"}
    return sorted(n for n in names if n.isidentifier() and n not in pid_plugins.list_methods())


def tables():
    return dict(AttentionInterface._global_mapping), dict(AttentionMaskInterface._global_mapping)


def test_transformers_names_are_read_from_transformers_itself():
    """The refused names are transformers' own tables, not a list of ours: sdpa, eager, flash and flex included."""
    assert {"sdpa", "eager", "flash_attention_2", "flex_attention"} <= set(transformers_names())


@pytest.mark.parametrize("replace", [False, True])
def test_a_stock_sdpa_model_is_unchanged_after_any_registration_attempt(replace):
    torch.manual_seed(0)
    stock = T.LlamaForCausalLM(llama_config("sdpa")).eval()
    x = hf_ids(2, 8)
    with torch.no_grad():
        before = stock(x).logits
    attention, masks = tables()
    for name in transformers_names():
        with pytest.raises(ValueError, match=rf"'{name}' is taken by transformers: its .*attn_implementation="
                                             rf"\"{name}\".*another name \(e.g. 'my_{name}'\)"):
            pid_plugins.register_method(method_named(name), replace=replace)
        assert name not in pid_plugins.list_methods()
    assert tables() == (attention, masks)
    with torch.no_grad():
        assert torch.equal(stock(x).logits, before)
    fresh = T.LlamaForCausalLM(llama_config("sdpa")).eval()
    fresh.load_state_dict(stock.state_dict())
    with torch.no_grad():
        assert torch.equal(fresh(x).logits, before)


def test_names_transformers_registers_later_count_too():
    """A kernel registered after pid_plugins.hf was imported is refused as well (the tables are read at every
    registration); a method of ours keeps its name and can be replaced by one of ours."""
    def kernel(*args, **kwargs):  # a user's own attention implementation
        raise AssertionError("never called")

    AttentionInterface.register("my_kernel_attention", kernel)
    try:
        with pytest.raises(ValueError, match="'my_kernel_attention' is taken by transformers"):
            pid_plugins.register_method(method_named("my_kernel_attention"), replace=True)
        assert AttentionInterface._global_mapping["my_kernel_attention"] is kernel
    finally:
        del AttentionInterface._global_mapping["my_kernel_attention"]
    ours = pid_plugins.register_method(method_named("names_probe"))
    again = pid_plugins.register_method(method_named("names_probe"), replace=True)
    assert pid_plugins.get_method("names_probe") is again is not ours


def test_config_attributes_cannot_name_a_method():
    """A method's parameters are saved as ``config.<name>``: a name of PretrainedConfig's would overwrite it."""
    from pid_plugins.hf.config import BASE_ATTR, STOCK_ATTR

    for name in ("to_dict", "return_dict", BASE_ATTR, STOCK_ATTR):
        assert hasattr(PretrainedConfig(), name) or name in (BASE_ATTR, STOCK_ATTR)
        with pytest.raises(ValueError, match=f"'{name}' is taken by transformers: .*config"):
            pid_plugins.register_method(method_named(name))


def test_softmax_and_timm_attention_layers_are_refused():
    pytest.importorskip("timm")
    import pid_plugins.timm  # noqa: F401
    from timm.models.vision_transformer import ATTN_LAYERS

    with pytest.raises(ValueError, match="'softmax' is taken by pid_plugins: the stock attention"):
        pid_plugins.register_method(method_named("softmax"), replace=True)
    for name in (n for n in ATTN_LAYERS if n):
        with pytest.raises(ValueError, match=f"'{name}' is taken by timm: its attn_layer='{name}'"):
            pid_plugins.register_method(method_named(name), replace=True)


@pytest.mark.slow
def test_an_adapter_imported_after_the_registration_refuses_it_before_exposing_anything():
    """Registered before ``import pid_plugins.hf`` (the core knows no zoo then), ``flex_attention`` is refused by the
    adapter's import: transformers' table keeps its own function. Same for timm's ``diff``."""
    script = textwrap.dedent("""
        import pid_plugins
        from pid_plugins.core.siblings.neutreno import NeuTRENOMethod
        from transformers import AttentionInterface
        stock = AttentionInterface._global_mapping["flex_attention"]
        pid_plugins.register_method(type("M", (NeuTRENOMethod,), {"name": "flex_attention"})())
        try:
            import pid_plugins.hf
        except ValueError as exc:
            print("HF:", exc)
        assert AttentionInterface._global_mapping["flex_attention"] is stock
        pid_plugins.register_method(type("D", (NeuTRENOMethod,), {"name": "diff"})())
        try:
            import pid_plugins.timm
        except ValueError as exc:
            print("TIMM:", exc)
    """)
    out = run_python_c(script, timeout=300)  # python -c, forked from a zygote that holds no pid_plugins
    assert out.returncode == 0, out.stderr
    assert "HF: attention method name 'flex_attention' is taken by transformers" in out.stdout
    assert "TIMM: attention method name 'diff' is taken by timm" in out.stdout
