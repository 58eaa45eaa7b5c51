"""torch.compile(fullgraph=True) of every PID path against the eager model (issue 25): a graph break fails, and
``error_on_recompile`` fails a decoding step that recompiles after the first."""
import pytest
import torch
import torch._dynamo

from pid_plugins import PIDConfig


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _compile(model, backend="eager"):
    # graph breaks and recompiles are dynamo's: its "eager" backend finds them as inductor would, at a fraction of
    # the compile time; the path most users take (config.pid unset) runs inductor too
    return torch.compile(model, fullgraph=True, backend=backend)


LLAMA = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)


def _gains(source):
    return {"unset": None, "dict": dict(lambda_p=0.2, lambda_d=0.3), "preset name": "deit",
            "PIDConfig": PIDConfig.preset("segmenter", lambda_i=0.7)}[source]


@pytest.mark.slow
@pytest.mark.parametrize("source,backend", [
    ("unset", "eager"), ("dict", "eager"), ("preset name", "eager"), ("PIDConfig", "eager"),
    # the path most users take, with inductor's code generation: a minute of CPU, so in make test-integration (beside
    # test_hf_compile_switch's inductor runs); every gains source is checked for breaks and recompiles in make test
    pytest.param("unset", "inductor", marks=[pytest.mark.integration, pytest.mark.inductor])])
def test_hf_static_cache_decoding_compiles_fullgraph_without_recompiles(source, backend):
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM, LlamaConfig, StaticCache

    import pid_plugins.hf  # noqa: F401

    cfg = LlamaConfig(**LLAMA)
    if _gains(source) is not None:
        cfg.pid = _gains(source)
    torch.manual_seed(0)
    # the path most users take: from_config(..., attn_implementation="pid"), then compile, no eager forward first
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="pid").eval()
    expected_gains = PIDConfig.coerce(_gains(source), default="lm")
    assert pid_plugins.hf.model_method_config(model.config) == expected_gains
    compiled = _compile(model, backend)
    prompt = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(1))

    def decode(step, steps=4):
        cache = StaticCache(config=model.config, max_cache_len=16)
        with torch.no_grad():
            # the prefill and the first decoding step compile once each; from then on: no recompilation
            logits = [step(input_ids=prompt, past_key_values=cache, use_cache=True).logits]
            logits.append(step(input_ids=logits[-1][:, -1:].argmax(-1), past_key_values=cache, use_cache=True).logits)
            with torch._dynamo.config.patch(error_on_recompile=True):
                for _ in range(steps - 1):
                    tok = logits[-1][:, -1:].argmax(-1)
                    logits.append(step(input_ids=tok, past_key_values=cache, use_cache=True).logits)
        return torch.cat(logits, dim=1)

    got = decode(compiled)
    want = decode(model)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    # and the gains matter: the stock model's decoding differs
    model.set_attn_implementation("sdpa")
    assert not torch.allclose(decode(model), want, atol=1e-3)


@pytest.mark.slow
def test_transformers_compiled_call_compiles_the_frames_stock_compiles():
    """transformers compiles ``model.__call__`` (generate's compiled decoding step): dynamo does not trace
    nn.Module.__call__, so a forward hook would be a compiled frame of its own there."""
    pytest.importorskip("transformers")
    from torch._dynamo.utils import counters
    from transformers import LlamaConfig, LlamaForCausalLM, StaticCache

    import pid_plugins.hf  # noqa: F401
    from pid_plugins.hf.forward import _after_forward, _before_forward

    def decode(model, step):  # the eager prefill, then four decoding steps through ``step``
        cache = StaticCache(config=model.config, max_cache_len=16)
        prompt = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            logits = [model(input_ids=prompt, past_key_values=cache, use_cache=True).logits]
            for i in range(4):
                with torch._dynamo.config.patch(error_on_recompile=i > 0):
                    tok = logits[-1][:, -1:].argmax(-1)
                    logits.append(step(input_ids=tok, past_key_values=cache, use_cache=True).logits)
        return torch.cat(logits, dim=1)

    def run(attn):
        torch._dynamo.reset()
        counters.clear()
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(**LLAMA, attn_implementation=attn)).eval()
        got = decode(model, torch.compile(model.__call__, fullgraph=True, backend="eager"))  # as get_compiled_call
        hooks_compiled = [f.__name__ for f in (_before_forward, _after_forward)
                          if torch._dynamo.eval_frame._debug_get_cache_entry_list(f.__code__)]
        return got, dict(counters["frames"]), counters["stats"]["unique_graphs"], hooks_compiled, model

    _, stock_frames, stock_graphs, _, _ = run("sdpa")
    got, frames, graphs, hooks_compiled, model = run("pid")
    assert hooks_compiled == []
    assert (frames, graphs) == (stock_frames, stock_graphs), (frames, stock_frames)
    torch.testing.assert_close(got, decode(model, model), rtol=1e-5, atol=1e-5)


def test_a_compiled_function_calling_the_model_inlines_the_method_forward():
    """Where dynamo traces a call of the model (a compiled function that calls it), the method's forward is inlined into
    its one graph (fullgraph: code run apart would be a graph break), and the graph computes the method."""
    pytest.importorskip("transformers")
    from transformers import LlamaConfig, LlamaForCausalLM

    import pid_plugins.hf  # noqa: F401

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**LLAMA, attn_implementation="pid")).eval()
    ids = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(1))

    def scores(x):
        return model(input_ids=x, use_cache=False).logits.log_softmax(-1)

    with torch.no_grad():
        got = _compile(scores)(ids)
        want = scores(ids)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        model.set_attn_implementation("sdpa")
        assert not torch.allclose(scores(ids), want, atol=1e-3)


@pytest.mark.slow
def test_timm_forward_compiles_fullgraph_with_a_preset_name():
    timm = pytest.importorskip("timm")
    import pid_plugins.timm  # noqa: F401

    torch.manual_seed(0)
    model = timm.create_model("pid_deit_tiny_patch16_224", attention_cfg="lm", img_size=32, patch_size=16, embed_dim=24,
                              depth=2, num_heads=2, num_classes=5).eval()
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(_compile(model)(x), model(x), rtol=1e-4, atol=1e-4)


def test_mmseg_backbone_forward_compiles_fullgraph_with_a_preset_name():
    pytest.importorskip("mmseg")
    from zoo_cases import mm_args, mm_build

    model = mm_build("PIDVisionTransformer", dict(mm_args("backbone", 2), patch_size=16, embed_dims=24, num_heads=2),
                     attention_cfg="deit")
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        # mmengine modules cannot be wrapped by torch.compile(module): compile the bound forward
        torch.testing.assert_close(_compile(model.forward)(x), model(x), rtol=1e-4, atol=1e-4)


def test_fairseq_decoder_forward_compiles_fullgraph_with_a_preset_name(tmp_path):
    pytest.importorskip("fairseq")
    from zoo_cases import fs_build, fs_dictionary

    # the registry's transformer_lm_pid_wikitext103 entry: preset `lm`, at a tiny width
    decoder = fs_build(fs_dictionary(tmp_path), arch="transformer_lm_pid_wikitext103", layers=2)[0].decoder
    assert decoder.attention_config == PIDConfig.preset("lm")
    toks = torch.randint(4, 44, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(_compile(decoder)(toks)[0], decoder(toks)[0], rtol=1e-4, atol=1e-4)
