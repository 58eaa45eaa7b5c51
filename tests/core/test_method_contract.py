"""The attention-method contract: every method (pid, neutreno, twicing, elliptical, value_residual and the toy
``scaled_reference`` a user registers, tests/toy_method.py) x every zoo model (timm DeiT and FAN, a transformers
Llama with grouped-query attention and BERT, mmseg's ViT backbone and Segmenter head, fairseq's transformer_lm), one
parametrised test per property; tests/method_cases.py says which pair applies and with which parameters and
independent float64 rule (pairs that do not apply are not generated)."""
from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import pid_plugins
import zoo_cases as zc
from method_cases import CAUSAL, METHODS, MODELS, cases, method_cfg
from pid_plugins import testing
from pid_plugins.testing import APPLIES, CASES
from pyexec import run_python_c

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one torch thread (tests/conftest.py)


@pytest.fixture(autouse=True)
def toy_registered():
    """The toy is registered on import of tests/toy_method.py, exactly as a user registers a method."""
    import toy_method  # noqa: F401


def method_of(name):
    import toy_method  # noqa: F401  (registers scaled_reference)

    return pid_plugins.get_method(name)


@pytest.mark.parametrize("method, model_case", cases())
def test_selected_by_name_with_its_parameters_or_the_zoo_preset(method, model_case):
    expected = method_of(method.name)
    cfg = method_cfg(method, model_case)
    for given in (cfg, None):
        model, _ = model_case.pair(method.name, given)
        if model_case.zoo == "hf":
            assert model.config._attn_implementation == method.name
        want = method.config(given, model_case.zoo)
        assert isinstance(want, method.config_type())
        for got_method, got_config in model_case.configs(model):
            assert got_method is expected and got_config == want


@pytest.mark.parametrize("model_case", [pytest.param(m, id=m.name) for m in MODELS.values()])
def test_softmax_is_the_stock_model_bit_for_bit(model_case):
    """``attention="softmax"`` (transformers: the method model converted back to it) is the stock model."""
    if model_case.name == "hf-llama":
        import pid_plugins.hf as ph

        model, stock = model_case.pair("pid", None, seed=2)
        ph.convert(model, "softmax")
        assert model.config._attn_implementation == "sdpa"
    else:
        model, stock = model_case.pair("softmax", None, seed=2)
    x = model_case.inputs()
    with torch.no_grad():
        assert torch.equal(model_case.out(model, x), model_case.out(stock, x))
    if model_case.zoo in ("timm", "mmseg"):
        assert model.attention_method is None
    elif model_case.zoo == "fairseq":
        assert all(layer.attention_method is None for layer in model_case.attention_layers(model))


@pytest.mark.parametrize("method", [pytest.param(m, id=m.name) for m in METHODS.values() if m.models & CAUSAL])
def test_the_tables_causal_parameters_are_needed_and_accepted_in_a_causal_model_with_a_cache(method):
    """``causal_cfg`` (what transformers' decoding tests run, method_cases.CAUSAL_METHODS): the method's own check
    accepts it over the transformers preset in a causal call with a KV cache, and it is set only where that preset
    alone is refused there."""
    from pid_plugins.core import AttentionContext

    impl, context = method.impl, AttentionContext(causal=True, cached=True)
    impl.check(impl.configure(method.causal_cfg, "hf"), context)
    if method.causal_cfg is not None:
        with pytest.raises(ValueError, match=repr(method.name)):
            impl.check(impl.configure(None, "hf"), context)


def kit_cases():
    """(method, model, case, cfg) of every case of pid_plugins.testing that applies: the reference for each of the
    method's parameter sets, the zero parameters where the method has them, and the others with its first set."""
    out = []
    for method, model in (p.values for p in cases()):
        cfgs = {f"reference-{i}": cfg for i, cfg in enumerate(method.on(model))}
        if model.name in method.zero_models:
            cfgs["zero"] = method.zero
        for case in ("checkpointing", "save_load", "compile", "generate", "padding"):
            if APPLIES.get(case, lambda m: True)(model) and (case != "compile" or model.name in method.compile_models):
                cfgs[case] = method_cfg(method, model)
            if method.learnable and case in ("checkpointing", "save_load"):
                cfgs[f"{case}-learnable"] = {**(method_cfg(method, model) or {}), "learnable": True}
        out += [pytest.param(method, model, key.split("-")[0], cfg, id=f"{key}-{method.name}-{model.name}",
                             marks=[pytest.mark.slow] * key.startswith("compile")) for key, cfg in cfgs.items()]
    return out


@pytest.mark.parametrize("method, model_case, case, cfg", kit_cases())
def test_the_kits_case(method, model_case, case, cfg):
    """pid_plugins.testing's case (its docstring says what it checks) for every method on every model: the float64
    reference (written from the official code, tests/zoo_cases.py), zero parameters = the stock model bit for bit,
    activation checkpointing equals none, torch.compile(fullgraph=True) equals eager, save/load gives the same
    outputs, cached decoding equals recomputation and is causal, left padding generates what the prompt alone does."""
    kw = {}
    if case == "compile":
        kw["backend"], kw["tol"] = method.compile_overrides.get(model_case.name, (None, None))
    rule = method.rule(cfg, model_case) if case == "reference" else None
    run = functools.partial(CASES[case], model_case, method.name, cfg, rule, method.zero, **kw)
    if case == "checkpointing" and model_case.zoo == "fairseq":
        with pytest.raises(ValueError, match="--checkpoint-activations is not supported by transformer_lm_pid"):
            run()
    else:
        run()


def test_the_kit_reports_exact_refused_and_wrong():
    """check() as an author runs it: the toy with its own rule is exact; a rule that is not the method's is wrong
    (with the error); fairseq's refusal of activation checkpointing is reported with its message."""
    from toy_method import toy_rule

    report = testing.check("scaled_reference", toy_rule(0.7), {"gamma": 0.7}, zero={"gamma": 0.0},
                           models=["timm-deit", "fairseq-lm"], cases=["reference", "zero", "checkpointing"])
    got = {(r.model, r.case): r for r in report}
    assert [r.status for r in report] == ["exact", "exact", "exact", "exact", "exact", "refused"], str(report)
    assert "--checkpoint-activations is not supported" in got["fairseq-lm", "checkpointing"].message
    wrong = testing.check("scaled_reference", toy_rule(0.5), {"gamma": 0.7}, models=["timm-deit"], cases=["reference"])
    assert not wrong.ok and wrong[0].status == "wrong" and "Tensor-likes are not close" in wrong[0].message
    assert str(wrong).startswith("timm-deit        reference      wrong: AssertionError")


@pytest.mark.integration  # a fresh process
def test_the_kit_imports_with_torch_alone():
    code = ("import sys, pid_plugins.testing; "
            "print(sorted({'timm', 'transformers', 'mmseg', 'mmengine', 'fairseq', 'pytest'} & set(sys.modules)))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stderr[-2000:] + proc.stdout


# The toy reaches every zoo through pid_plugins.register_method only (tests/toy_method.py): what each zoo's user path
# does with a method nothing in pid_plugins knows, beyond the grid above.
def toy_timm_pair(kind, gamma=0.5, seed=0):
    from toy_method import NAME

    return zc.timm_pair(kind, seed, attention=NAME, attention_cfg=None if gamma is None else {"gamma": gamma})


@pytest.mark.parametrize("kind", sorted(zc.TIMM))
def test_timm_toy_presets_stock_names_and_the_threaded_state(kind):
    timm = zc.import_timm()
    from toy_method import METHOD, NAME

    model, _ = toy_timm_pair(kind, gamma=0.25)
    assert model.attention_config.gamma == 0.25 and model.attention_warmup is None
    preset = timm.create_model(zc.TIMM[kind][0], attention=NAME, attention_cfg="strong", **zc.TIMM[kind][2])
    assert preset.attention_config.gamma == 2.0
    if kind == "fan":  # the softmax names pid_plugins registers (fan_*) take the method too
        assert timm.create_model(zc.TIMM[kind][1], attention=NAME, **zc.FAN).attention_method is METHOD
    # the state is threaded as len(state_fields) flat tensors: a block is an ordinary module of tensors
    args, kw = ((4, 1), {}) if kind == "fan" else ((), {"with_state": True})  # a ViT block as its container calls it
    x = torch.randn(2, 4, 48)
    out = model.blocks[0](x, *args, **kw)
    assert isinstance(out, tuple) and len(out) == 1 + len(METHOD.state_fields)
    out2 = model.blocks[1](out[0], *args, *out[1:], **kw)
    assert len(out2) == 2 and out2[1] is out[1]  # v^1 handed on unchanged


def test_timm_softmax_and_pid_names_keep_working():
    timm = zc.import_timm()
    deit = timm.create_model("pid_deit_tiny_patch16_224", **zc.DEIT)
    assert type(deit.attention_method).__name__ == "PIDMethod"
    assert deit.attention_config == pid_plugins.PIDConfig.preset("deit")
    assert timm.create_model("pid_deit_tiny_patch16_224", attention="softmax", **zc.DEIT).attention_method is None
    fan = timm.create_model("fan_tiny_12_p16_224", **zc.FAN)
    assert fan.attention_config is None and fan.attention_method is None


def test_timm_learnable_and_unknown_names_are_refused_clearly():
    timm = zc.import_timm()
    from toy_method import NAME

    with pytest.raises(ValueError, match="learnable"):
        timm.create_model("pid_deit_tiny_patch16_224", attention=NAME, attention_cfg={"learnable": True}, **zc.DEIT)
    with pytest.raises(ValueError, match="learnable") as info:
        timm.create_model("pid_fan_tiny_12_p16_224", attention=NAME, attention_cfg={"learnable": True}, **zc.FAN)
    assert "gamma" in str(info.value)  # what it does take
    for name in ("pid_deit_tiny_patch16_224", "fan_tiny_12_p16_224"):
        with pytest.raises(ValueError, match="unknown attention method 'scaled_referense'") as info:
            timm.create_model(name, attention="scaled_referense", **zc.TIMM["deit" if "deit" in name else "fan"][2])
        assert NAME in str(info.value) and "'pid'" in str(info.value) and "'softmax'" in str(info.value)


@pytest.mark.parametrize("kind", sorted(zc.TIMM))
def test_timm_features_only_intermediates_and_fx_feature_extraction(kind):
    timm = zc.import_timm()
    from toy_method import NAME

    name, _, cfg = zc.TIMM[kind]
    model, _ = toy_timm_pair(kind)
    x = zc.assert_timm_feature_paths(kind, model, attention=NAME)
    # timm's fx feature wrapper returns each block's output tokens (NLC, prefix tokens included)
    torch.manual_seed(5)
    fx_feats = timm.create_model(name, features_only=True, feature_cls="fx", out_indices=(1, 2), attention=NAME, **cfg)
    torch.manual_seed(5)
    model = timm.create_model(name, attention=NAME, **cfg).eval()  # the same weights
    with torch.no_grad():
        want = model.forward_intermediates(x, indices=[1, 2], output_fmt="NLC", intermediates_only=True)
        got = fx_feats.eval()(x)
        prefix = model.num_prefix_tokens if kind == "deit" else 0
        assert len(got) == 2 and all(torch.equal(g[:, prefix:], w) for g, w in zip(got, want))


def _attend_toy():
    from toy_method import ScaledReference

    class ScaledReferenceAttend(ScaledReference):
        """The toy with its own ``attend`` (the same computation): the layer then calls the method's attend."""

        name = "scaled_reference_attend"
        calls = 0

        def attend(self, params, attend, query, value, state=None, head_dim=-3):
            type(self).calls += 1
            return attend(query, value)

    return ScaledReferenceAttend


@pytest.mark.parametrize("kind", sorted(zc.TIMM))
def test_timm_a_method_with_its_own_attend_is_called_through_it(kind):
    timm = zc.import_timm()
    from timm.models import create_feature_extractor

    cls = _attend_toy()
    method = pid_plugins.register_method(cls(), replace=True)
    name, _, cfg = zc.TIMM[kind]
    model, _ = toy_timm_pair(kind, gamma=0.6)
    other = timm.create_model(name, attention=method.name, attention_cfg={"gamma": 0.6}, **cfg).eval()
    other.load_state_dict(model.state_dict())
    x = zc.timm_images(kind)
    with torch.no_grad():
        assert torch.equal(other(x), model(x))
    assert cls.calls == len(model.blocks)
    extractor = create_feature_extractor(other, return_nodes={"head": "logits"})
    with torch.no_grad():
        torch.testing.assert_close(extractor(x)["logits"], model(x), rtol=0, atol=0)


def test_hf_a_registered_method_is_an_attn_implementation_and_from_config_reads_its_parameters():
    """(convert to and from the toy, and its refusals: tests/core/test_zoo_contract.py)"""
    T = zc.import_transformers()
    import pid_plugins.hf as ph
    from toy_method import NAME, ScaledReferenceConfig

    assert NAME in pid_plugins.list_methods()
    model, _ = MODELS["hf-llama"].pair(NAME, {"gamma": 0.3})
    assert ph.method_of(model.config) is pid_plugins.get_method(NAME)
    assert ph.model_method_config(model.config) == ScaledReferenceConfig(gamma=0.3)
    config = zc.llama_config(kv_heads=2)
    setattr(config, NAME, {"gamma": 0.3})
    again = T.LlamaForCausalLM._from_config(config, attn_implementation=NAME)
    assert ph.model_method_config(again.config) == ScaledReferenceConfig(gamma=0.3)


def test_hf_encoder_decoder_self_attention_stacks_take_the_toy():
    """BART (the encoder's and the decoder's self-attention stacks; cross-attention untouched): switched off equals
    stock bit for bit, switched on changes the output."""
    T = zc.import_transformers()
    import pid_plugins.hf as ph
    from toy_method import NAME

    torch.manual_seed(0)
    stock = T.BartModel(zc.bart_config()).eval()
    x = zc.hf_ids()
    with torch.no_grad():
        want = stock(x).last_hidden_state
        ph.convert(stock, NAME, {"gamma": 0.0})
        assert torch.equal(stock(x).last_hidden_state, want)
        ph.convert(stock, NAME, {"gamma": 0.5})
        assert not torch.allclose(stock(x).last_hidden_state, want)


TOY = dict(attention="scaled_reference", attention_cfg=dict(gamma=0.3))


def test_mmseg_the_toy_is_chosen_by_name_and_layers_take_over_mmseg_modules():
    pytest.importorskip("mmseg")
    import pid_plugins.mmseg as pm  # first: the plugin makes mmseg importable without mmcv's compiled ops
    from mmseg.models.backbones.vit import TransformerEncoderLayer

    from toy_method import METHOD, NAME, ScaledReferenceConfig

    model, stock = zc.mm_pair("backbone", **TOY)
    assert model.attention_config == ScaledReferenceConfig(gamma=0.3) and model.attention_method is METHOD
    assert all(type(layer) is pm.PIDTransformerEncoderLayer and layer.attention_config == model.attention_config
               for layer in model.layers)
    assert all(isinstance(layer, TransformerEncoderLayer) and not layer.training for layer in model.layers)
    # the same modules and parameter names, and the same random initialisation (the conversion draws nothing)
    built = zc.mm_build("PIDVisionTransformer", zc.mm_args("backbone"), 0, **TOY)
    assert list(zc.weights(built.state_dict())) == list(stock.state_dict())
    for key, value in stock.state_dict().items():
        assert torch.equal(built.state_dict()[key], value), key
    h, stock_h = zc.mm_pair("head", **TOY)
    assert h.attention_config == ScaledReferenceConfig(gamma=0.3) and h.attention_method is METHOD
    assert all(type(layer) is pm.PIDTransformerEncoderLayer for layer in h.layers)
    assert list(zc.weights(h.state_dict())) == list(stock_h.state_dict())
    args = zc.mm_args("backbone")
    assert zc.mm_build("PIDVisionTransformer", args, attention=NAME, attention_cfg="strong").attention_config.gamma == 2.0
    assert zc.mm_build("PIDVisionTransformer", args, attention=NAME).attention_config.gamma == 0.5
    assert zc.mm_build("PIDVisionTransformer", args, attention="softmax").attention_method is None


def segmentor_cfg():
    return dict(
        type="EncoderDecoder",
        data_preprocessor=dict(type="SegDataPreProcessor", mean=[123.675, 116.28, 103.53], std=[58.395, 57.12, 57.375],
                               bgr_to_rgb=True, pad_val=0, seg_pad_val=255, size=(32, 32)),
        backbone=dict(type="PIDVisionTransformer", **zc.MM_BACKBONE, **TOY),
        decode_head=dict(type="PIDSegmenterMaskTransformerHead", **zc.MM_HEAD, **TOY),
        test_cfg=dict(mode="whole"),
    )


CONFIG = """
custom_imports = dict(imports=['toy_method', 'pid_plugins.mmseg'], allow_failed_imports=False)
model = {model!r}
"""


@pytest.mark.slow
def test_mmseg_a_config_file_registers_the_method_and_the_plugin_with_custom_imports(tmp_path):
    """A fresh process: mmengine's ``Config.fromfile`` imports the user's method module and the plugin; mmseg's
    ``MODELS.build`` builds the segmentor; its output and weights equal this process's build of the same file."""
    pytest.importorskip("mmseg")
    import pid_plugins.mmseg  # noqa: F401

    path = tmp_path / "segmenter_toy.py"
    path.write_text(CONFIG.format(model=segmentor_cfg()))
    script = f"""
import sys, torch
sys.path[1:1] = [{str(REPO)!r}, {str(TESTS)!r}]  # where PYTHONPATH puts them: after -c's '', before site
torch.set_num_threads(1)  # as one_thread
from mmengine.config import Config
from mmengine.registry import init_default_scope
cfg = Config.fromfile({str(path)!r})
from mmseg.registry import MODELS
init_default_scope('mmseg')
torch.manual_seed(0)
model = MODELS.build(cfg.model)
model.init_weights()
model.eval()
assert type(model.backbone.layers[0]).__name__ == 'PIDTransformerEncoderLayer', model.backbone.layers[0]
assert model.backbone.attention_method.name == model.decode_head.attention_method.name == 'scaled_reference'
x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1)) * 50 + 100
with torch.no_grad():
    out = model.encode_decode(x, [dict(img_shape=(32, 32))])
torch.save(dict(state_dict=model.state_dict(), out=out), {str(tmp_path / 'out.pth')!r})
"""
    result = run_python_c(script, cwd=tmp_path, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    saved = torch.load(tmp_path / "out.pth", weights_only=True)

    from mmengine.config import Config
    from mmengine.registry import init_default_scope
    from mmseg.registry import MODELS as MM

    cfg = Config.fromfile(str(path))
    assert cfg.model.backbone.attention_cfg == dict(gamma=0.3)
    init_default_scope("mmseg")
    model = MM.build(cfg.model).eval()
    model.load_state_dict(saved["state_dict"], strict=True)
    with torch.no_grad():
        x = zc.mm_inputs("backbone") * 50 + 100
        assert torch.equal(model.encode_decode(x, [dict(img_shape=(32, 32))]), saved["out"])


def test_mmseg_refusals_say_what_to_change():
    from toy_method import NAME

    def backbone(**kw):
        return zc.mm_build("PIDVisionTransformer", zc.mm_args("backbone"), **kw)

    def head(**kw):
        return zc.mm_build("PIDSegmenterMaskTransformerHead", zc.mm_args("head"), **kw)

    with pytest.raises(ValueError, match=r"unknown ScaledReferenceConfig field\(s\) \['learnable'\]"):
        backbone(attention=NAME, attention_cfg=dict(learnable=True))
    for build_part in (backbone, head):
        with pytest.raises(ValueError, match=r"unknown attention method 'nope'.*'pid'.*'scaled_reference'"):
            build_part(attention="nope")
        assert build_part(attention="softmax", attention_cfg=dict(gamma=0.1)).attention_method is None  # the flip
        with pytest.raises(ValueError, match="ScaledReferenceConfig.gamma must be finite"):
            build_part(attention=NAME, attention_cfg=dict(gamma=float("nan")))


def test_mmseg_warmup_with_a_non_additive_method_is_refused(monkeypatch):
    from toy_method import register_non_additive_method

    doubled = register_non_additive_method(monkeypatch, "contract_mmseg_doubled")  # for this test only
    args = zc.mm_args("backbone")
    # without warm-up it builds
    built = zc.mm_build("PIDVisionTransformer", args, attention="contract_mmseg_doubled")
    assert built.attention_config == doubled.config_type()
    for type_, part in (("PIDVisionTransformer", "backbone"), ("PIDSegmenterMaskTransformerHead", "head")):
        with pytest.raises(ValueError, match="'contract_mmseg_doubled'.* not additive.*set warmup_steps=0"):
            zc.mm_build(type_, zc.mm_args(part), attention="contract_mmseg_doubled",
                        attention_cfg=dict(warmup_steps=10))


def toy_fs(gamma):
    return zc.fs_method("scaled_reference", {"gamma": gamma})


def test_fairseq_toy_options_presets_and_the_catalogue_architectures():
    import pid_plugins.fairseq as pf
    from method_cases import fairseq_data
    from toy_method import METHOD, ScaledReferenceConfig

    data = fairseq_data()
    args = zc.fs_parse(data, extra=toy_fs(0.3))
    assert (args.attention_method, json.loads(args.attention_cfg)) == ("scaled_reference", {"gamma": 0.3})
    model, _, _ = zc.fs_build(data, extra=toy_fs(0.3))
    assert isinstance(model.decoder, pf.PIDTransformerDecoder)
    for layer in model.decoder.layers:
        assert type(layer) is pf.PIDTransformerDecoderLayer and type(layer.self_attn) is pf.PIDMultiheadAttention
    strong, _, _ = zc.fs_build(data, extra=["--attention-method", "scaled_reference", "--attention-cfg", '"strong"'])
    assert strong.decoder.layers[0].self_attn.attention_config == ScaledReferenceConfig(gamma=2.0)
    # the catalogue's architectures take the method too (their PID gains are not filled in then)
    wide, _, _ = zc.fs_build(data, arch="transformer_lm_pid_wikitext103", extra=toy_fs(0.3))
    assert wide.decoder.layers[0].self_attn.attention_method is METHOD
    # --attention-cfg without --attention-method: PID (the architecture's method) with those parameters
    pid, _, _ = zc.fs_build(data, extra=["--attention-cfg", '{"lambda_p": 0.2, "beta": 0.9}'])
    assert pid.decoder.layers[0].self_attn.attention_config.gains == (0.2, 0.5, 0.1, 0.9)


def test_fairseq_refusals():
    from method_cases import fairseq_data

    data = fairseq_data()
    with pytest.raises(ValueError, match=r"unknown attention method 'nope': choose 'softmax' or one of \[.*'pid'.*"
                                         r"'scaled_reference'"):
        zc.fs_build(data, extra=["--attention-method", "nope"])
    with pytest.raises(ValueError, match=r"unknown ScaledReferenceConfig field\(s\) \['learnable'\]"):
        zc.fs_build(data, extra=["--attention-method", "scaled_reference", "--attention-cfg", '{"learnable": true}'])
    with pytest.raises(ValueError, match="--attention-cfg must be a JSON object"):
        zc.fs_build(data, extra=["--attention-method", "scaled_reference", "--attention-cfg", "gamma=0.3"])


@pytest.mark.integration  # fairseq-train's CLI
@pytest.mark.slow
def test_fairseq_train_cli_with_a_method_from_the_users_user_dir(tmp_path, tiny_fairseq_data_bin):
    """fairseq-train --arch transformer_lm_pid --attention-method scaled_reference, the toy registered by the user's
    own --user-dir (which imports pid_plugins.fairseq); the checkpoint reloads with the method and its parameters."""
    import pid_plugins.fairseq as pf
    from toy_method import METHOD, ScaledReferenceConfig

    user_dir = tmp_path / "my_methods_user_dir"
    user_dir.mkdir()
    (user_dir / "__init__.py").write_text(
        f"import sys\nsys.path.insert(0, {str(TESTS)!r})\nimport pid_plugins.fairseq  # noqa\nimport toy_method  # noqa\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    bin_dir = Path(sys.executable).parent
    proc = subprocess.run([str(bin_dir / "fairseq-train"), str(tiny_fairseq_data_bin), "--task", "language_modeling",
                           "--user-dir", str(user_dir), "--arch", "transformer_lm_pid", *zc.fs_tiny(), "--max-tokens",
                           "128", "--optimizer", "adam", "--lr", "0.001", "--max-update", "2", "--cpu",
                           "--num-workers", "0", "--save-dir", "ck", "--no-epoch-checkpoints", *toy_fs(0.25)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    state = torch.load(tmp_path / "ck" / "checkpoint_last.pt", map_location="cpu", weights_only=True)
    assert state["cfg"]["model"]["attention_method"] == "scaled_reference"
    assert json.loads(state["cfg"]["model"]["attention_cfg"]) == {"gamma": 0.25}
    hub = pf.load_pid_lm(str(tmp_path / "ck" / "checkpoint_last.pt"), str(tiny_fairseq_data_bin))
    attn = hub.models[0].decoder.layers[0].self_attn
    assert attn.attention_method is METHOD and attn.attention_config == ScaledReferenceConfig(gamma=0.25)
    assert torch.isfinite(hub.score("w1 w2 w3")["positional_scores"]).all()


def test_fairseq_warmup_with_a_non_additive_method_is_refused():
    """Warm-up runs fairseq's fused attention plus the method's term: a method without a separate term is refused
    (the method is handed to the decoder directly, so the registry stays as it is for other tests)."""
    from dataclasses import dataclass

    import pid_plugins.fairseq as pf
    from method_cases import fairseq_data
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

    stock, task, args = zc.fs_build(fairseq_data(), arch="transformer_lm")
    args.max_target_positions = args.tokens_per_sample  # as build_model sets it
    embed = stock.decoder.embed_tokens
    decoder = pf.PIDTransformerDecoder(args, task.target_dictionary, embed, no_encoder_attn=True,
                                       choice=MethodChoice(Doubled(), Cfg()))  # no warm-up: fine
    assert decoder.attention_warmup is None
    with pytest.raises(ValueError, match="'doubled'.* not additive.*set warmup_steps=0"):
        pf.PIDTransformerDecoder(args, task.target_dictionary, embed, no_encoder_attn=True,
                                 choice=MethodChoice(Doubled(), Cfg(warmup_steps=5)))
