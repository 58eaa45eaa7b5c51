"""Value residual learning (ResFormer, ``attention="value_residual"``, pid_plugins/core/siblings/value_residual.py) in
timm, mmseg and fairseq (transformers: tests/test_method_hf_lm.py).

The reference is the rule of the official code (Zcchill/Value-Residual-Learning ``modeling_llama_resformer.py``),
written here on the zoos' own modules in float64: the group's first layer attends over its own values, every later
layer over ``lambda_1 v^1 + lambda_2 v^l``. ``(0, 1)`` is the stock model, bit for bit.
"""
from __future__ import annotations

import pytest
import torch

import pid_plugins
from pid_plugins.core.siblings.value_residual import ValueResidualConfig, ValueResidualLambdas
import pid_plugins.timm  # noqa: F401
from zoo_cases import TIMM
from zoo_cases import (attention64, fairseq_reference, fs_build, fs_dictionary, fs_incremental_logits, fs_method,
                       fs_save_and_reload, mm_inputs, mm_out, mm_pair, mmseg_reference, timm_images, timm_pair,
                       timm_reference)

NAME = "value_residual"
METHOD = pid_plugins.get_method(NAME)


def resformer(lambda_1=0.5, lambda_2=0.5):
    def rule(qs, ks, vs, mask):
        v = vs[-1].double() if len(vs) == 1 else lambda_1 * vs[0].double() + lambda_2 * vs[-1].double()
        return attention64(qs[-1], ks[-1], v, mask)
    return rule


def test_config_presets_and_off_switch():
    assert METHOD.configure(None) == ValueResidualConfig(0.5, 0.5)
    assert METHOD.configure("resformer") == ValueResidualConfig(0.5, 0.5)
    assert METHOD.is_identity(ValueResidualConfig(0.0, 1.0))
    assert not METHOD.is_identity(ValueResidualConfig(0.0, 1.0, learnable=True))
    assert isinstance(METHOD.make_learned(ValueResidualConfig(learnable=True)), ValueResidualLambdas)
    with pytest.raises(ValueError, match="lambda_1 must be a finite number"):
        METHOD.configure({"lambda_1": float("nan")})


# ==== timm
@pytest.mark.parametrize("kind", ["deit", "fan"])
def test_timm_matches_the_float64_rule_and_switches_off_bit_for_bit(kind):
    model, stock = timm_pair(kind, attention=NAME, attention_cfg={"lambda_1": 0.3, "lambda_2": 0.8})
    x = timm_images(kind)
    with torch.no_grad():
        want = timm_reference(kind, stock.double(), x.double(), resformer(0.3, 0.8))
        got = model.double()(x.double())
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
    off, stock = timm_pair(kind, attention=NAME, attention_cfg={"lambda_1": 0.0, "lambda_2": 1.0})
    with torch.no_grad():
        assert torch.equal(off(x), stock(x))


def learnable_deit(seed):
    timm = pytest.importorskip("timm")
    torch.manual_seed(seed)
    return timm.create_model(TIMM["deit"][0], attention=NAME, attention_cfg={"learnable": True}, **TIMM["deit"][2])


def test_timm_learnable_lambdas_train_and_reload(tmp_path):
    model = learnable_deit(0)
    lambdas = [blk.attn.pid_gains for blk in model.blocks]
    assert all(isinstance(m, ValueResidualLambdas) for m in lambdas)
    model.train()
    model(timm_images("deit")).sum().backward()
    assert all(m.lambda_1.grad is not None and m.lambda_2.grad is not None for m in lambdas[1:])
    torch.save(model.state_dict(), tmp_path / "w.pt")
    again = learnable_deit(3).eval()
    again.load_state_dict(torch.load(tmp_path / "w.pt", weights_only=True))
    model.eval()
    with torch.no_grad():
        assert torch.equal(again(timm_images("deit")), model(timm_images("deit")))


# ==== mmseg
@pytest.mark.parametrize("part", ["backbone", "head"])
def test_mmseg_matches_the_float64_rule_and_switches_off_bit_for_bit(part):
    model, stock = mm_pair(part, attention=NAME)
    x = mm_inputs(part)
    with torch.no_grad():
        want = mmseg_reference(part, stock.double(), mm_inputs(part, torch.float64), resformer())
        got = mm_out(part, model.double(), mm_inputs(part, torch.float64))
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
    off, stock = mm_pair(part, attention=NAME, attention_cfg={"lambda_1": 0.0, "lambda_2": 1.0})
    with torch.no_grad():
        assert torch.equal(mm_out(part, off, x), mm_out(part, stock, x))


# ==== fairseq
def test_fairseq_lm_rule_off_switch_incremental_decoding_and_reload(tmp_path):
    data = fs_dictionary(tmp_path)
    stock, _, _ = fs_build(data, arch="transformer_lm")
    model, task, args = fs_build(data, extra=fs_method(NAME), seed=1)
    model.load_state_dict(stock.state_dict(), strict=True)
    toks = torch.randint(4, 44, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(toks)[0]
        want = fairseq_reference(stock.double(), toks, resformer())
        torch.testing.assert_close(full.double(), want, rtol=1e-5, atol=1e-5)
        stock.float()
        # v^1 of past positions: the first layer's cached values
        torch.testing.assert_close(fs_incremental_logits(model, toks), full, rtol=1e-5, atol=1e-5)
        changed = toks.clone()
        changed[:, 4] = (changed[:, 4] - 4 + 7) % 40 + 4
        torch.testing.assert_close(model(changed)[0][:, :4], full[:, :4], rtol=0, atol=0)
        off, _, _ = fs_build(data, extra=fs_method(NAME, {"lambda_1": 0.0, "lambda_2": 1.0}), seed=1)
        off.load_state_dict(stock.state_dict(), strict=True)
        assert torch.equal(off(toks)[0], stock(toks)[0])
    loaded = fs_save_and_reload(model, task, args, str(tmp_path / "checkpoint_vr.pt"))
    with torch.no_grad():
        assert torch.equal(loaded(toks)[0], full)
