"""Checkpoints saved before the rename (``pid_gains`` -> ``attention_params``, ``pid_warmup`` ->
``attention_warmup``) keep loading, through every zoo's own loading paths.

The files in tests/data/legacy_keys/ were written by that folder's make.py with the code before the rename (tiny
models; learnable PID gains and value-residual lambdas at non-initial values, warm-up counters at step 4). Each test
rebuilds the saved model with today's code, loads the file the zoo's way, and checks that every saved tensor arrived
unchanged (``torch.equal``) under its new name, with no key missing or unexpected; the saved learnable values are
not their initial ones, so a path that skipped them would fail. The expected names come from the
file by a plain string rule (:func:`today`), not from pid_plugins' own translation. Files are read weights-only
(``torch.load(weights_only=True)``, safetensors).

Also: the old attribute names are deprecated read-only aliases, internal code sets only the new ones, and
:func:`~pid_plugins.core.layer.rename_legacy_keys` renames only below modules that hold a method.
"""
from __future__ import annotations

import importlib.util
import re
import shutil
import warnings
from pathlib import Path
from typing import Dict

import pytest
import torch

DATA = Path(__file__).resolve().parent / "data" / "legacy_keys"
_spec = importlib.util.spec_from_file_location("legacy_keys_make", DATA / "make.py")
make = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make)

#: a DeprecationWarning of ours (reading an old attribute name) anywhere in a loading path is an error
pytestmark = pytest.mark.filterwarnings("error:.*is renamed:DeprecationWarning")


def today(key: str) -> str:
    """A key saved before the rename, as today's code names it."""
    key = re.sub(r"(^|\.)pid_gains\.", r"\1attention_params.", key)
    return re.sub(r"(^|\.)pid_warmup\.", r"\1attention_warmup.", key)


def read(path: Path) -> Dict[str, torch.Tensor]:
    """The saved tensors (weights only), by their saved names."""
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    state = torch.load(path, map_location="cpu", weights_only=True)
    for key in ("state_dict", "model"):  # mmengine, fairseq
        if isinstance(state, dict) and key in state and isinstance(state[key], dict):
            return state[key]
    return state


def assert_all_loaded(model: torch.nn.Module, saved: Dict[str, torch.Tensor], skip=()) -> None:
    """Every saved tensor is in ``model``'s state_dict under today's name with its exact value, and the state_dict
    has nothing else (``skip``: today's names that are allowed to differ, e.g. a counter reset by design)."""
    assert any("pid_gains" in k for k in saved), "not a legacy checkpoint"
    state = model.state_dict()
    want = {today(k): v for k, v in saved.items()}
    assert set(state) == set(want), (sorted(set(state) - set(want)), sorted(set(want) - set(state)))
    assert not [k for k in state if "pid_gains" in k or "pid_warmup" in k]
    for key, value in want.items():
        if key not in skip:
            assert torch.equal(state[key], value), key


# ============================================================================================== timm
def _timm(name, attention, cfg, args, **kwargs):
    timm = pytest.importorskip("timm")
    import pid_plugins.timm  # noqa: F401

    torch.manual_seed(1)  # other weights than the saved model's
    return timm.create_model(name, attention=attention, attention_cfg=cfg, **args, **kwargs)


TIMM_IDS = [case[0] for case in make.TIMM_CASES]


@pytest.mark.parametrize("case", make.TIMM_CASES, ids=TIMM_IDS)
def test_timm_load_state_dict_strict(case):
    file, name, attention, cfg, args = case
    saved = read(DATA / file)
    model = _timm(name, attention, cfg, args)
    result = model.load_state_dict(saved, strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    assert_all_loaded(model, saved)


@pytest.mark.parametrize("case", make.TIMM_CASES, ids=TIMM_IDS)
def test_timm_create_model_pretrained_file(case):
    """timm's pretrained path (pretrained_cfg_overlay file): our checkpoint filter, then timm's strict load."""
    file, name, attention, cfg, args = case
    model = _timm(name, attention, cfg, args, pretrained=True,
                  pretrained_cfg_overlay=dict(file=str(DATA / file), num_classes=args["num_classes"]))
    assert_all_loaded(model, read(DATA / file))


def test_timm_load_checkpoint():
    from timm.models import load_checkpoint

    file, name, attention, cfg, args = make.TIMM_CASES[0]
    model = _timm(name, attention, cfg, args)
    load_checkpoint(model, str(DATA / file), strict=True, weights_only=True)
    assert_all_loaded(model, read(DATA / file))


def test_timm_checkpoint_into_mmseg_backbone_init_cfg(tmp_path):
    """A timm PID DeiT saved before the rename as an mmseg backbone's init_cfg (timm_vit_to_mmseg): its trained
    gains reach the mmseg layers."""
    pytest.importorskip("mmseg")
    saved = read(DATA / "timm_deit_pid.pth")
    path = tmp_path / "deit.pth"
    torch.save({"state_dict": saved, "meta": {}}, path)
    model = make.mmseg_segmentor(seed=3, patch_bias=True, mlp_ratio=4,
                                 init_cfg=dict(type="Pretrained", checkpoint=str(path))).backbone
    state = model.state_dict()
    for i in range(2):
        for gain in ("lambda_p_raw", "lambda_i_raw", "lambda_d_raw"):
            assert torch.equal(state[f"layers.{i}.attention_params.{gain}"],
                               saved[f"blocks.{i}.attn.pid_gains.{gain}"])
    assert int(model.attention_warmup.step) == 0  # pretrained weights start a new run's warm-up


# ============================================================================================== transformers
HF_IDS = [case[0] for case in make.HF_CASES]


def _hf():
    transformers = pytest.importorskip("transformers")
    import pid_plugins.hf  # noqa: F401

    return transformers


@pytest.mark.parametrize("case", make.HF_CASES, ids=HF_IDS)
def test_hf_from_pretrained_then_save_pretrained_writes_the_new_names(case, tmp_path):
    T = _hf()
    directory, method, params = case
    saved = read(DATA / directory / "model.safetensors")
    for cls in (T.AutoModelForCausalLM, T.LlamaForCausalLM):
        model, info = cls.from_pretrained(DATA / directory, output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
        assert_all_loaded(model, saved)
    assert model.config._attn_implementation == method
    model.save_pretrained(tmp_path / "again")
    again = read(tmp_path / "again" / "model.safetensors")
    assert set(again) == {today(k) for k in saved}  # a re-saved model writes today's names
    reloaded, info = T.AutoModelForCausalLM.from_pretrained(tmp_path / "again", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert_all_loaded(reloaded, saved)


@pytest.mark.parametrize("case", make.HF_CASES, ids=HF_IDS)
def test_hf_load_state_dict_strict(case):
    T = _hf()
    directory, method, params = case
    saved = read(DATA / directory / "model.safetensors")
    torch.manual_seed(1)
    model = T.LlamaForCausalLM(make.hf_config(method, params))
    result = model.load_state_dict(saved, strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    assert_all_loaded(model, saved)


def test_hf_user_key_mapping_is_kept(tmp_path):
    """A caller's own ``key_mapping`` still applies next to the legacy renaming."""
    T = _hf()
    directory = tmp_path / "renamed"
    shutil.copytree(DATA / make.HF_CASES[0][0], directory)
    from safetensors.torch import load_file, save_file

    saved = load_file(str(directory / "model.safetensors"))
    save_file({k.replace("lm_head.", "head_lm."): v for k, v in saved.items()}, str(directory / "model.safetensors"),
              metadata={"format": "pt"})
    model, info = T.AutoModelForCausalLM.from_pretrained(directory, key_mapping={r"^head_lm\.": "lm_head."},
                                                         output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert_all_loaded(model, saved)


# ============================================================================================== mmseg
def _mmseg():
    pytest.importorskip("mmseg")


def test_mmseg_load_checkpoint_strict():
    """mmengine's load_checkpoint (what a Runner's load_from and resume call: _load_checkpoint_to_model, mmengine's
    own load_state_dict recursion)."""
    _mmseg()
    from mmengine.runner.checkpoint import load_checkpoint

    from pid_plugins.mmseg.checkpoint import weights_only_schemes

    model = make.mmseg_segmentor(seed=1)
    with weights_only_schemes():
        load_checkpoint(model, str(DATA / make.MMSEG_SEGMENTOR), map_location="cpu", strict=True)
    assert_all_loaded(model, read(DATA / make.MMSEG_SEGMENTOR))


def test_mmseg_backbone_init_cfg_pretrained():
    """The backbone's init_cfg (our strict loader): the saved gains, the warm-up counter reset to 0 by design."""
    _mmseg()
    path = DATA / make.MMSEG_BACKBONE
    model = make.mmseg_segmentor(seed=1, init_cfg=dict(type="Pretrained", checkpoint=str(path))).backbone
    saved = read(path)
    assert int(saved["pid_warmup.step"]) == make.STEP
    assert_all_loaded(model, saved, skip={"attention_warmup.step"})
    assert int(model.attention_warmup.step) == 0


def test_mmengine_pretrained_init_with_prefix_into_the_head():
    """mmengine's own PretrainedInit (what ``init_cfg=dict(type='Pretrained', prefix=...)`` runs in modules that
    honour it; it loads non-strictly through mmengine's load_state_dict, so a key it did not translate would be
    skipped without a word): the head's value-residual lambdas arrive."""
    _mmseg()
    from mmengine.model.weight_init import PretrainedInit

    from pid_plugins.mmseg.checkpoint import weights_only_schemes

    head = make.mmseg_segmentor(seed=1).decode_head
    with weights_only_schemes():
        PretrainedInit(checkpoint=str(DATA / make.MMSEG_SEGMENTOR), prefix="decode_head.")(head)
    saved = {k[len("decode_head."):]: v for k, v in read(DATA / make.MMSEG_SEGMENTOR).items()
             if k.startswith("decode_head.")}
    assert_all_loaded(head, saved)


def test_mmseg_custom_keys_naming_pid_gains_is_refused():
    _mmseg()
    from pid_plugins.mmseg.renamed import check_custom_keys

    model = make.mmseg_segmentor()
    old = dict(paramwise_cfg=dict(custom_keys={"pid_gains": dict(decay_mult=0.0)}))
    with pytest.raises(ValueError, match=r"names 'pid_gains'.*custom_keys=\{'attention_params': \{'decay_mult': 0.0\}"):
        check_custom_keys(old, model)
    check_custom_keys(dict(paramwise_cfg=dict(custom_keys={"attention_params": dict(decay_mult=0.0)})), model)
    both = {"pid_gains": dict(decay_mult=0.0), "attention_params": dict(decay_mult=0.0)}
    check_custom_keys(dict(paramwise_cfg=dict(custom_keys=both)), model)  # the new key matches: nothing lost
    check_custom_keys(old, torch.nn.Linear(2, 2))  # no attention_params: nothing the old key should have matched


# ============================================================================================== fairseq
FAIRSEQ_IDS = [case[0] for case in make.FAIRSEQ_CASES]
#: fairseq's sinusoidal positions keep an uninitialised placeholder buffer that its upgrade replaces on every load
FAIRSEQ_PLACEHOLDER = {"decoder.embed_positions._float_tensor"}


def _fairseq():
    pytest.importorskip("fairseq")
    import pid_plugins.fairseq as pf

    return pf


@pytest.mark.parametrize("case", make.FAIRSEQ_CASES, ids=FAIRSEQ_IDS)
def test_fairseq_load_model_ensemble(case):
    """fairseq's loader: upgrade_state_dict_named, then its strict load_state_dict."""
    _fairseq()
    from fairseq import checkpoint_utils

    (model,), _ = checkpoint_utils.load_model_ensemble([str(DATA / case[0])], arg_overrides={"data": str(DATA)})
    assert_all_loaded(model, read(DATA / case[0]), skip=FAIRSEQ_PLACEHOLDER)


@pytest.mark.parametrize("case", make.FAIRSEQ_CASES, ids=FAIRSEQ_IDS)
def test_fairseq_hub(case):
    pf = _fairseq()
    hub = pf.load_pid_lm(str(DATA / case[0]), str(DATA))
    assert_all_loaded(hub.models[0], read(DATA / case[0]), skip=FAIRSEQ_PLACEHOLDER)


def test_fairseq_upgrade_state_dict_renames():
    pf = _fairseq()
    from fairseq import checkpoint_utils

    (model,), _ = checkpoint_utils.load_model_ensemble([str(DATA / "fairseq_pid.pt")],
                                                       arg_overrides={"data": str(DATA)})
    saved = dict(read(DATA / "fairseq_pid.pt"))
    upgraded = dict(saved)
    model.upgrade_state_dict(upgraded)  # in place, fairseq's way
    assert {k for k in upgraded if "attention_" in k} == {today(k) for k in saved if "pid_" in k}
    assert not [k for k in upgraded if "pid_gains" in k or "pid_warmup" in k]
    assert pf.GAIN_PARAM_GROUP == "attention_params"


# ============================================================================================== names
def test_old_names_are_deprecated_read_only_aliases():
    from pid_plugins.core import PIDConfig

    file, name, attention, cfg, args = make.TIMM_CASES[0]
    model = _timm(name, attention, cfg, args)
    attn = model.blocks[0].attn
    with pytest.warns(DeprecationWarning, match=r"pid_gains is renamed attention_params"):
        assert attn.pid_gains is attn.attention_params is not None
    with pytest.warns(DeprecationWarning, match=r"pid_warmup is renamed attention_warmup"):
        assert model.pid_warmup is model.attention_warmup is not None
    with pytest.warns(DeprecationWarning, match=r"pid is renamed attention_config"):
        assert model.pid is model.attention_config
    with pytest.warns(DeprecationWarning):
        assert attn.pid is attn.attention_config and isinstance(attn.pid, PIDConfig)
    with pytest.raises(AttributeError):
        model.pid = PIDConfig()
    with pytest.raises(AttributeError):
        attn.pid_gains = None


def test_internal_code_sets_only_the_new_names():
    """Built, converted, finished: no module holds anything under an old name (nn.Module's __setattr__ would store
    a submodule under ``pid_gains`` past the read-only alias, and it would be saved)."""
    timm = pytest.importorskip("timm")
    import pid_plugins
    import pid_plugins.timm as pt

    file, name, attention, cfg, args = make.TIMM_CASES[0]
    models = [_timm(name, attention, cfg, args),
              pt.convert(timm.create_model("deit_tiny_patch16_224", **args), "pid", cfg)]
    models.append(pid_plugins.finish_warmup(_timm(name, attention, cfg, args)))
    for model in models:
        for module in model.modules():
            stores = (module._modules, module._parameters, module._buffers, module.__dict__)
            assert not any(old in store for store in stores for old in ("pid_gains", "pid_warmup", "pid")), module
        assert not [k for k in model.state_dict() if "pid_" in k]
    stock = pt.convert(models[1], "softmax")
    assert not stock._load_state_dict_pre_hooks and not stock.blocks[0].attn._load_state_dict_pre_hooks


def test_rename_legacy_keys_only_below_modules_that_hold_a_method():
    pytest.importorskip("timm")
    from pid_plugins.core import PIDConfig, PIDSelfAttention
    from pid_plugins.core.layer import rename_legacy_keys

    file, name, attention, cfg, args = make.TIMM_CASES[0]
    model = _timm(name, attention, cfg, args)
    outer = torch.nn.ModuleDict({"vit": model, "plain": PIDSelfAttention(8, 2, pid=PIDConfig(learnable=True))})
    state = {"vit.blocks.0.attn.pid_gains.lambda_p_raw": 1, "vit.pid_warmup.step": 2,
             "plain.pid_gains.lambda_p_raw": 3,  # a PID-only core module's own name: not ours to rename
             "vit.blocks.0.pid_gains.x": 4,  # a block holds no method
             "vit.blocks.1.attn.pid_gains.lambda_p_raw": 5, "vit.blocks.1.attn.attention_params.lambda_p_raw": 6}
    assert rename_legacy_keys(dict(state), outer) == {
        "vit.blocks.0.attn.attention_params.lambda_p_raw": 1, "vit.attention_warmup.step": 2,
        "plain.pid_gains.lambda_p_raw": 3, "vit.blocks.0.pid_gains.x": 4,
        "vit.blocks.1.attn.pid_gains.lambda_p_raw": 5,  # today's name is there already: it wins
        "vit.blocks.1.attn.attention_params.lambda_p_raw": 6}


def test_the_shipped_hook_refuses_custom_keys_naming_pid_gains():
    """WeightsOnlyCheckpointHook (in the shipped configs' custom_hooks) runs the check when a run starts."""
    _mmseg()
    from types import SimpleNamespace

    from mmengine.config import Config

    from pid_plugins.mmseg import WeightsOnlyCheckpointHook

    hook, model = WeightsOnlyCheckpointHook(), make.mmseg_segmentor()
    old = Config(dict(optim_wrapper=dict(paramwise_cfg=dict(custom_keys={"pid_gains": dict(decay_mult=0.0)}))))
    with pytest.raises(ValueError, match="renamed each layer's learnable method parameters from 'pid_gains'"):
        hook.before_run(SimpleNamespace(cfg=old, model=model))
    new = Config(dict(optim_wrapper=dict(paramwise_cfg=dict(custom_keys={"attention_params": dict(decay_mult=0.0)}))))
    runner = SimpleNamespace(cfg=new, model=model)
    hook.before_run(runner)
    hook.after_run(runner)
