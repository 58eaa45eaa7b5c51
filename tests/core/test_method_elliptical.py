"""Elliptical attention (``attention="elliptical"``; stefvk/Elliptical-Attention, ``MahalaAttention``), restated by
loops in zoo_cases (:func:`naive_elliptical_scales`, :func:`naive_elliptical_attention`)."""
import pytest
import torch

import pid_plugins
from pid_plugins.core import AttentionContext, LayerCall
from pid_plugins.core.siblings.elliptical import EllipticalConfig
from zoo_cases import bart_config, fs_build, fs_dictionary, fs_method, hf_ids, import_transformers, llama_config
from zoo_cases import mm_inputs, mm_out
from zoo_cases import mm_pair as zoo_mm_pair
from zoo_cases import naive_elliptical_attention as naive_attention
from zoo_cases import naive_elliptical_layer as naive_layer
from zoo_cases import naive_elliptical_scales as naive_scales

NAME = "elliptical"
METHOD = pid_plugins.get_method(NAME)


def test_config_presets_and_validation():
    assert METHOD.configure(None, "timm") == EllipticalConfig(from_layer=2, delta=5.0)
    for preset in ("deit", "fan", "segmenter"):
        assert EllipticalConfig.preset(preset) == EllipticalConfig()
    assert METHOD.configure(None, "mmseg") == EllipticalConfig.preset("segmenter")
    assert METHOD.configure({"from_layer": 3}, "hf").from_layer == 3
    assert not METHOD.is_identity(EllipticalConfig()) and not METHOD.additive
    assert EllipticalConfig.from_dict(EllipticalConfig(from_layer=4, delta=1).to_dict()) == EllipticalConfig(4, 1.0)
    with pytest.raises(ValueError, match="from_layer must be >= 2 .*attention='softmax'"):
        EllipticalConfig(from_layer=1)
    with pytest.raises(ValueError, match="delta must be a finite number > 0"):
        EllipticalConfig(delta=0.0)
    with pytest.raises(ValueError, match="unknown EllipticalConfig field.*learnable"):
        METHOD.configure({"learnable": True})


def test_check_refuses_causal_and_cached_with_what_to_do():
    METHOD.check(EllipticalConfig(), AttentionContext(dropout=True, grouped=True))  # both exact
    with pytest.raises(ValueError, match="not causal.*earlier positions would read later tokens.*mean='prefix'"):
        METHOD.check(EllipticalConfig(), AttentionContext(causal=True))
    with pytest.raises(ValueError, match="KV cache.*mean='prefix'.*without a cache"):
        METHOD.check(EllipticalConfig(), AttentionContext(cached=True))
    METHOD.check(EllipticalConfig(mean="prefix"), AttentionContext(causal=True, cached=True, grouped=True))


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_layer_stack_matches_the_loop_statement(kv_heads):
    """Four layers of the method (the one call, with each layer's index) with SDPA as the attention, against
    :func:`naive_layer`: the first layer plain, the previous values handed on by every layer, ``from_layer``
    respected, grouped heads."""
    g = torch.Generator().manual_seed(0)
    B, H, N, D = 2, 4, 5, 3
    for from_layer in (2, 3, 9):
        config = EllipticalConfig(from_layer=from_layer, delta=2.0)
        state, v_prev = None, None
        for layer in range(1, 5):
            q = torch.randn(B, H, N, D, generator=g, dtype=torch.float64)
            k, v = (torch.randn(B, kv_heads, N, D, generator=g, dtype=torch.float64) for _ in range(2))

            def attend(query, value):
                return torch.nn.functional.scaled_dot_product_attention(query, k, value, enable_gqa=True)

            out, state = METHOD.apply(config, None, LayerCall(attend, q, v, v, layer=layer - 1), state)
            want = naive_attention(q, k, v) if layer == 1 else naive_layer(q, k, v, v_prev, layer, from_layer, 2.0)
            torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
            assert len(state) == 1 and torch.equal(state[0], v) and not state[0].requires_grad
            v_prev = v
        assert from_layer == 9 or not torch.allclose(out, naive_attention(q, k, v))
    # from_layer=2 (every layer after the first) needs no index: the state tells the first layer; a later from_layer
    # refuses a call without one, naming the method and what the adapter must pass
    v_prev, v = v, torch.randn(B, kv_heads, N, D, generator=g, dtype=torch.float64)
    call = LayerCall(attend, q, v, v)
    torch.testing.assert_close(METHOD.apply(EllipticalConfig(delta=2.0), None, call, state)[0],
                               naive_layer(q, k, v, v_prev, 2, 2, 2.0), rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="'elliptical' reads the layer's index.*LayerCall\\(\\.\\.\\., layer=i\\)"):
        METHOD.apply(EllipticalConfig(from_layer=3), None, call, state)


def test_scales_take_no_gradient_and_follow_the_layout_of_the_update():
    q = torch.randn(1, 2, 4, 3, requires_grad=True)
    v = torch.randn(1, 2, 4, 3, requires_grad=True)
    _, state = METHOD.update(EllipticalConfig(), q, v.transpose(1, 2), None, None, head_dim=-2)  # (B, N, H, D)
    assert torch.equal(state[0], v.detach()) and state[0].shape == v.shape
    v2 = torch.randn(1, 2, 4, 3, requires_grad=True)
    scaled = METHOD.prepare(EllipticalConfig(), q, v2, state)
    scaled.sum().backward()
    assert v2.grad is None and v.grad is None  # m is computed from detached values
    m = naive_scales(v2.detach(), v.detach(), 5.0).float()
    torch.testing.assert_close(q.grad, m[:, :, None, :].expand_as(q))


def test_transformers_causal_models_are_refused_with_the_message():
    """Llama (decoder: forward and cached generation) and BART (its decoder's causal self-attention)."""
    T = import_transformers()
    import pid_plugins.hf as ph

    torch.manual_seed(0)
    llama = ph.convert(T.LlamaForCausalLM(llama_config(layers=2)).eval(), NAME)
    bart = ph.convert(T.BartModel(bart_config()).eval(), NAME)
    x = hf_ids()
    with torch.no_grad():
        for run in (lambda: llama(x), lambda: llama.generate(x, max_new_tokens=2, do_sample=False, pad_token_id=0),
                    lambda: bart(x)):
            with pytest.raises(ValueError, match="'elliptical' with mean='sequence' is not causal.*later tokens.*mean='prefix'"):
                run()


@pytest.mark.parametrize("part", ["backbone", "head"])
def test_mmseg_without_elliptical_layers_is_the_stock_attention_up_to_rounding(part):
    """``from_layer`` past the depth: the method's path (SDPA, not mmseg's own layers) computes the stock attention up
    to rounding (``attention='softmax'``, bit for bit, is in the contract suite)."""
    unscaled, stock = zoo_mm_pair(part, layers=3, attention=NAME, attention_cfg={"from_layer": 99})
    x = mm_inputs(part)
    with torch.no_grad():
        torch.testing.assert_close(mm_out(part, unscaled, x), mm_out(part, stock, x), rtol=1e-5, atol=1e-5)


def test_fairseq_language_models_refuse_the_sequence_mean(tmp_path):
    """fairseq's causal LM with ``mean="sequence"``: refused naming ``mean='prefix'`` (the preset's prefix mean is
    in the contract suite: reference, incremental decoding, causality)."""
    data = fs_dictionary(tmp_path)
    toks = torch.randint(4, 44, (2, 7), generator=torch.Generator().manual_seed(1))
    model, _, _ = fs_build(data, extra=fs_method(NAME, {"mean": "sequence"}), layers=2)
    with torch.no_grad():
        with pytest.raises(ValueError, match="'elliptical' with mean='sequence' is not causal.*later tokens.*mean='prefix'"):
            model(toks)
        with pytest.raises(ValueError, match="'elliptical' with mean='sequence' is not causal"):
            model.decoder(toks[:, :1], incremental_state={})
