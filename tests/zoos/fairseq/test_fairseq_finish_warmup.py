"""``pid_plugins.finish_warmup(model)`` on fairseq models (transformer_lm_pid with --attention-cfg warmup_steps;
PID and learnable PID, built by --arch or converted from transformer_lm; the zoo contract,
tests/core/test_zoo_contract.py, finishes every method that warms up).

fairseq's warm-up runs fairseq's own attention plus the method's term; after training past ``warmup_steps`` the
finished model keeps that form at scale 1: exactly (torch.equal) what the warmed-up model computed, full forward
and incremental decoding, without ``decoder.attention_warmup.step``. Its checkpoint, loaded with the warm-up switched
off (the saved cfg, or fairseq's ``arg_overrides``), loads strictly and is the model built without warm-up."""
import json
import logging

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("fairseq")
import pid_plugins  # noqa: E402
import pid_plugins.fairseq as pf  # noqa: E402
from method_cases import variants  # noqa: E402
from pid_plugins import PIDConfig  # noqa: E402
from zoo_cases import (data_dir, fs_build, fs_incremental_logits, fs_logits, fs_method,  # noqa: E402,F401
                       fs_parse, fs_save_checkpoint, fs_tokens)

N = 3
KEY = "decoder.attention_warmup.step"
VARIANTS = variants(methods=lambda m: m.warmup)
SPELLINGS = {spelling: fs_method(name, {**(cfg or {}), "warmup_steps": N})
             for spelling, (name, cfg) in VARIANTS.items()}
PLAIN = {spelling: fs_method(name, cfg or {}) for spelling, (name, cfg) in VARIANTS.items()}


def build(data_dir, spelling, converted=False):
    """(model in training mode, task, args): built by --arch transformer_lm_pid, or a transformer_lm converted."""
    if converted:
        stock, task, args = fs_build(data_dir, arch="transformer_lm")
        name, cfg = VARIANTS[spelling]
        return pf.convert(stock, name, {**(cfg or {}), "warmup_steps": N}).train(), task, args
    model, task, args = fs_build(data_dir, extra=SPELLINGS[spelling])
    return model.train(), task, args


def train(model, steps):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    toks = fs_tokens(n=4, length=12, seed=2)
    for _ in range(steps):
        opt.zero_grad()
        logits = model(toks[:, :-1])[0]
        F.cross_entropy(logits.reshape(-1, logits.size(-1)), toks[:, 1:].reshape(-1)).backward()
        opt.step()
    return model


def outputs(model):
    toks = fs_tokens(length=9)
    padded = toks.clone()
    padded[0, -3:] = 1
    return fs_logits(model, padded), fs_incremental_logits(model, toks)


CASES = [("pid", False), ("pid", True), ("learnable_pid", False)]


@pytest.mark.parametrize("spelling, converted", CASES)
def test_finished_model_is_the_warmed_up_function_without_the_counter(data_dir, spelling, converted, tmp_path):
    model, task, args = build(data_dir, spelling, converted)
    assert model.decoder.attention_warmup.warmup_steps == N
    train(model, N + 1).eval()
    assert int(model.decoder.attention_warmup.step) == N + 1 and KEY in model.state_dict()
    want = outputs(model)
    assert pid_plugins.finish_warmup(model) is model
    assert model.decoder.attention_warmup is None and KEY not in model.state_dict()
    got = outputs(model)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])  # full forward and incremental decoding
    from fairseq import checkpoint_utils

    plain_options = PLAIN[spelling]
    path = str(tmp_path / "checkpoint_finished.pt")
    fs_save_checkpoint(model, fs_parse(data_dir, extra=plain_options) if converted else args, path)
    if converted:
        overrides = {}
    else:
        overrides = {"attention_cfg": json.dumps(VARIANTS[spelling][1] or {})}
    (loaded,), _ = checkpoint_utils.load_model_ensemble([path], arg_overrides=overrides, task=task, strict=True)
    loaded.eval()
    assert loaded.decoder.attention_warmup is None and KEY not in loaded.state_dict()
    assert list(loaded.state_dict()) == list(model.state_dict())
    plain = fs_build(data_dir, extra=plain_options, seed=3)[0]
    plain.load_state_dict(model.state_dict(), strict=True)
    reloaded, rebuilt = outputs(loaded), outputs(plain)
    assert torch.equal(reloaded[0], rebuilt[0]) and torch.equal(reloaded[1], rebuilt[1])
    torch.testing.assert_close(reloaded[0], want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(reloaded[1], want[1], rtol=1e-5, atol=1e-5)
    if spelling == "pid":  # the hub interface takes the same overrides (one method: the loading path is fairseq's)
        hub = pf.load_pid_lm(path, str(data_dir), **overrides)
        assert hub.models[0].decoder.attention_warmup is None
        assert torch.equal(outputs(hub.models[0])[0], reloaded[0])
    assert not torch.equal(reloaded[0], want[0])


def test_finished_model_converts_back_to_fairseqs_own_model(data_dir):
    stock, _, _ = fs_build(data_dir, arch="transformer_lm")
    fresh, _, _ = fs_build(data_dir, arch="transformer_lm")
    want = fs_logits(fresh, fs_tokens())
    model = pid_plugins.finish_warmup(train(pf.convert(stock, "pid", {"warmup_steps": N}).train(), N).eval())
    assert "_warmup_finished" in dict(model.decoder.named_buffers())
    pf.convert(model, "softmax")
    assert sorted(vars(model.decoder)) == sorted(vars(fresh.decoder))
    assert model.decoder._non_persistent_buffers_set == fresh.decoder._non_persistent_buffers_set
    assert list(model.state_dict()) == list(fresh.state_dict())
    assert not torch.equal(fs_logits(model, fs_tokens()), want)  # (trained) but fairseq's own code runs it:
    fresh.load_state_dict(model.state_dict(), strict=True)
    assert torch.equal(fs_logits(model, fs_tokens()), fs_logits(fresh, fs_tokens()))


def test_loading_a_finished_model_with_its_warmup_on_says_what_happens(data_dir, tmp_path, caplog):
    """Saved after finish_warmup but loaded with the warm-up options of its cfg."""
    from fairseq import checkpoint_utils

    model, task, args = build(data_dir, "pid")
    pid_plugins.finish_warmup(train(model, N).eval())
    path = str(tmp_path / "checkpoint_stale_cfg.pt")
    fs_save_checkpoint(model, args, path)
    with caplog.at_level(logging.WARNING, logger="pid_plugins.fairseq.layers"):
        (loaded,), _ = checkpoint_utils.load_model_ensemble([path], task=task, strict=True)
    assert "decoder.attention_warmup.step: this checkpoint has no gain warm-up counter" in caplog.text
    finished = json.dumps(PIDConfig.preset("lm").to_dict())  # the saved --attention-cfg without its warmup_steps
    assert f"arg_overrides={{'attention_cfg': {finished!r}}}" in caplog.text
    assert int(loaded.decoder.attention_warmup.step) == 0
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="pid_plugins.fairseq.layers"):
        checkpoint_utils.load_model_ensemble([path], arg_overrides={"attention_cfg": finished}, task=task,
                                             strict=True)
    assert "no gain warm-up counter" not in caplog.text
