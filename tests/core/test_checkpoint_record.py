"""A method model's checkpoint says what it is (the record), through each zoo's own savers and loaders: a stock model
refuses it (strict) or lists it, a method model checks it before loading anything, and a softmax checkpoint still
loads strictly into a method model."""
from __future__ import annotations

import logging
import warnings

import pytest
import torch

from pid_plugins.core.record import RECORD_KEY, MethodRecordWarning, decode_record, encode_record, saved_method

from zoo_cases import fs_build, fs_logits, fs_method, fs_save_checkpoint, fs_tokens, mm_build, mm_args, data_dir  # noqa: F401

TINY = dict(img_size=32, patch_size=8, depth=2, num_classes=10)


def _timm():
    timm = pytest.importorskip("timm")
    import pid_plugins.timm  # noqa: F401

    return timm


def test_the_record_round_trips_and_refuses_what_is_not_one():
    value = encode_record("pid", {"lambda_p": 0.3, "beta": 0.1})
    assert value.dtype == torch.uint8 and value.dim() == 1
    assert decode_record(value) == {"method": "pid", "config": {"lambda_p": 0.3, "beta": 0.1}}
    for bad in (torch.tensor([1, 2, 3], dtype=torch.uint8), value.float(), value[None],
                torch.tensor(list(b'{"format": 9, "method": "pid", "config": {}}'), dtype=torch.uint8),
                torch.tensor(list(b'{"format": 1, "config": {}}'), dtype=torch.uint8)):
        with pytest.raises(ValueError, match="ckpt.pth: the method record 'pid_plugins_method' cannot be read"):
            decode_record(bad, "ckpt.pth")


@pytest.mark.parametrize("fmt", ["pth", "safetensors"])
def test_timm_a_stock_model_refuses_a_method_checkpoint_and_the_method_model_loads_it(tmp_path, fmt):
    timm = _timm()
    from timm.models import load_checkpoint

    torch.manual_seed(0)
    model = timm.create_model("pid_deit_tiny_patch16_224", attention_cfg={"lambda_p": 0.5}, **TINY).eval()
    path = tmp_path / f"pid.{fmt}"
    if fmt == "pth":
        torch.save({"state_dict": model.state_dict(), "epoch": 3}, path)  # the layout of timm's train.py checkpoints
    else:
        from safetensors.torch import save_file
        save_file(model.state_dict(), str(path))
    x = torch.randn(2, 3, 32, 32)
    # what timm's validate.py / inference.py do with --model deit_tiny_patch16_224 --checkpoint pid.*
    stock = timm.create_model("deit_tiny_patch16_224", **TINY).eval()
    with pytest.raises(RuntimeError, match='Unexpected key.*"pid_plugins_method"'):
        load_checkpoint(stock, str(path))
    with pytest.raises(RuntimeError, match='Unexpected key.*"pid_plugins_method"'):
        timm.create_model("deit_tiny_patch16_224", checkpoint_path=str(path), **TINY)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        again = timm.create_model("pid_deit_tiny_patch16_224", attention_cfg={"lambda_p": 0.5},
                                  checkpoint_path=str(path), **TINY).eval()
    assert not [w for w in caught if issubclass(w.category, MethodRecordWarning)]
    with torch.no_grad():
        assert torch.equal(again(x), model(x))


def test_timm_a_softmax_checkpoint_still_loads_strictly_into_a_method_model():
    timm = _timm()
    stock = timm.create_model("deit_tiny_patch16_224", **TINY)
    model = timm.create_model("pid_deit_tiny_patch16_224", **TINY)
    assert str(model.load_state_dict(stock.state_dict(), strict=True)) == "<All keys matched successfully>"
    assert RECORD_KEY in model.state_dict() and RECORD_KEY not in stock.state_dict()
    assert set(model.state_dict()) - set(stock.state_dict()) == {RECORD_KEY}


def test_timm_another_method_warns_naming_both_and_how_to_load_it():
    timm = _timm()
    pid = timm.create_model("pid_deit_tiny_patch16_224", attention_cfg={"lambda_p": 0.25}, **TINY)
    other = timm.create_model("pid_deit_tiny_patch16_224", attention="neutreno", **TINY)
    with pytest.warns(MethodRecordWarning) as caught:
        other.load_state_dict(pid.state_dict())
    assert len(caught) == 1
    text = str(caught[0].message)
    assert "saved from a model running attention 'pid'" in text and "'lambda_p': 0.25" in text
    assert "this model runs 'neutreno'" in text and "attention='pid'" in text
    # the same method with other parameters warns too; the same parameters do not
    with pytest.warns(MethodRecordWarning, match="'lambda_p': 0.25"):
        timm.create_model("pid_deit_tiny_patch16_224", **TINY).load_state_dict(pid.state_dict())


def test_timm_unregistered_or_damaged_record_is_refused_before_anything_loads():
    timm = _timm()
    model = timm.create_model("pid_deit_tiny_patch16_224", **TINY)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    bad = {k: torch.zeros_like(v) if v.is_floating_point() else v for k, v in model.state_dict().items()}
    bad[RECORD_KEY] = encode_record("my_method", {"a": 1})
    with pytest.raises(ValueError, match=r"'my_method', which is not registered.*register_method\('my_method'"):
        model.load_state_dict(bad)
    bad[RECORD_KEY] = torch.tensor([7, 7], dtype=torch.uint8)
    with pytest.raises(ValueError, match="cannot be read"):
        model.load_state_dict(bad)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # nothing loaded partially


def test_timm_the_record_follows_convert_and_finish_warmup():
    timm = _timm()
    import pid_plugins
    import pid_plugins.timm as pt

    stock = timm.create_model("vit_tiny_patch16_224", **TINY)
    keys = list(stock.state_dict())
    model = pt.convert(stock, "pid", {"warmup_steps": 10})
    assert saved_method(model.state_dict())[0] == "pid"
    assert saved_method(model.state_dict())[1]["warmup_steps"] == 10
    pid_plugins.finish_warmup(model)
    assert saved_method(model.state_dict())[1]["warmup_steps"] == 0  # recorded as it runs now
    back = pt.convert(model, "softmax")
    assert list(back.state_dict()) == keys and not back._state_dict_pre_hooks and not back._load_state_dict_pre_hooks
    fan = timm.create_model("pid_fan_tiny_12_p16_224", attention="value_residual", img_size=32, num_classes=10)
    assert saved_method(fan.state_dict())[0] == "value_residual"
    assert RECORD_KEY not in timm.create_model("pid_deit_tiny_patch16_224", attention="softmax", **TINY).state_dict()


def test_mmseg_a_stock_config_lists_the_record_and_the_method_config_loads_it(tmp_path, capsys):
    pytest.importorskip("mmseg")
    from mmengine.runner import load_checkpoint

    args = mm_args("backbone")
    model = mm_build("PIDVisionTransformer", args, 0)
    path = tmp_path / "pid.pth"
    torch.save({"state_dict": model.state_dict(), "meta": {}}, path)  # mmengine's checkpoint layout
    stock = mm_build("VisionTransformer", args, 1)
    with pytest.raises(RuntimeError, match="pid_plugins_method"):
        load_checkpoint(stock, str(path), strict=True)
    capsys.readouterr()
    load_checkpoint(stock, str(path), strict=False)  # mmengine's non-strict load_from: the key is listed as unexpected
    assert "unexpected key in source state_dict: pid_plugins_method" in capsys.readouterr().out
    again = mm_build("PIDVisionTransformer", args, 2)
    load_checkpoint(again, str(path), strict=True)
    x = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(again(x)[0], model(x)[0])
    with pytest.warns(MethodRecordWarning, match="running attention 'pid'.*runs 'neutreno'"):
        mm_build("PIDVisionTransformer", args, 3, attention="neutreno").load_state_dict(model.state_dict())


def test_fairseq_checkpoint_records_the_method(data_dir, tmp_path):  # noqa: F811
    pytest.importorskip("fairseq")
    from fairseq import checkpoint_utils

    model, task, args = fs_build(data_dir, extra=fs_method("neutreno", {"alpha": 0.4}))
    path = str(tmp_path / "checkpoint.pt")
    fs_save_checkpoint(model, args, path)
    state = checkpoint_utils.load_checkpoint_to_cpu(path)
    assert saved_method(state["model"]) == ("neutreno", {"alpha": 0.4, "warmup_steps": 0})
    (loaded,), _ = checkpoint_utils.load_model_ensemble([path], task=task)
    toks = fs_tokens()
    assert torch.equal(fs_logits(loaded.eval(), toks), fs_logits(model, toks))
    stock, _, _ = fs_build(data_dir, arch="transformer_lm")
    with pytest.raises(RuntimeError, match="decoder.pid_plugins_method"):
        stock.load_state_dict(state["model"], strict=True)


def test_transformers_warns_when_a_method_folder_loads_with_a_stock_attention(tmp_path, caplog):
    """Once, naming the saved method and how to load it, for ``sdpa`` and ``eager``; not for the saved method or a
    stock folder; ``attn_implementation=None`` (what TRL's CLI passes when the user names none) is the saved method."""
    pytest.importorskip("transformers")
    import pid_plugins.hf  # noqa: F401
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    small = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1)
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**small, attn_implementation="pid")).save_pretrained(tmp_path / "pid")
    LlamaForCausalLM(LlamaConfig(**small)).save_pretrained(tmp_path / "stock")
    logger = "pid_plugins.hf.install"
    for requested in ("sdpa", "eager"):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger=logger):
            AutoModelForCausalLM.from_pretrained(tmp_path / "pid", attn_implementation=requested)
        ours = [r.getMessage() for r in caplog.records if r.name == logger]
        assert len(ours) == 1 and "saved from a model running attention method 'pid'" in ours[0]
        assert f"attn_implementation={requested!r}" in ours[0] and "attn_implementation='pid'" in ours[0]
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger=logger):
            AutoModelForCausalLM.from_pretrained(tmp_path / "stock", attn_implementation=requested)
        assert not [r for r in caplog.records if r.name == logger]
    ids = torch.tensor([[1, 5, 9, 3, 7]])
    with caplog.at_level(logging.WARNING, logger=logger), torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(tmp_path / "pid").eval()(ids).logits
        got = AutoModelForCausalLM.from_pretrained(tmp_path / "pid", attn_implementation=None).eval()
        stock = AutoModelForCausalLM.from_pretrained(tmp_path / "pid", attn_implementation="sdpa").eval()(ids).logits
    assert got.config._attn_implementation == "pid"
    assert len([r for r in caplog.records if r.name == logger]) == 1  # the sdpa load's warning only
    assert torch.equal(got(ids).logits, want) and not torch.allclose(stock, want, atol=1e-3)
