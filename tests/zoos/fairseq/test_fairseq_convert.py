"""``pid_plugins.fairseq.convert`` where fairseq's own paths meet it."""
import pytest
import torch

pytest.importorskip("fairseq")
import pid_plugins.fairseq as pf  # noqa: E402
from method_cases import variants  # noqa: E402
from fairseq.models.transformer import TransformerDecoder  # noqa: E402
from fairseq.models.transformer_lm import TransformerLanguageModel  # noqa: E402
from zoo_cases import (data_dir, fs_build, fs_incremental_logits, fs_logits, fs_method,  # noqa: E402,F401
                       fs_save_checkpoint, fs_tokens)

VARIANTS = variants(warmup_steps=4)


def stock_model(data_dir, extra=()):
    return fs_build(data_dir, arch="transformer_lm", extra=extra)[:2]


def built(data_dir, key):
    """The model --arch transformer_lm_pid --attention-method ... builds (eval mode), and its task."""
    name, cfg = VARIANTS[key]
    return fs_build(data_dir, extra=fs_method(name, cfg), seed=1)[:2]


def padded_tokens(length=10):
    toks = fs_tokens(length=length)
    toks[0, -3:] = 1  # padding at the end of the first row
    return toks


def generate(model, task):
    from fairseq.sequence_generator import SequenceGenerator

    sample = {"net_input": {"src_tokens": fs_tokens(n=2, length=4), "src_lengths": torch.tensor([4, 4])}}
    gen = SequenceGenerator([model], task.target_dictionary, beam_size=3, max_len_b=6)
    with torch.no_grad():
        hyps = gen.generate([model], sample, prefix_tokens=sample["net_input"]["src_tokens"])
    return [[(h["tokens"].tolist(), h["score"].item()) for h in hyp] for hyp in hyps]


def snapshot(model):
    """Every module's class and attributes, and the state_dict (keys and tensors)."""
    return ([(name, type(m), sorted(vars(m)), sorted(m._modules), sorted(m._parameters), sorted(m._buffers))
             for name, m in model.named_modules()],
            {k: v.clone() for k, v in model.state_dict().items()})


def _same_bits(x, y):
    """Bit for bit."""
    return x.dtype == y.dtype and x.shape == y.shape and torch.equal(x.reshape(-1).view(torch.uint8),
                                                                     y.reshape(-1).view(torch.uint8))


def same_snapshot(a, b):
    """Whether two snapshots are equal; prints what differs (a module's attributes, or a tensor) when not."""
    modules = [(x, y) for x, y in zip(a[0], b[0]) if x != y] + ([("modules", len(a[0]), len(b[0]))]
                                                                if len(a[0]) != len(b[0]) else [])
    tensors = [k for k in a[1] if k not in b[1] or not _same_bits(a[1][k], b[1][k])] + [k for k in b[1] if k not in a[1]]
    for x, y in modules:
        print("module differs:", x, y)
    for k in tensors:
        print("tensor differs:", k, a[1].get(k), b[1].get(k))
    return not modules and not tensors


def assert_same_function(model, reference, task, incremental=True):
    toks = padded_tokens()
    assert torch.equal(fs_logits(model, toks), fs_logits(reference, toks))
    if incremental:
        toks = fs_tokens(length=8)
        assert torch.equal(fs_incremental_logits(model, toks), fs_incremental_logits(reference, toks))
        assert generate(model, task) == generate(reference, task)


def test_training_mode_is_kept_and_new_modules_follow_it(data_dir):
    stock, _ = stock_model(data_dir)
    stock.train()
    pf.convert(stock, "pid", {"learnable": True, "warmup_steps": 3})
    assert stock.training and stock.decoder.attention_warmup.training
    assert all(layer.self_attn.attention_params.training for layer in stock.decoder.layers)
    assert all(p.param_group == pf.METHOD_PARAM_GROUP for n, p in stock.named_parameters() if ".attention_params." in n)
    stock(fs_tokens())
    assert int(stock.decoder.attention_warmup.step) == 1


def test_transformer_lm_pid_adds_nothing_to_the_root_but_build_model():
    """Why convert leaves a model's root class alone: transformer_lm_pid's model class only builds."""
    own = {name for name in vars(pf.PIDTransformerLanguageModel) if not name.startswith("__")}
    assert own == {"build_model"}


def test_hub_interface_converts_its_models(data_dir, tmp_path):
    """A stock transformer_lm checkpoint loaded with load_pid_lm (fairseq's hub interface), converted as a whole."""
    stock, task, args = fs_build(data_dir, arch="transformer_lm")
    path = tmp_path / "checkpoint_stock.pt"
    fs_save_checkpoint(stock, args, str(path))
    hub = pf.load_pid_lm(str(path), str(data_dir))
    assert type(hub.models[0]) is TransformerLanguageModel
    assert pf.convert(hub, "neutreno") is hub
    assert type(hub.models[0]) is TransformerLanguageModel and type(hub.models[0].decoder) is pf.PIDTransformerDecoder
    reference, _ = built(data_dir, "neutreno")
    reference.load_state_dict(hub.models[0].state_dict(), strict=True)
    assert_same_function(hub.models[0], reference, task)  # incremental decoding and beam search too
    scored = hub.score("w1 w2 w3 w4")
    assert torch.isfinite(scored["positional_scores"]).all()
    pf.convert(hub, "softmax")
    assert type(hub.models[0]) is TransformerLanguageModel
    assert torch.equal(fs_logits(hub.models[0], padded_tokens()), fs_logits(stock, padded_tokens()))


def test_refusals_change_nothing(data_dir):
    """fairseq's own refusals (the zoo contract runs the common ones)."""
    stock, _ = stock_model(data_dir)
    before = snapshot(stock)
    with pytest.raises(TypeError, match=r"TransformerLanguageModel.*got TransformerDecoder"):
        pf.convert(stock.decoder, "pid")
    assert same_snapshot(snapshot(stock), before)
    ckpt, _ = stock_model(data_dir, extra=["--checkpoint-activations"])
    before = snapshot(ckpt)
    with pytest.raises(TypeError, match="decoder layer 0 has its forward replaced"):
        pf.convert(ckpt, "pid")
    assert same_snapshot(snapshot(ckpt), before)
    mixed, _ = stock_model(data_dir)
    from fairseq.modules.checkpoint_activations import checkpoint_wrapper

    checkpoint_wrapper(mixed.decoder.layers[2])
    before = snapshot(mixed)
    with pytest.raises(TypeError, match="decoder layer 2 has its forward replaced"):
        pf.convert(mixed, "pid")
    assert same_snapshot(snapshot(mixed), before)
    cross, _ = stock_model(data_dir)
    cross.decoder.cross_self_attention = True  # (a decoder built with fairseq's cross_self_attention)
    before = snapshot(cross)
    with pytest.raises(TypeError, match="--cross-self-attention is not supported"):
        pf.convert(cross, "pid")
    assert same_snapshot(snapshot(cross), before)
