"""``pid_plugins.fairseq.convert``: a loaded fairseq ``transformer_lm`` switched to a method in place, and back.

stock -> method is the model ``--arch transformer_lm_pid --attention-method NAME`` builds with the same weights
(full forward, incremental decoding, beam search), bit for bit; -> softmax is fairseq's own model again (classes,
attributes, state_dict keys, outputs bit for bit); method -> other method and learnable on/off reconfigure in
place; the parameter tensors stay the model's own; a refusal changes nothing."""
import pytest
import torch

pytest.importorskip("fairseq")
import pid_plugins.fairseq as pf  # noqa: E402
from method_cases import variants  # noqa: E402
from fairseq.models.transformer import TransformerDecoder  # noqa: E402
from fairseq.models.transformer_lm import TransformerLanguageModel  # noqa: E402
from fairseq.modules.multihead_attention import MultiheadAttention  # noqa: E402
from fairseq.modules.transformer_layer import TransformerDecoderLayerBase  # noqa: E402
from zoo_cases import (data_dir, fs_build, fs_incremental_logits, fs_logits, fs_method,  # noqa: E402,F401
                       fs_save_checkpoint, fs_tokens)

#: every built-in method (fairseq's preset), learnable and with warm-up where it has them (tests/method_cases.py)
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
    """Bit for bit: fairseq's ``embed_positions._float_tensor`` is an uninitialised buffer (``torch.FloatTensor(1)``),
    which may hold a NaN, unequal to itself under ``torch.equal``."""
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


@pytest.mark.parametrize("key", VARIANTS)
def test_stock_to_method_is_the_built_model_with_the_same_weights(data_dir, key):
    name, cfg = VARIANTS[key]
    stock, task = stock_model(data_dir)
    params = {n: p for n, p in stock.named_parameters()}
    buffers = {n: b for n, b in stock.named_buffers()}
    assert pf.convert(stock, name, cfg) is stock
    model = stock
    # the root keeps its class (transformer_lm_pid's adds nothing but build_model); the decoder, its layers and their
    # self-attention are replaced in their parents (no class is reassigned)
    assert type(model) is TransformerLanguageModel and type(model.decoder) is pf.PIDTransformerDecoder
    assert all(type(layer) is pf.PIDTransformerDecoderLayer and type(layer.self_attn) is pf.PIDMultiheadAttention
               for layer in model.decoder.layers)
    assert not model.training  # the mode is kept (eval here)
    # the same tensors; only the method's own parameters and counter are new
    assert all(p is params[n] for n, p in model.named_parameters() if n in params)
    assert all(b is buffers[n] for n, b in model.named_buffers() if n in buffers)
    reference, _ = built(data_dir, key)
    assert list(model.state_dict()) == list(reference.state_dict())  # the built model's keys, in its order
    assert {n for n, _ in model.named_parameters()} - set(params) == {
        n for n, _ in reference.named_parameters() if ".attention_params." in n}
    reference.load_state_dict(model.state_dict(), strict=True)
    for layer, ref_layer in zip(model.decoder.layers, reference.decoder.layers):
        assert layer.self_attn.attention_method is ref_layer.self_attn.attention_method
        assert layer.self_attn.attention_config == ref_layer.self_attn.attention_config
    if cfg and cfg.get("learnable"):
        assert all(p.param_group == pf.METHOD_PARAM_GROUP
                   for n, p in model.named_parameters() if ".attention_params." in n)
    if (cfg or {}).get("warmup_steps"):
        assert model.decoder.attention_warmup.warmup_steps == 4 and not model.decoder.attention_warmup.training
        for m in (model, reference):  # a few training forwards, so the scale is neither 0 nor 1
            m.train()
            for _ in range(2):
                m(fs_tokens())
            m.eval()
        assert int(model.decoder.attention_warmup.step) == int(reference.decoder.attention_warmup.step) == 2
    assert_same_function(model, reference, task)


# one variant of each kind (fixed, learnable, warm-up, a method with its own attend, a second learnable method): the
# way back to softmax removes what the kind added, the same for every method of the kind
@pytest.mark.parametrize("key", ["pid", "learnable_pid", "pid_warmup", "twicing", "learnable_value_residual"])
def test_back_to_softmax_is_fairseqs_own_model_bit_for_bit(data_dir, key):
    name, cfg = VARIANTS[key]
    stock, task = stock_model(data_dir)
    fresh, _ = stock_model(data_dir)  # fairseq's own model, the same weights (seed 0)
    before = snapshot(stock)
    params = [id(p) for p in stock.parameters()]
    pf.convert(stock, name, cfg)
    if (cfg or {}).get("warmup_steps"):
        stock.train()
        stock(fs_tokens())
        stock.eval()
    assert pf.convert(stock, "softmax") is stock
    assert type(stock) is TransformerLanguageModel and type(stock.decoder) is TransformerDecoder
    assert all(type(layer) is TransformerDecoderLayerBase and type(layer.self_attn) is MultiheadAttention
               for layer in stock.decoder.layers)
    assert same_snapshot(snapshot(stock), before)  # no attribute, parameter, buffer or submodule left over
    assert [id(p) for p in stock.parameters()] == params
    assert list(stock.state_dict()) == list(fresh.state_dict())
    assert_same_function(stock, fresh, task)
    # fairseq's model trains as before: gradients bit for bit
    for m in (stock, fresh):
        m.train()
        m(fs_tokens())[0].sum().backward()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(stock.parameters(), fresh.parameters()))


# chosen transitions: fixed <-> learnable, warm-up on and off, to and from a method with its own attend
@pytest.mark.parametrize("start, target", [("pid", "neutreno"), ("learnable_pid", "twicing"),
                                           ("twicing", "pid_warmup"), ("pid_warmup", "pid"),
                                           ("pid", "learnable_pid"), ("learnable_pid", "pid"),
                                           ("value_residual", "learnable_value_residual")])
def test_method_to_other_method_in_place(data_dir, start, target):
    """A transformer_lm_pid model (built by --arch) reconfigured: the model built for the target, same weights."""
    model, task = built(data_dir, start)
    params = {n: p for n, p in model.named_parameters() if ".attention_params." not in n}
    name, cfg = VARIANTS[target]
    assert pf.convert(model, name, cfg) is model
    reference, _ = built(data_dir, target)
    assert list(model.state_dict()) == list(reference.state_dict())
    assert all(p is params[n] for n, p in model.named_parameters() if n in params)
    if not (cfg or {}).get("learnable"):
        assert not any(".attention_params." in n for n, _ in model.named_parameters())
    assert ("attention_warmup" in dict(model.decoder.named_children())) == bool((cfg or {}).get("warmup_steps"))
    reference.load_state_dict(model.state_dict(), strict=True)
    assert_same_function(model, reference, task)


def test_training_mode_is_kept_and_new_modules_follow_it(data_dir):
    stock, _ = stock_model(data_dir)
    stock.train()
    pf.convert(stock, "pid", {"learnable": True, "warmup_steps": 3})
    assert stock.training and stock.decoder.attention_warmup.training
    assert all(layer.self_attn.attention_params.training for layer in stock.decoder.layers)
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
    assert_same_function(hub.models[0], reference, task, incremental=False)
    scored = hub.score("w1 w2 w3 w4")
    assert torch.isfinite(scored["positional_scores"]).all()
    pf.convert(hub, "softmax")
    assert type(hub.models[0]) is TransformerLanguageModel
    assert torch.equal(fs_logits(hub.models[0], padded_tokens()), fs_logits(stock, padded_tokens()))


def test_refusals_change_nothing(data_dir):
    stock, _ = stock_model(data_dir)
    pid, _ = built(data_dir, "learnable_pid")
    for model in (stock, pid):
        compiled = torch.compile(model)  # (which marks the model itself: before the snapshot)
        before = snapshot(model)
        with pytest.raises(ValueError, match=r"unknown attention method 'nope'"):
            pf.convert(model, "nope")
        with pytest.raises(ValueError, match=r"PIDConfig.beta"):
            pf.convert(model, "pid", {"beta": 0})
        with pytest.raises(ValueError, match=r"unknown PIDConfig field"):
            pf.convert(model, "pid", {"gamma": 0.3})
        with pytest.raises(TypeError, match=r"TransformerLanguageModel.*got PIDTransformerDecoder|"
                                            r"TransformerLanguageModel.*got TransformerDecoder"):
            pf.convert(model.decoder, "pid")
        with pytest.raises(TypeError, match="convert the model before torch.compile"):
            pf.convert(compiled, "pid")
        assert same_snapshot(snapshot(model), before)
    # activation checkpointing replaces the layers' forward: refused, even when only the last layer has it
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
