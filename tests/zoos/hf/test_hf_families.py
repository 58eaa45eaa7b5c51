"""transformers family matrix."""
import pytest
import torch

transformers = pytest.importorskip("transformers")
import pid_plugins.hf as ph  # noqa: E402
import pid_plugins.hf.attention as attention  # noqa: E402
import pid_plugins.core.pid as methods  # noqa: E402  (where the PID method calls the rule)
from pid_plugins import PIDConfig  # noqa: E402

ZERO = {"lambda_p": 0.0, "lambda_i": 0.0, "lambda_d": 0.0}
V = 64
T = transformers
DEC = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _gemma3():
    return T.Gemma3TextConfig(**DEC, head_dim=8, sliding_window=4, layer_types=["sliding_attention", "full_attention"])


FAMILIES = {
    "llama": (lambda: T.LlamaConfig(**DEC), T.LlamaForCausalLM, "decoder", "sdpa", 2),
    "qwen2": (lambda: T.Qwen2Config(**DEC), T.Qwen2ForCausalLM, "decoder", "sdpa", 2),
    "qwen3": (lambda: T.Qwen3Config(**DEC, head_dim=8), T.Qwen3ForCausalLM, "decoder", "sdpa", 2),
    "mistral": (lambda: T.MistralConfig(**DEC, sliding_window=4), T.MistralForCausalLM, "decoder", "sdpa", 2),
    "gemma": (lambda: T.GemmaConfig(**DEC, head_dim=8), T.GemmaForCausalLM, "decoder", "sdpa", 2),
    "gemma2": (lambda: T.Gemma2Config(**DEC, head_dim=8, sliding_window=4), T.Gemma2ForCausalLM, "decoder",
               "eager", 2),
    "gemma3": (_gemma3, T.Gemma3ForCausalLM, "decoder", "sdpa", 2),
    "phi3": (lambda: T.Phi3Config(**DEC, sliding_window=4), T.Phi3ForCausalLM, "decoder", "sdpa", 2),
    "opt": (lambda: T.OPTConfig(vocab_size=V, hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
                                word_embed_proj_dim=32, max_position_embeddings=64, pad_token_id=0, bos_token_id=1,
                                eos_token_id=2), T.OPTForCausalLM, "decoder", "sdpa", 2),
    "gpt_neox": (lambda: T.GPTNeoXConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, max_position_embeddings=64, pad_token_id=0,
                                         bos_token_id=1, eos_token_id=2), T.GPTNeoXForCausalLM, "decoder", "sdpa", 2),
    "gpt2": (lambda: T.GPT2Config(vocab_size=V, n_embd=32, n_head=4, n_layer=2, n_positions=64, pad_token_id=0,
                                  bos_token_id=1, eos_token_id=2), T.GPT2LMHeadModel, "decoder", "sdpa", 2),
    "bert": (lambda: T.BertConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=64, max_position_embeddings=64), T.BertModel, "encoder", "sdpa", 2),
    "modernbert": (lambda: T.ModernBertConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                              num_attention_heads=4, max_position_embeddings=64, local_attention=4,
                                              pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1,
                                              sep_token_id=2), T.ModernBertModel, "encoder", "sdpa", 2),
    "vit": (lambda: T.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                                image_size=16, patch_size=4), T.ViTModel, "image", "sdpa", 2),
    "bart": (lambda: T.BartConfig(vocab_size=V, d_model=32, encoder_layers=2, decoder_layers=2,
                                  encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                                  decoder_ffn_dim=64, max_position_embeddings=64, pad_token_id=0, bos_token_id=1,
                                  eos_token_id=2, decoder_start_token_id=1, forced_eos_token_id=None),
             T.BartForConditionalGeneration, "seq2seq", "sdpa", 4),
    "t5": (lambda: T.T5Config(vocab_size=V, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
                              num_heads=4, pad_token_id=0, eos_token_id=2, decoder_start_token_id=0),
           T.T5ForConditionalGeneration, "seq2seq", "sdpa", 4),
    "whisper": (lambda: T.WhisperConfig(vocab_size=V, d_model=32, encoder_layers=2, decoder_layers=2,
                                        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                                        decoder_ffn_dim=64, num_mel_bins=8, max_source_positions=8,
                                        max_target_positions=32, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                        decoder_start_token_id=1),
                T.WhisperForConditionalGeneration, "speech", "sdpa", 4),
}
if not hasattr(__import__("transformers.models.gptj.modeling_gptj", fromlist=["x"]), "GPTJ_ATTENTION_CLASSES"):
    FAMILIES["gptj"] = (lambda: T.GPTJConfig(vocab_size=V, n_embd=32, n_layer=2, n_head=4, rotary_dim=4,
                                             n_positions=64, pad_token_id=0, bos_token_id=1, eos_token_id=2),
                        T.GPTJForCausalLM, "decoder", "sdpa", 2)
DECODERS = [f for f, spec in FAMILIES.items() if spec[2] == "decoder"]


def build(family, pid=None, seed=0):
    """(stock model on the base attention, PID model) with identical weights, float32, eval."""
    make, cls, _, base, _ = FAMILIES[family]
    torch.manual_seed(seed)
    stock = cls(make()).eval()
    stock.set_attn_implementation(base)
    model = cls(make()).eval()
    model.load_state_dict(stock.state_dict())
    ph.convert(model, "pid", pid, base=base)
    return stock, model


def inputs(family, n=2, seed=1):
    g = torch.Generator().manual_seed(seed)
    kind = FAMILIES[family][2]
    if kind == "image":
        return {"pixel_values": torch.randn(n, 3, 16, 16, generator=g)}
    ids = torch.randint(3, V, (n, 7), generator=g)
    if kind == "seq2seq":
        return {"input_ids": ids, "decoder_input_ids": torch.randint(3, V, (n, 5), generator=g)}
    if kind == "speech":
        return {"input_features": torch.randn(n, 8, 16, generator=g), "decoder_input_ids": ids[:, :5]}
    return {"input_ids": ids}


def main_output(out):
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def forward(model, **kw):
    with torch.no_grad():
        return main_output(model(**kw))


@pytest.mark.parametrize("family", FAMILIES)
def test_pid_differs_and_zero_gains_equal_the_base_bit_for_bit(family, monkeypatch):
    stock, model = build(family)
    x = inputs(family)
    calls = []
    original = methods.PIDMethod.update  # the PID method's rule, once per self-attention layer
    monkeypatch.setattr(methods.PIDMethod, "update", lambda *a, **k: calls.append(1) or original(*a, **k))
    base_out, pid_out = forward(stock, **x), forward(model, **x)
    assert len(calls) == FAMILIES[family][4]  # self-attention layers only: cross-attention keeps the base
    assert not torch.allclose(base_out, pid_out, atol=1e-4)
    model.config.pid = ZERO
    assert torch.equal(forward(model, **x), base_out)


@pytest.mark.parametrize("family", DECODERS)
def test_cached_greedy_and_beam_generation_equal_recomputation(family):
    _, model = build(family)
    ids = inputs(family)["input_ids"]
    for beams in (1, 3):
        kw = dict(max_new_tokens=6, do_sample=False, num_beams=beams, pad_token_id=0, eos_token_id=None)
        cached = model.generate(ids, use_cache=True, **kw)
        recomputed = model.generate(ids, use_cache=False, **kw)
        assert torch.equal(cached, recomputed), beams


@pytest.mark.parametrize("family", DECODERS)
def test_left_padding_generates_what_the_unpadded_prompt_does(family):
    _, model = build(family)
    ids = inputs(family, n=1)["input_ids"]
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), ids], 1)
    batch = torch.cat([padded, inputs(family, n=1, seed=5)["input_ids"][:, :10].repeat(1, 2)[:, :10]])
    mask = torch.ones_like(batch)
    mask[0, :3] = 0
    kw = dict(max_new_tokens=5, do_sample=False, pad_token_id=0, eos_token_id=None, output_logits=True,
              return_dict_in_generate=True)
    both = model.generate(batch, attention_mask=mask, **kw)
    alone = model.generate(ids, **kw)
    assert torch.equal(both.sequences[0, 3:], alone.sequences[0])
    torch.testing.assert_close(torch.stack(both.logits, 1)[0], torch.stack(alone.logits, 1)[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", ["bart", "t5", "whisper"])
def test_cached_decoding_equals_recomputation_encoder_decoder(family):
    _, model = build(family)
    x = inputs(family)
    enc_key = "input_features" if family == "whisper" else "input_ids"
    dec = x["decoder_input_ids"][:, :2]
    cache = None
    for step in range(4):
        with torch.no_grad():
            full = model(**{enc_key: x[enc_key]}, decoder_input_ids=dec, use_cache=False).logits[:, -1]
            out = model(**{enc_key: x[enc_key]}, decoder_input_ids=dec if cache is None else dec[:, -1:],
                        past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        torch.testing.assert_close(out.logits[:, -1], full, rtol=1e-4, atol=1e-5)
        dec = torch.cat([dec, full.argmax(-1, keepdim=True)], 1)


def loss_of(model, family, x):
    out = model(**x)
    return main_output(out).pow(2).mean()


@pytest.mark.parametrize("family", FAMILIES)
def test_gradient_checkpointing_gives_the_same_gradients(family):
    grads = []
    x = inputs(family)
    for ckpt in (False, True):
        _, model = build(family)
        model.train()
        if ckpt:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        torch.manual_seed(3)
        loss_of(model, family, x).backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 5
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], rtol=1e-5, atol=1e-6, msg=name)


def test_layer_order_without_layer_idx_and_roles():
    """ViT has no layer_idx; T5/BART/Whisper decide cross-attention by the module's place, not its class."""
    _, vit = build("vit")
    forward(vit, **inputs("vit"))
    order = [getattr(m, "_pid_plugins_index") for m in vit.modules() if hasattr(m, "_pid_plugins_index")]
    assert order == [0, 1]
    for family in ("t5", "bart", "whisper"):
        _, model = build(family)
        roles = {n: m._pid_plugins_index for n, m in model.named_modules() if hasattr(m, "_pid_plugins_index")}
        cross = {n for n, r in roles.items() if r == -1}
        assert len(cross) == 2 and all("decoder" in n for n in cross), roles
        assert sorted(r for r in roles.values() if r >= 0) == [0, 0, 1, 1]  # per stack


def test_gains_reach_every_t5_stack():
    stock, model = build("t5")
    x = inputs("t5")
    model.config.pid = ZERO  # T5's stacks hold deep copies of the config: the outer config must still rule
    assert torch.equal(forward(model, **x), forward(stock, **x))


def test_softcapping_defaults_to_eager_and_output_attentions_needs_eager():
    make, cls, *_ = FAMILIES["gemma2"]
    model = cls(make()).eval()
    with pytest.raises(ValueError, match=r"softcapping, which sdpa cannot compute: use .*base='eager'"):
        ph.convert(model, "pid", base="sdpa")
    ph.convert(model, "pid")
    assert model.config.attention_base == "eager"  # Gemma 2's logit softcapping needs eager
    forward(model, **inputs("gemma2"))
    _, llama = build("llama")
    with pytest.raises(ValueError, match="base='eager'"):
        llama(**inputs("llama"), output_attentions=True)
    stock, eager = build("llama")
    ph.convert(eager, "pid", base="eager")
    stock.set_attn_implementation("eager")
    x = inputs("llama")
    with torch.no_grad():
        out = eager(**x, output_attentions=True)
        want = stock(**x, output_attentions=True)
    assert len(out.attentions) == 2
    torch.testing.assert_close(out.attentions[0], want.attentions[0])  # first layer: same queries and keys


@pytest.mark.slow
def test_flex_attention_base():
    stock, model = build("llama")
    stock.set_attn_implementation("flex_attention")
    ph.convert(model, "pid", base="flex_attention")
    x = inputs("llama", n=1)
    assert not torch.allclose(forward(model, **x), forward(stock, **x), atol=1e-4)
    model.config.pid = ZERO
    assert torch.equal(forward(model, **x), forward(stock, **x))
    with pytest.raises(ValueError, match="does not support flex attention"):
        ph.convert(build("gpt2")[1], "pid", base="flex_attention")


@pytest.mark.slow
def test_static_cache_decoding_compiles_fullgraph_without_recompiles():
    from torch._dynamo.utils import counters

    _, model = build("llama")
    ids = inputs("llama")["input_ids"]

    def decode(step, n=5):
        cache = T.StaticCache(config=model.config, max_cache_len=16)
        with torch.no_grad():
            tok = model(ids, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)  # eager prefill
            toks = [tok]
            for _ in range(n):
                tok = step(input_ids=tok, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
                toks.append(tok)
        return torch.cat(toks, 1)

    eager = decode(model)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, fullgraph=True, backend="eager")  # fullgraph: a graph break raises
    assert torch.equal(decode(compiled), eager)
    assert counters["stats"]["unique_graphs"] == 1  # one graph for every step: no recompile
    assert not counters["graph_break"]
    torch._dynamo.reset()


def test_static_sliding_window_cache_is_refused():
    _, model = build("mistral")
    with pytest.raises(NotImplementedError, match="static sliding-window cache"):
        model.generate(inputs("mistral")["input_ids"], max_new_tokens=2, do_sample=False, pad_token_id=0,
                       cache_implementation="static")


def test_attention_outside_the_interface_is_refused_naming_the_module():
    class CustomAttention(torch.nn.Module):  # computes attention itself, as remote code may
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(32, 32)

        def forward(self, x):
            return self.proj(x)

    _, model = build("llama")
    model.model.layers[1].extra = CustomAttention()
    with pytest.raises(ValueError, match=r"LlamaModel\.layers\.1\.extra \(CustomAttention\) computes attention"):
        ph.convert(model, "pid")


def test_positional_past_key_values():
    _, model = build("llama")
    ids = inputs("llama")["input_ids"]
    cache = T.DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids[:, :4], past_key_values=cache, use_cache=True)
        step = model.model(ids[:, 4:], None, None, cache).last_hidden_state  # positional past_key_values
        full = model.model(ids).last_hidden_state
    torch.testing.assert_close(step, full[:, 4:], rtol=1e-4, atol=1e-5)


def test_reentrant_checkpointing_refused_on_every_path(tmp_path):
    _, model = build("llama")
    model.save_pretrained(tmp_path)
    x = inputs("llama")
    for kwargs in ({"use_reentrant": True}, {"preserve_rng_state": True}):  # the latter: torch's default, reentrant
        fresh = T.AutoModelForCausalLM.from_pretrained(tmp_path)  # first forward of a freshly loaded model
        assert fresh.config._attn_implementation == "pid"
        fresh.train()
        fresh.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        with pytest.raises(ValueError, match="use_reentrant': False"):
            fresh(**x, labels=x["input_ids"])


def test_switch_back_to_sdpa_reloads_as_sdpa_and_base_is_saved(tmp_path):
    _, model = build("gemma2")  # base eager
    model.save_pretrained(tmp_path / "pid")
    again = T.AutoModelForCausalLM.from_pretrained(tmp_path / "pid")
    assert again.config._attn_implementation == "pid" and again.config.attention_base == "eager"
    x = inputs("gemma2")
    assert torch.equal(forward(again, **x), forward(model, **x))
    model.set_attn_implementation("eager")
    model.save_pretrained(tmp_path / "plain")
    assert T.AutoModelForCausalLM.from_pretrained(tmp_path / "plain").config._attn_implementation != "pid"


def test_control_first_layer_false_runs_and_is_saved(tmp_path):
    cfg = PIDConfig(0.4, 0.5, 0.1, 0.3, control_first_layer=False)
    stock, model = build("llama", pid=cfg)
    x = inputs("llama")
    model.save_pretrained(tmp_path)
    assert PIDConfig.from_dict(T.AutoModelForCausalLM.from_pretrained(tmp_path).config.pid) == cfg
    make, cls, *_ = FAMILIES["llama"]
    torch.manual_seed(0)
    one = cls(make().__class__(**{**DEC, "num_hidden_layers": 1})).eval()
    ref = cls(make().__class__(**{**DEC, "num_hidden_layers": 1})).eval()
    ref.load_state_dict(one.state_dict())
    ph.convert(one, "pid", cfg)
    assert torch.equal(forward(one, **x), forward(ref, **x))
    assert not torch.allclose(forward(model, **x), forward(stock, **x))


def test_a_stack_whose_forward_takes_no_kwargs_is_refused():
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    class Stack(T.LlamaPreTrainedModel):
        def __init__(self, config):
            super().__init__(config)
            self.layers = torch.nn.ModuleList([LlamaDecoderLayer(config, 0)])
            self.post_init()

        def forward(self, hidden_states):
            return self.layers[0](hidden_states)

    with pytest.raises(ValueError, match=r"Stack\.forward takes no \*\*kwargs"):
        ph.convert(Stack(T.LlamaConfig(**DEC)), "pid")


def test_set_attn_implementation_route_is_refused_until_convert_then_saves_and_reloads_as_pid(tmp_path):
    stock, _ = build("llama")
    model = FAMILIES["llama"][1](FAMILIES["llama"][0]()).eval()
    model.load_state_dict(stock.state_dict())
    model.set_attn_implementation("pid")  # a stock model carries nothing of ours: refused, naming convert
    x = inputs("llama")
    with pytest.raises(RuntimeError, match=r"Call pid_plugins\.hf\.convert\(model, 'pid'\) once"):
        forward(model, **x)
    ph.convert(model, "pid")
    model.save_pretrained(tmp_path)  # before any forward
    out = forward(model, **x)
    assert not torch.allclose(out, forward(stock, **x), atol=1e-4)
    again = T.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert again.config._attn_implementation == "pid"
    assert torch.equal(forward(again, **x), out)


def test_reloading_without_the_import_stops_in_transformers(tmp_path, monkeypatch):
    """Documented behaviour: transformers offers no hook for a better message than its own."""
    _, model = build("llama")
    model.save_pretrained(tmp_path)
    monkeypatch.delitem(T.AttentionInterface._global_mapping, "pid")  # as if pid_plugins.hf were not imported
    with pytest.raises(ValueError, match='attn_implementation="pid"` is not supported'):
        T.AutoModelForCausalLM.from_pretrained(tmp_path)


def test_an_encoder_and_a_decoder_under_one_model_are_separate_groups():
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    class Both(T.LlamaPreTrainedModel):  # encoder and decoder stacks as plain modules of one model
        def __init__(self, config):
            super().__init__(config)
            self.encoder = torch.nn.ModuleList([LlamaDecoderLayer(config, i) for i in range(2)])
            self.decoder = torch.nn.ModuleList([LlamaDecoderLayer(config, i) for i in range(2)])
            self.post_init()

        def forward(self, hidden_states, **kwargs):
            return hidden_states

    model = ph.convert(Both(T.LlamaConfig(**DEC)), "pid")
    chain = [(m._pid_plugins_index, m._pid_plugins_earlier) for m in model.modules()
             if hasattr(m, "_pid_plugins_earlier")]
    assert chain == [(0, ()), (1, (0,)), (2, ()), (3, (2,))]  # the decoder's first layer starts its own group


def test_one_attention_module_shared_by_several_layers_is_refused():
    model = T.AlbertModel(T.AlbertConfig(vocab_size=V, embedding_size=16, hidden_size=32, num_hidden_layers=2,
                                         num_attention_heads=4, intermediate_size=64)).eval()
    ph.convert(model, "pid")
    with pytest.raises(RuntimeError, match="AlbertSDPAAttention ran twice|ran twice in one forward"):
        forward(model, input_ids=inputs("bert")["input_ids"])


def test_a_pid_model_pickles_and_deep_copies():
    import copy
    import io

    _, model = build("llama")
    x = inputs("llama")
    forward(model, **x)  # after a forward too: what the forward chose (functions made in this process) is not pickled
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    for clone in (torch.load(buf, weights_only=False), copy.deepcopy(model)):  # our own bytes, not a checkpoint
        assert clone.config._attn_implementation == "pid"
        assert torch.equal(forward(clone, **x), forward(model, **x))
    twin = copy.deepcopy(model)
    twin.set_attn_implementation("sdpa")
    assert twin.config.to_dict()["attn_implementation"] is None  # the copy's saved value follows the copy
    assert model.config.to_dict()["attn_implementation"] == "pid"
