"""The attention-method contract in fairseq, with the toy method ``scaled_reference`` (tests/toy_method.py):
picked with ``--attention-method scaled_reference --attention-cfg JSON`` on ``--arch transformer_lm_pid``, the
user's path; nothing in the adapter knows the toy."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("fairseq")
import pid_plugins.fairseq as pf  # noqa: E402
from toy_method import METHOD, ScaledReferenceConfig, toy_rule  # noqa: E402
from zoo_cases import (data_dir, fairseq_reference, fs_incremental_logits, fs_method,  # noqa: E402,F401
                       fs_save_and_reload, fs_tiny)
from zoo_cases import fs_build as build  # noqa: E402
from zoo_cases import fs_logits as logits  # noqa: E402
from zoo_cases import fs_parse as parse  # noqa: E402
from zoo_cases import fs_tokens as tokens  # noqa: E402

TESTS = Path(__file__).resolve().parent
BIN = Path(sys.executable).parent
TINY = fs_tiny()


def toy(gamma):
    return fs_method("scaled_reference", {"gamma": gamma})


def test_toy_is_selected_by_name_and_reaches_every_layer(data_dir):
    args = parse(data_dir, extra=toy(0.3))
    assert (args.attention_method, json.loads(args.attention_cfg)) == ("scaled_reference", {"gamma": 0.3})
    model, _, _ = build(data_dir, extra=toy(0.3))
    assert isinstance(model.decoder, pf.PIDTransformerDecoder)
    for layer in model.decoder.layers:
        assert type(layer) is pf.PIDTransformerDecoderLayer and type(layer.self_attn) is pf.PIDMultiheadAttention
        assert layer.self_attn.attention_method is METHOD
        assert layer.self_attn.attention_config == ScaledReferenceConfig(gamma=0.3)
    # unset parameters: the method's preset; a preset name as a JSON string
    default, _, _ = build(data_dir, extra=["--attention-method", "scaled_reference"])
    assert default.decoder.layers[0].self_attn.attention_config == ScaledReferenceConfig.preset("default")
    strong, _, _ = build(data_dir, extra=["--attention-method", "scaled_reference", "--attention-cfg", '"strong"'])
    assert strong.decoder.layers[0].self_attn.attention_config.gamma == 2.0
    # the catalogue's architectures take the method too (their PID gains are not filled in then)
    wide, _, _ = build(data_dir, arch="transformer_lm_pid_wikitext103", extra=toy(0.3))
    assert wide.decoder.layers[0].self_attn.attention_method is METHOD


def test_float64_reference_of_the_decoder_stack(data_dir):
    """The toy model against the stock transformer_lm's modules run by hand, attention written out in float64
    and the toy's rule from naive_scaled_reference (position by position)."""
    gamma = 0.3
    stock, _, _ = build(data_dir, arch="transformer_lm")
    model, _, _ = build(data_dir, extra=toy(gamma), seed=1)
    model.load_state_dict(stock.state_dict(), strict=True)
    stock, model = stock.double(), model.double()
    toks = tokens()
    got = logits(model, toks)
    with torch.no_grad():
        want = fairseq_reference(stock, toks, toy_rule(gamma))
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    assert not torch.allclose(got, logits(stock, toks))  # the toy does change the model


def test_gamma_zero_is_the_stock_transformer_lm_bit_for_bit(data_dir):
    stock, _, _ = build(data_dir, arch="transformer_lm")
    zero, _, _ = build(data_dir, extra=toy(0.0))
    assert all(torch.equal(a, b) for (n, a), (_, b) in zip(stock.state_dict().items(), zero.state_dict().items())
               if not n.endswith("_float_tensor"))  # same modules in the same order: a seed gives the same weights
    zero.load_state_dict(stock.state_dict(), strict=True)
    toks = tokens()
    toks[0, -3:] = 1  # padding
    assert torch.equal(logits(zero, toks), logits(stock, toks))
    for m in (stock, zero):  # training mode, with dropout
        m.train()
        m.decoder.dropout_module.p = 0.1
    torch.manual_seed(5)
    a = stock(toks)[0]
    torch.manual_seed(5)
    b = zero(toks)[0]
    assert torch.equal(a, b)
    a.sum().backward()
    b.sum().backward()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(stock.parameters(), zero.parameters()))


def test_incremental_decoding_equals_recomputation_and_is_causal(data_dir):
    model, _, _ = build(data_dir, extra=toy(0.7))
    toks = tokens(length=9)
    full = logits(model, toks)
    torch.testing.assert_close(fs_incremental_logits(model, toks), full, rtol=1e-5, atol=1e-5)
    # beam reordering: the cache follows the rows
    state, order = {}, torch.tensor([1, 0])
    with torch.no_grad():
        for t in range(1, 5):
            model(toks[:, :t], incremental_state=state)
        model.decoder.reorder_incremental_state_scripting(state, order)
        swapped = toks[order]
        out = [model(swapped[:, :t], incremental_state=state)[0][:, -1] for t in range(5, 10)]
    torch.testing.assert_close(torch.stack(out, 1), logits(model, swapped)[:, 4:], rtol=1e-5, atol=1e-5)
    # no position depends on a later token
    for j in (3, 6):
        changed = toks.clone()
        changed[:, j] = (changed[:, j] - 4 + 7) % 40 + 4
        other = logits(model, changed)
        torch.testing.assert_close(other[:, :j], full[:, :j], rtol=1e-6, atol=1e-6)
        assert not torch.allclose(other[:, j:], full[:, j:])


@pytest.mark.slow
def test_decoder_forward_compiles_fullgraph(data_dir):
    model, _, _ = build(data_dir, extra=toy(0.4))
    decoder = model.decoder
    toks = tokens(length=8)
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(decoder, fullgraph=True, backend="eager")(toks)[0], decoder(toks)[0],
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_save_and_reload_through_fairseq_checkpoint_utils(data_dir, tmp_path):
    model, task, args = build(data_dir, extra=toy(0.4))
    path = str(tmp_path / "checkpoint_toy.pt")
    loaded = fs_save_and_reload(model, task, args, path)
    saved = torch.load(path, map_location="cpu", weights_only=True)
    assert saved["cfg"]["model"]["attention_method"] == "scaled_reference"
    assert loaded.decoder.layers[0].self_attn.attention_method is METHOD
    assert loaded.decoder.layers[0].self_attn.attention_config == ScaledReferenceConfig(gamma=0.4)
    toks = tokens()
    assert torch.equal(logits(loaded, toks), logits(model, toks))


def test_refusals(data_dir):
    with pytest.raises(ValueError, match="--checkpoint-activations is not supported by transformer_lm_pid"):
        build(data_dir, extra=[*toy(0.3), "--checkpoint-activations"])
    with pytest.raises(ValueError, match=r"unknown attention method 'nope': choose 'softmax' or one of \[.*'pid'.*"
                                         r"'scaled_reference'"):
        build(data_dir, extra=["--attention-method", "nope"])
    with pytest.raises(ValueError, match=r"unknown ScaledReferenceConfig field\(s\) \['learnable'\]"):
        build(data_dir, extra=["--attention-method", "scaled_reference", "--attention-cfg", '{"learnable": true}'])
    with pytest.raises(ValueError, match="--pid-beta, --pid-lambda-p set PID's parameters but --attention-method is "
                                         "scaled_reference"):
        build(data_dir, extra=[*toy(0.3), "--pid-lambda-p", "0.2", "--pid-beta", "0.5"])
    with pytest.raises(ValueError, match="--pid-attention softmax conflicts with --attention-method scaled_reference"):
        build(data_dir, extra=[*toy(0.3), "--pid-attention", "softmax"])
    with pytest.raises(ValueError, match="--attention-cfg must be a JSON object"):
        build(data_dir, extra=["--attention-method", "scaled_reference", "--attention-cfg", "gamma=0.3"])
    with pytest.raises(ValueError, match="PID's parameters are given twice, as --attention-cfg and as --pid-lambda-p"):
        build(data_dir, extra=["--attention-cfg", '{"lambda_p": 0.2}', "--pid-lambda-p", "0.3"])


def test_pid_through_the_new_options(data_dir):
    """--attention-cfg for PID equals the --pid-* spelling; --attention-method softmax is the stock model."""
    a, _, _ = build(data_dir, extra=["--attention-cfg", '{"lambda_p": 0.2, "beta": 0.9}'])
    b, _, _ = build(data_dir, extra=["--pid-lambda-p", "0.2", "--pid-beta", "0.9"])
    assert a.decoder.layers[0].self_attn.attention_config == b.decoder.layers[0].self_attn.attention_config
    assert a.decoder.layers[0].self_attn.attention_config.gains == (0.2, 0.5, 0.1, 0.9)
    toks = tokens()
    assert torch.equal(logits(a, toks), logits(b, toks))
    softmax, _, _ = build(data_dir, extra=["--attention-method", "softmax"])
    assert all(layer.self_attn.attention_method is None for layer in softmax.decoder.layers)
    stock, _, _ = build(data_dir, arch="transformer_lm")
    softmax.load_state_dict(stock.state_dict(), strict=True)
    assert torch.equal(logits(softmax, toks), logits(stock, toks))


def test_learnable_attention_params_are_per_layer_parameters(data_dir):
    model, _, _ = build(data_dir, extra=["--attention-cfg", '{"learnable": true}'])
    names = [n for n, _ in model.named_parameters() if "attention_params" in n]
    assert len(names) >= len(model.decoder.layers) and all(".self_attn.attention_params." in n for n in names)
    model.train()
    model(tokens())[0].sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all()
               for n, p in model.named_parameters() if "attention_params" in n)


@pytest.mark.slow
def test_fairseq_train_cli_with_a_method_from_the_users_user_dir(tmp_path, tiny_fairseq_data_bin):
    """fairseq-train --arch transformer_lm_pid --attention-method scaled_reference, the toy registered by the user's
    own --user-dir (which imports pid_plugins.fairseq); the checkpoint reloads with the method and its parameters."""
    user_dir = tmp_path / "my_methods_user_dir"
    user_dir.mkdir()
    (user_dir / "__init__.py").write_text(
        f"import sys\nsys.path.insert(0, {str(TESTS)!r})\nimport pid_plugins.fairseq  # noqa\nimport toy_method  # noqa\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS.parent), os.environ.get("PYTHONPATH", "")]))

    def run(cmd):
        proc = subprocess.run([str(BIN / cmd[0]), *map(str, cmd[1:])], cwd=tmp_path, capture_output=True, text=True,
                              timeout=900, env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]

    run(["fairseq-train", tiny_fairseq_data_bin, "--task", "language_modeling", "--user-dir", user_dir, "--arch",
         "transformer_lm_pid", *TINY, "--max-tokens", "128", "--optimizer", "adam", "--lr", "0.001", "--max-update",
         "2", "--cpu", "--num-workers", "0", "--save-dir", "ck", "--no-epoch-checkpoints", *toy(0.25)])
    state = torch.load(tmp_path / "ck" / "checkpoint_last.pt", map_location="cpu", weights_only=True)
    assert state["cfg"]["model"]["attention_method"] == "scaled_reference"
    assert json.loads(state["cfg"]["model"]["attention_cfg"]) == {"gamma": 0.25}
    hub = pf.load_pid_lm(str(tmp_path / "ck" / "checkpoint_last.pt"), str(tiny_fairseq_data_bin))
    attn = hub.models[0].decoder.layers[0].self_attn
    assert attn.attention_method is METHOD and attn.attention_config == ScaledReferenceConfig(gamma=0.25)
    assert torch.isfinite(hub.score("w1 w2 w3")["positional_scores"]).all()


def test_warmup_with_a_non_additive_method_is_refused(data_dir):
    """Warm-up runs fairseq's fused attention plus the method's term: a method without a separate term is refused
    (the method is handed to the decoder directly, so the registry stays as it is for other tests)."""
    from dataclasses import dataclass

    import pid_plugins
    from pid_plugins.core import MethodChoice

    @dataclass(frozen=True)
    class Cfg(pid_plugins.MethodConfig):
        warmup_steps: int = 0

    class Doubled(pid_plugins.AttentionMethod):
        name = "doubled"
        config_type = Cfg
        state_fields = ()
        additive = False

        def update(self, params, out, value_q, state, scale, head_dim):
            return 2 * out, ()

    stock, task, args = build(data_dir, arch="transformer_lm")
    args.max_target_positions = args.tokens_per_sample  # as build_model sets it
    embed = stock.decoder.embed_tokens
    decoder = pf.PIDTransformerDecoder(args, task.target_dictionary, embed, no_encoder_attn=True,
                                       choice=MethodChoice(Doubled(), Cfg()))  # no warm-up: fine
    assert decoder.attention_warmup is None
    with pytest.raises(ValueError, match="'doubled'.* not additive.*set warmup_steps=0"):
        pf.PIDTransformerDecoder(args, task.target_dictionary, embed, no_encoder_attn=True,
                                 choice=MethodChoice(Doubled(), Cfg(warmup_steps=5)))
