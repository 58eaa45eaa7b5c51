"""The one-flag A/B flip (issue 32): ``attention='softmax'`` builds the zoo's stock model bit for bit whatever method
parameters the recipe still carries, naming them in one warning, flipped as each zoo's users flip a recipe (timm's
keywords and ``train.py --model-kwargs``, mmseg's ``--cfg-options`` and ``_base_`` inheritance, fairseq's options)."""
from __future__ import annotations

import argparse
import logging
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
TINY_MMSEG = REPO / "configs" / "mmseg" / "segmenter_pid-deit-t_mask_cpu-tiny_ade20k-64x64.py"


def flip_warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.name.startswith("pid_plugins")
            and "attention='softmax', the stock attention" in r.getMessage()]


TIMM_CASES = {  # PID name, stock name, small size
    "pid_deit_tiny_patch16_224": ("deit_tiny_patch16_224", dict(img_size=32, depth=2)),
    "pid_vit_tiny_patch16_224": ("vit_tiny_patch16_224", dict(img_size=32, depth=2)),
    "pid_fan_tiny_12_p16_224": ("fan_tiny_12_p16_224", dict(img_size=64, depth=2)),
}
RECIPES = {  # what a PID (or sibling) recipe carries, flipped with attention="softmax"
    "pid": dict(attention_cfg=dict(lambda_p=0.3, learnable=True, warmup_steps=10)),
    "preset": dict(attention_cfg="deit"),
    "sibling": dict(attention_cfg=dict(gamma=0.6)),
}


def timm_stock_twin(flipped, stock_name, size):
    import timm

    stock = timm.create_model(stock_name, **size).eval()
    stock.load_state_dict(flipped.state_dict(), strict=True)  # the same keys: no gains, no warm-up counter
    return stock


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("name", TIMM_CASES)
def test_timm_keyword_flip_is_the_stock_model(name, recipe, caplog):
    import timm
    import pid_plugins.timm  # noqa: F401

    stock_name, size = TIMM_CASES[name]
    torch.manual_seed(0)
    with caplog.at_level(logging.WARNING):
        flipped = timm.create_model(name, attention="softmax", **RECIPES[recipe], **size).eval()
    [line] = flip_warnings(caplog)
    assert line.startswith(f"timm model {name!r}: attention='softmax'") and "are not used" in line
    assert all(getattr(m, "attention_method", None) is None for m in flipped.modules())
    assert not any("attention_params" in k or "attention_warmup" in k for k in flipped.state_dict())
    stock = timm_stock_twin(flipped, stock_name, size)
    x = torch.randn(2, 3, size["img_size"], size["img_size"], generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(flipped(x), stock(x))
    flipped.train()
    loss = flipped(x).square().mean()
    loss.backward()  # trains as the stock model does
    assert all(p.grad is not None for p in flipped.parameters() if p.requires_grad)


def test_timm_train_py_model_kwargs_flip(caplog):
    """``train.py --model pid_deit_tiny_patch16_224 --model-kwargs attention=softmax attention_cfg=...``: timm's own
    parser."""
    import timm
    from timm.utils import ParseKwargs
    import pid_plugins.timm  # noqa: F401

    parser = argparse.ArgumentParser()
    parser.add_argument("--model-kwargs", nargs="*", default={}, action=ParseKwargs)
    args = parser.parse_args(["--model-kwargs", "attention=softmax", "attention_cfg={'lambda_p': 0.3, 'beta': 0.5}",
                              "img_size=32", "depth=2"])
    torch.manual_seed(0)
    with caplog.at_level(logging.WARNING):
        flipped = timm.create_model("pid_deit_tiny_patch16_224", **args.model_kwargs).eval()
    [line] = flip_warnings(caplog)
    assert "attention_cfg={'lambda_p', 'beta'}" in line
    stock = timm_stock_twin(flipped, "deit_tiny_patch16_224", dict(img_size=32, depth=2))
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(flipped(x), stock(x))


def test_timm_contradictions_stay_refused():
    import timm
    import pid_plugins.timm  # noqa: F401

    with pytest.raises(TypeError, match="pid"):  # one spelling of the parameters: attention_cfg= (pid= is gone)
        timm.create_model("pid_deit_tiny_patch16_224", attention="softmax", pid={"lambda_p": 0.3},
                          attention_cfg={"lambda_p": 0.3}, img_size=32, depth=2)


def mmseg_stock_cfg(model_cfg):
    """The same segmentor config with mmseg's own backbone and head, our keys dropped."""
    cfg = model_cfg.copy()
    backbone = {k: v for k, v in cfg.backbone.items()
                if k not in ("attention", "attention_cfg", "pid", "lambda_p", "lambda_i", "lambda_d", "beta")}
    backbone["type"] = "VisionTransformer"
    head = {k: v for k, v in cfg.decode_head.items() if k not in ("attention", "attention_cfg", "pid")}
    head["type"] = "SegmenterMaskTransformerHead"
    cfg.backbone, cfg.decode_head = backbone, head
    return cfg


def mmseg_pair(cfg):
    from mmengine.registry import init_default_scope
    from mmseg.registry import MODELS

    init_default_scope("mmseg")
    torch.manual_seed(0)
    flipped = MODELS.build(cfg.model).eval()
    stock = MODELS.build(mmseg_stock_cfg(cfg.model)).eval()
    stock.load_state_dict(flipped.state_dict(), strict=True)
    return flipped, stock


def assert_same_segmentation(flipped, stock):
    assert flipped.backbone.attention_method is None
    assert getattr(flipped.decode_head, "attention_method", None) is None
    x = torch.rand(2, 3, 64, 64) * 255
    meta = [dict(img_shape=(64, 64))] * 2
    with torch.no_grad():
        assert torch.equal(flipped.encode_decode(x, meta), stock.encode_decode(x, meta))


CFG_OPTIONS = {  # a PID recipe given by --cfg-options (backbone gains, a PID decoder), then flipped
    "backbone": ["model.backbone.attention=softmax", "model.backbone.attention_cfg.lambda_p=0.2"],
    "decode_head": ["model.decode_head.type=PIDSegmenterMaskTransformerHead", "model.decode_head.attention=softmax",
                    "model.decode_head.attention_cfg.preset=segmenter", "model.decode_head.attention_cfg.warmup_steps=5",
                    "model.backbone.attention=softmax"],
    "sibling": ["model.backbone.attention=softmax", "model.backbone.attention_cfg.gamma=0.6"],
}


@pytest.mark.parametrize("case", CFG_OPTIONS)
def test_mmseg_cfg_options_flip_of_the_shipped_config_is_the_stock_segmentor(case, caplog):
    """``tools/train.py CONFIG --cfg-options ...``: mmengine's own DictAction and merge, as train.py applies them."""
    pytest.importorskip("mmseg")
    from mmengine.config import Config, DictAction

    parser = argparse.ArgumentParser()
    parser.add_argument("--cfg-options", nargs="+", action=DictAction)
    args = parser.parse_args(["--cfg-options", *CFG_OPTIONS[case]])
    cfg = Config.fromfile(str(TINY_MMSEG))
    cfg.merge_from_dict(args.cfg_options)
    with caplog.at_level(logging.WARNING):
        flipped, stock = mmseg_pair(cfg)
    lines = flip_warnings(caplog)
    assert lines and all("are not used" in line for line in lines)
    assert len([ln for ln in lines if ln.startswith("mmseg backbone")]) == 1
    assert_same_segmentation(flipped, stock)


def test_mmseg_base_inheritance_flip_is_the_stock_segmentor(tmp_path, caplog):
    """A user's config inheriting the shipped PID config with ``_base_`` and setting ``attention='softmax'``."""
    pytest.importorskip("mmseg")
    from mmengine.config import Config

    user = tmp_path / "my_softmax_ablation.py"
    user.write_text(f"_base_ = {str(TINY_MMSEG)!r}\nmodel = dict(backbone=dict(attention='softmax'))\n")
    cfg = Config.fromfile(str(user))
    assert cfg.model.backbone.attention_cfg == dict(preset="segmenter")  # inherited, now inert
    with caplog.at_level(logging.WARNING):
        flipped, stock = mmseg_pair(cfg)
    [line] = flip_warnings(caplog)
    assert line == ("mmseg backbone PIDVisionTransformer: attention='softmax', the stock attention: the method "
                    "parameters also given (attention_cfg={'preset'}) are not used")
    assert_same_segmentation(flipped, stock)


@pytest.fixture(scope="module")
def fairseq_dict(tmp_path_factory):
    pytest.importorskip("fairseq")
    from zoo_cases import fs_dictionary

    return fs_dictionary(tmp_path_factory.mktemp("dict"))


def fairseq_build(data_dir, arch, extra=()):
    from zoo_cases import fs_build

    return fs_build(data_dir, arch, extra, layers=2)[0]


@pytest.mark.parametrize("flags", [
    ["--attention-cfg", '{"lambda_p": 0.3, "beta": 0.5, "warmup_steps": 4}'],
    ["--attention-cfg", '{"gamma": 0.6}'],
], ids=["pid-cfg", "sibling-cfg"])
def test_fairseq_attention_method_softmax_flip_is_the_stock_transformer_lm(fairseq_dict, flags, caplog):
    with caplog.at_level(logging.WARNING):
        flipped = fairseq_build(fairseq_dict, "transformer_lm_pid", ["--attention-method", "softmax", *flags])
    [line] = flip_warnings(caplog)
    assert line.startswith("transformer_lm_pid: attention='softmax'")
    assert "--attention-cfg={" in line
    stock = fairseq_build(fairseq_dict, "transformer_lm")
    stock.load_state_dict(flipped.state_dict(), strict=True)
    toks = torch.randint(4, 44, (2, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(flipped(toks)[0], stock(toks)[0])


def test_fairseq_has_one_spelling_of_the_parameters(fairseq_dict):
    """No second spelling to contradict the first: the --pid-* options are gone (fairseq's parser refuses them)."""
    with pytest.raises(SystemExit):
        fairseq_build(fairseq_dict, "transformer_lm_pid",
                      ["--attention-method", "softmax", "--attention-cfg", '{"lambda_p": 0.2}', "--pid-lambda-p", "0.3"])


def test_transformers_method_config_is_inert_under_sdpa():
    """``config.pid`` (any method's parameters) left in a config flipped to ``attn_implementation="sdpa"``."""
    from zoo_cases import hf_ids, import_transformers, llama_config

    T = import_transformers()
    torch.manual_seed(0)
    flipped = T.LlamaForCausalLM(llama_config("sdpa", pid={"lambda_p": 0.3}, neutreno={"lambda_": 0.6})).eval()
    stock = T.LlamaForCausalLM(llama_config("sdpa")).eval()
    stock.load_state_dict(flipped.state_dict(), strict=True)
    x = hf_ids(2, 8)
    with torch.no_grad():
        assert torch.equal(flipped(x).logits, stock(x).logits)
