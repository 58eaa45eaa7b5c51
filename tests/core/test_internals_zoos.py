"""The guard on the zoo internals of the timm, mmseg and fairseq adapters (transformers': tests/test_versions.py).

For each adapter: every internal it lists (``pid_plugins/<zoo>/internals.py``) holds under the installed release and
is required somewhere in the adapter; and a faked change of one (monkeypatch) is refused where a user meets it
(building a model, converting one, the import-time changes) with one clear error naming the zoo's version and the
tested range, before anything is computed or changed.
"""
from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from pid_plugins import versions
from pid_plugins.versions import Internal, InternalChanged

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def fresh_checks(monkeypatch):
    """Each internal is checked once per process; here every require checks again, as in a process started under
    the changed release (whatever this process imported and checked before the test changed the internal)."""
    monkeypatch.setattr(versions, "_holds", versions._holds.__wrapped__)


def changed(zoo: str, name: str) -> str:
    """The message of :class:`InternalChanged` for ``zoo``'s internal ``name``, as a regex."""
    return (rf"{re.escape(zoo)} {re.escape(versions.installed_version(zoo))} changed an internal pid-plugins reads: "
            rf"{re.escape(name)}.*pid-plugins is tested with {re.escape(zoo)} {re.escape(versions.tested_range(zoo))}")


def required_names(package: Path) -> set:
    """The names the adapter's modules (not internals.py) pass to ``require(...)`` or call ``.require()`` on."""
    names = set()
    for path in package.rglob("*.py"):
        if path.name == "internals.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            if isinstance(node.func, ast.Name) and node.func.id == "require":
                for arg in node.args:
                    arg = arg.value if isinstance(arg, ast.Starred) else arg
                    names.update(n.id for n in ast.walk(arg) if isinstance(n, ast.Name))
            elif isinstance(node.func, ast.Attribute) and node.func.attr == "require" \
                    and isinstance(node.func.value, ast.Name):
                names.add(node.func.value.id)
    return names


def assert_listed_and_required(internals: types.ModuleType, package: Path, aliases: dict = None) -> None:
    """Every Internal of the module is in its INTERNALS, holds now, and the adapter requires it (directly or in one
    of the module's groups)."""
    constants = {name: value for name, value in vars(internals).items() if isinstance(value, Internal)}
    assert set(constants.values()) == set(internals.INTERNALS)
    for internal in internals.INTERNALS:
        assert internal.check(), f"{internal.zoo}: {internal.name}"
        assert internal.why and internal.versions
        assert internal.zoo in versions.TESTED or internal.zoo == "python"
    groups = {name: value for name, value in vars(internals).items()
              if isinstance(value, tuple) and value and all(isinstance(v, Internal) for v in value)}
    used = set()
    for name in required_names(package):
        name = (aliases or {}).get(name, name)
        used.update(groups.get(name, (constants.get(name),)))
    missing = [i.name for i in internals.INTERNALS if i not in used]
    assert not missing, f"listed but never required: {missing}"


# ================================================================================================== timm
TINY = dict(img_size=32, patch_size=8, embed_dim=48, depth=2, num_heads=3, num_classes=10)


def snapshot(model):
    """Every module's class and attributes, and the state_dict (keys and tensors)."""
    return ([(name, type(m), sorted(vars(m)), sorted(m._modules), sorted(m._parameters), sorted(m._buffers))
             for name, m in model.named_modules()],
            {k: v.clone() for k, v in model.state_dict().items()})


def assert_unchanged(model, before):
    after = snapshot(model)
    assert after[0] == before[0] and after[1].keys() == before[1].keys()
    assert all(torch.equal(after[1][k], before[1][k]) for k in before[1])


def test_every_timm_internal_holds_and_is_required():
    pytest.importorskip("timm")
    from pid_plugins.timm import internals

    assert_listed_and_required(internals, ROOT / "pid_plugins" / "timm", aliases={"FAN_INTERNALS": "FAN"})


def test_a_changed_vit_internal_is_refused_at_build_and_convert(monkeypatch, fresh_checks):
    """A timm release whose ``VisionTransformer.forward_features`` does one more step: the method ViT (which computes
    it again) is refused by name and by ``convert``, and the stock model given to ``convert`` is left as it was."""
    timm = pytest.importorskip("timm")
    import pid_plugins.timm as pt
    from timm.models.vision_transformer import VisionTransformer

    torch.manual_seed(0)
    stock = timm.create_model("deit_tiny_patch16_224", **TINY).eval()
    before = snapshot(stock)

    def forward_features(self, x, attn_mask=None, is_causal=False):  # a release with a step the method ViT lacks
        x = self.norm_pre(self.patch_drop(self._pos_embed(self.patch_embed(x))))
        x = self.rope_mixer(x)
        return self.norm(self.blocks(x))

    monkeypatch.setattr(VisionTransformer, "forward_features", forward_features)
    message = changed("timm", pt.internals.VIT_FORWARD.name)
    with pytest.raises(InternalChanged, match=message):
        timm.create_model("pid_deit_tiny_patch16_224", **TINY)
    with pytest.raises(InternalChanged, match=message):
        pt.convert(stock, "pid")
    assert type(stock) is VisionTransformer
    assert_unchanged(stock, before)
    monkeypatch.undo()  # the release the adapter knows: building works again
    versions._holds.cache_clear()
    assert type(timm.create_model("pid_deit_tiny_patch16_224", **TINY)) is pt.PIDVisionTransformer


def test_a_changed_feature_index_rule_is_refused_for_fan_and_vit_alike(monkeypatch, fresh_checks):
    """``feature_take_indices`` with another signature: FAN and the method ViT both read it, both are refused."""
    timm = pytest.importorskip("timm")
    import pid_plugins.timm as pt
    from timm.models import _features

    monkeypatch.setattr(_features, "feature_take_indices", lambda n, indices=None, as_set=False, *, start=0: None)
    message = changed("timm", pt.internals.FEATURE_TAKE_INDICES.name)
    with pytest.raises(InternalChanged, match=message):
        timm.create_model("pid_fan_tiny_12_p16_224", img_size=32, depth=2, num_classes=10)
    with pytest.raises(InternalChanged, match=message):
        pt.PIDVisionTransformer(**TINY)


def test_a_changed_pretrained_source_order_is_refused_before_loading(monkeypatch, tmp_path, fresh_checks):
    """A timm release that prefers the registry's url over a local file: ``pretrained=True`` stops before any model is
    built or any weight read (pid-plugins never downloads)."""
    timm = pytest.importorskip("timm")
    import pid_plugins.timm as pt
    from timm.models import _builder

    weights = tmp_path / "w.pth"
    torch.save({}, weights)
    monkeypatch.setattr(_builder, "_resolve_pretrained_source", lambda cfg: ("url", cfg.get("url")))
    built = []
    monkeypatch.setattr(pt.PIDVisionTransformer, "__init__", lambda self, *a, **k: built.append(1))
    with pytest.raises(InternalChanged, match=changed("timm", pt.internals.PRETRAINED_SOURCE.name)):
        timm.create_model("pid_deit_tiny_patch16_224", pretrained=True,
                          pretrained_cfg_overlay=dict(file=str(weights)), **TINY)
    assert not built


# ================================================================================================= mmseg
def test_every_mmseg_internal_holds_and_is_required():
    pytest.importorskip("mmseg")
    import pid_plugins.mmseg  # noqa: F401  (the mmcv._ext stand-in, then mmseg.models)
    from pid_plugins.mmseg import internals

    assert_listed_and_required(internals, ROOT / "pid_plugins" / "mmseg")


MM_BACKBONE = dict(img_size=(32, 32), patch_size=8, embed_dims=48, num_layers=2, num_heads=3, drop_path_rate=0.0,
                   final_norm=True, with_cls_token=True, norm_cfg=dict(type="LN", eps=1e-6))


def test_a_changed_mmseg_vit_is_refused_at_build_and_convert(monkeypatch, fresh_checks):
    """An mmseg release whose ViT forward reads one more attribute: the method backbone (which computes the forward
    again) is refused when a config builds it and by ``convert``, which leaves the stock backbone as it was."""
    pytest.importorskip("mmseg")
    import pid_plugins.mmseg as pm
    from mmseg.models.backbones.vit import VisionTransformer
    from mmseg.registry import MODELS

    from zoos.mmseg.test_mmseg_convert import stock as stock_segmentor

    stock = stock_segmentor()  # convert switches a segmentor's backbone (a bare stock backbone is refused anyway)
    before = snapshot(stock)
    original = VisionTransformer.forward

    def forward(self, inputs):  # a release that adds a step after the position embedding
        x = original(self, inputs)
        return self.post_pos_norm(x)

    monkeypatch.setattr(VisionTransformer, "forward", forward)
    message = changed("mmsegmentation", pm.internals.MMSEG_VIT.name)
    with pytest.raises(InternalChanged, match=message):
        MODELS.build(dict(type="PIDVisionTransformer", **MM_BACKBONE))
    with pytest.raises(InternalChanged, match=message):
        pm.convert(stock, "pid")
    assert type(stock.backbone) is VisionTransformer
    assert_unchanged(stock, before)


def test_a_changed_mmcv_attention_is_refused_for_the_head_too(monkeypatch, fresh_checks):
    """mmcv's attention no longer adding its dropout the way the method layer does: the decoder head is refused."""
    pytest.importorskip("mmseg")
    import pid_plugins.mmseg as pm
    from mmcv.cnn.bricks.transformer import MultiheadAttention
    from mmseg.registry import MODELS

    def forward(self, query, key=None, value=None, identity=None, **kwargs):  # a release scaling the residual
        out = self.attn(query=query, key=query, value=query)[0]
        return identity + self.gamma * self.dropout_layer(self.proj_drop(out))

    monkeypatch.setattr(MultiheadAttention, "forward", forward)
    with pytest.raises(InternalChanged, match=changed("mmcv-lite", pm.internals.MMCV_ATTENTION.name)):
        MODELS.build(dict(type="PIDSegmenterMaskTransformerHead", attention="pid", in_channels=48, channels=48,
                          num_classes=5, num_layers=2, num_heads=3, embed_dims=48, dropout_ratio=0.0,
                          norm_cfg=dict(type="LN")))


def test_a_changed_checkpoint_loader_is_refused_before_the_table_changes(monkeypatch, fresh_checks):
    """An mmengine release whose ``register_scheme`` edits ``_schemes`` in place: restoring a saved copy would no longer
    restore the table, so the weights-only scope (``WeightsOnlyCheckpointHook``) refuses to start and mmengine's table
    is left as it was."""
    pytest.importorskip("mmseg")
    import pid_plugins.mmseg as pm
    from mmengine.runner.checkpoint import CheckpointLoader

    def _register_scheme(cls, prefixes, loader, force=False):  # in place, no rebinding
        for prefix in [prefixes] if isinstance(prefixes, str) else prefixes:
            cls._schemes[prefix] = loader

    monkeypatch.setattr(CheckpointLoader, "_register_scheme", classmethod(_register_scheme))
    table, entries = CheckpointLoader._schemes, dict(CheckpointLoader._schemes)
    hook = pm.WeightsOnlyCheckpointHook()
    message = changed("mmengine", pm.internals.CHECKPOINT_SCHEMES.name)
    with pytest.raises(InternalChanged, match=message):
        hook.before_run(types.SimpleNamespace())
    with pytest.raises(InternalChanged, match=message):
        pm.checkpoint.load_checkpoint("/nonexistent/weights.pth")
    assert CheckpointLoader._schemes is table and dict(table) == entries and hook._scope is None


def test_a_changed_mmcv_op_loader_stops_the_stand_in(monkeypatch, fresh_checks):
    """mmcv-lite's op loader calling an op at import: the stand-in (whose ops raise when called) would break that
    import in another place, so installing it is refused, with nothing registered."""
    pytest.importorskip("mmseg")
    import pid_plugins.mmseg as pm
    from mmcv.utils import ext_loader
    from pid_plugins.mmseg import compat

    def load_ext(name, funcs):  # a release asking the compiled module for its version at load
        ext = __import__("importlib").import_module("mmcv." + name)
        ext.get_compiling_cuda_version()
        return ext

    monkeypatch.setattr(ext_loader, "load_ext", load_ext)
    monkeypatch.delitem(sys.modules, compat.STANDIN_NAME)
    with pytest.raises(InternalChanged, match=changed("mmcv-lite", pm.internals.MMCV_EXT.name)):
        compat.install_mmcv_ext_standin()
    assert compat.STANDIN_NAME not in sys.modules


# =============================================================================================== fairseq
def test_every_fairseq_internal_holds_and_is_required():
    pytest.importorskip("fairseq")
    import pid_plugins.fairseq  # noqa: F401
    from pid_plugins.fairseq import internals

    assert_listed_and_required(internals, ROOT / "pid_plugins" / "fairseq")


def test_a_changed_incremental_buffer_is_refused_at_build_and_convert(monkeypatch, tmp_path_factory, fresh_checks):
    """A fairseq release without ``MultiheadAttention._get_input_buffer``: ``--arch transformer_lm_pid`` is refused when
    fairseq builds it, and ``convert`` refuses a stock ``transformer_lm``, leaving it as it was."""
    pytest.importorskip("fairseq")
    import pid_plugins.fairseq as pf
    from fairseq.models.transformer_lm import TransformerLanguageModel
    from fairseq.modules.multihead_attention import MultiheadAttention
    from zoo_cases import fs_build, fs_dictionary

    data = fs_dictionary(tmp_path_factory.mktemp("dict"))
    stock = fs_build(data, arch="transformer_lm", layers=2)[0]
    before = snapshot(stock)
    monkeypatch.delattr(MultiheadAttention, "_get_input_buffer")
    message = changed("fairseq", pf.internals.INPUT_BUFFER.name)
    with pytest.raises(InternalChanged, match=message):
        fs_build(data, layers=2)
    with pytest.raises(InternalChanged, match=message):
        pf.convert(stock, "pid")
    assert type(stock) is TransformerLanguageModel
    assert_unchanged(stock, before)


def test_a_changed_checkpoint_global_is_refused_before_patching(monkeypatch, fresh_checks):
    """A fairseq release that no longer loads through its module global ``torch``: the weights-only loading is
    refused (it would load nothing through it), and ``checkpoint_utils`` is left as it was."""
    pytest.importorskip("fairseq")
    import pid_plugins.fairseq as pf
    from fairseq import checkpoint_utils

    standin = types.SimpleNamespace(load=torch.load, device=torch.device)  # e.g. `from torch import load` instead
    monkeypatch.setattr(checkpoint_utils, "torch", standin)
    with pytest.raises(InternalChanged, match=changed("fairseq", pf.internals.CHECKPOINT_TORCH.name)):
        pf.checkpoint.install()
    assert checkpoint_utils.torch is standin


def test_a_changed_dataclass_internal_is_refused_and_the_hook_not_installed(monkeypatch, fresh_checks):
    """Python's ``dataclasses._get_field`` with another signature: the compat hook installs nothing, and
    ``pid_plugins.fairseq`` refuses with a message naming Python's version (not a zoo's)."""
    pytest.importorskip("fairseq")
    import pid_plugins.fairseq as pf
    import pid_plugins_fairseq_compat as compat

    def _get_field(cls, name, annotation, default_kw_only):  # a Python that renamed the arguments
        raise AssertionError("not called")

    hook = dataclasses._get_field
    monkeypatch.setattr(hook, "_pid_plugins_original", _get_field, raising=False)
    with pytest.raises(InternalChanged, match=rf"Python {re.escape(sys.version.split()[0])} changed an internal "
                                              r"pid-plugins reads: dataclasses\._get_field.*known to hold in Python "
                                              r"3\.11 - 3\.13"):
        pf.internals.DATACLASS_FIELD.require()
    monkeypatch.setattr(dataclasses, "_get_field", _get_field)  # a process without the hook yet
    assert compat.install() is False and dataclasses._get_field is _get_field


@pytest.mark.skipif(sys.version_info < (3, 11), reason="the compat hook is installed from Python 3.11 on")
def test_a_changed_dataclass_internal_stops_the_import():
    """The import a user (or ``--user-dir``) makes: ``import pid_plugins.fairseq`` stops with the message before
    fairseq is imported."""
    pytest.importorskip("fairseq")
    code = ("import dataclasses, sys\n"
            "import pid_plugins_fairseq_compat as compat\n"
            "compat.install()\n"
            "def _get_field(cls, name, annotation, default_kw_only): pass\n"
            "dataclasses._get_field._pid_plugins_original = _get_field\n"
            "try:\n"
            "    import pid_plugins.fairseq\n"
            "except Exception as exc:\n"
            "    print(type(exc).__name__, exc)\n"
            "print('fairseq imported:', 'fairseq' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert "InternalChanged Python" in out.stdout and "dataclasses._get_field" in out.stdout
    assert "fairseq imported: False" in out.stdout


# The fairseq probes (pid_plugins/fairseq/probes.py): a release whose part computes (or builds) differently, its
# signature and source text looking as before (functools.wraps: inspect sees the original's), fails the part's probe,
# and the method model is refused naming that part (the lowest whose check fails), as is convert.
def _scaled_output(function):
    @functools.wraps(function)
    def changed(*args, **kwargs):  # a release whose part scales what it returns
        out = function(*args, **kwargs)
        return (out[0] * 1.01, *out[1:])
    return changed


def _reorders_own_entries(function):
    @functools.wraps(function)
    def reorder_incremental_state(self, incremental_state, new_order):  # a release reordering its own keys only
        buffer = self._get_input_buffer(incremental_state)
        for key in ("prev_key", "prev_value", "prev_key_padding_mask"):
            if buffer.get(key) is not None:
                buffer[key] = buffer[key].index_select(0, new_order)
        return self._set_input_buffer(incremental_state, buffer)
    return reorder_incremental_state


def _builds_other_embeddings(method):
    function = method.__func__

    @functools.wraps(function)
    def build_model(cls, args, task):  # a release that initialises the token embedding another way
        model = function(cls, args, task)
        with torch.no_grad():
            model.decoder.embed_tokens.weight.normal_(0.0, 0.5)
        return model
    return classmethod(build_model)


FAIRSEQ_CHANGES = {  # probe: (internal, the fairseq class and attribute changed, the change)
    "attention": ("MHA", "fairseq.modules.multihead_attention.MultiheadAttention", "forward", _scaled_output),
    "incremental": ("INPUT_BUFFER", "fairseq.modules.multihead_attention.MultiheadAttention",
                    "reorder_incremental_state", _reorders_own_entries),
    "layer": ("DECODER_LAYER", "fairseq.modules.transformer_layer.TransformerDecoderLayerBase", "forward",
              _scaled_output),
    "decoder": ("DECODER", "fairseq.models.transformer.TransformerDecoderBase", "extract_features_scriptable",
                _scaled_output),
    "build": ("BUILD_MODEL", "fairseq.models.transformer_lm.TransformerLanguageModel", "build_model",
              _builds_other_embeddings),
}


@pytest.mark.parametrize("probe", FAIRSEQ_CHANGES)
def test_a_fairseq_part_computing_differently_fails_its_probe_and_is_refused(probe, monkeypatch, tmp_path_factory,
                                                                            fresh_checks):
    pytest.importorskip("fairseq")
    import importlib

    import pid_plugins.fairseq as pf
    from fairseq.models.transformer_lm import TransformerLanguageModel
    from zoo_cases import fs_build, fs_dictionary

    name, where, attribute, change = FAIRSEQ_CHANGES[probe]
    module, cls = where.rsplit(".", 1)
    owner = getattr(importlib.import_module(module), cls)
    internal = getattr(pf.internals, name)
    data = fs_dictionary(tmp_path_factory.mktemp("dict"))
    stock = fs_build(data, arch="transformer_lm", layers=2)[0]
    before = snapshot(stock)
    assert pf.internals.PROBES[probe]() and internal.check()
    monkeypatch.setattr(owner, attribute, change(inspect.getattr_static(owner, attribute)
                                                 if attribute == "build_model" else getattr(owner, attribute)))
    assert not pf.internals.PROBES[probe]()
    message = changed("fairseq", internal.name)
    with pytest.raises(InternalChanged, match=message):
        fs_build(data, layers=2)
    if internal is not pf.internals.BUILD_MODEL:  # (convert builds nothing: it relies on the rest)
        with pytest.raises(InternalChanged, match=message):
            pf.convert(stock, "pid")
        assert type(stock) is TransformerLanguageModel
        assert_unchanged(stock, before)
    monkeypatch.undo()
    assert pf.internals.PROBES[probe]() and internal.check()


def test_a_fairseq_release_loading_checkpoints_past_its_torch_global_is_refused(monkeypatch, fresh_checks):
    """A fairseq release whose load_checkpoint_to_cpu reaches torch.load another way (``from torch import load``): the
    checkpoint probe sees the module global not reached, and the weights-only loading refuses to install."""
    pytest.importorskip("fairseq")
    import pid_plugins.fairseq as pf
    from fairseq import checkpoint_utils

    load = torch.load

    def load_checkpoint_to_cpu(path, arg_overrides=None, load_on_all_ranks=False):
        with open(path, "rb") as f:
            return load(f, map_location=torch.device("cpu"))

    current = checkpoint_utils.torch
    monkeypatch.setattr(checkpoint_utils, "load_checkpoint_to_cpu", load_checkpoint_to_cpu)
    with pytest.raises(InternalChanged, match=changed("fairseq", pf.internals.CHECKPOINT_TORCH.name)):
        pf.checkpoint.install()
    assert checkpoint_utils.torch is current
    monkeypatch.undo()
    assert pf.internals.CHECKPOINT_TORCH.check() and checkpoint_utils.torch is current


def test_a_composite_optimizer_ignoring_param_group_is_refused_for_learnable_parameters(monkeypatch, tmp_path_factory,
                                                                                        fresh_checks):
    """A fairseq release whose ``--optimizer composite`` no longer reads ``param_group``: the optimizer probe sees every
    parameter in ``default``; a model with learnable parameters is refused (built or converted), one without is not."""
    pytest.importorskip("fairseq")
    import builtins

    import pid_plugins.fairseq as pf
    from fairseq.optim import composite
    from zoo_cases import fs_build, fs_dictionary, fs_method

    def getattr_(obj, name, *default):  # composite's getattr(p, "param_group", "default"), the attribute unread
        return default[0] if name == "param_group" and default else builtins.getattr(obj, name, *default)

    data = fs_dictionary(tmp_path_factory.mktemp("dict"))
    stock = fs_build(data, arch="transformer_lm", layers=2)[0]
    monkeypatch.setattr(composite, "getattr", getattr_, raising=False)
    message = changed("fairseq", pf.internals.PARAM_GROUP.name)
    with pytest.raises(InternalChanged, match=message):
        fs_build(data, layers=2, extra=fs_method("pid", {"learnable": True}))
    with pytest.raises(InternalChanged, match=message):
        pf.convert(stock, "pid", {"learnable": True})
    assert type(stock.decoder).__name__ == "TransformerDecoder"
    fs_build(data, layers=2)  # fixed gains: no parameter group
    monkeypatch.undo()
    assert pf.internals.PARAM_GROUP.check()


def test_a_python_taking_unhashable_defaults_is_refused(monkeypatch, fresh_checks):
    """A Python whose ``dataclasses._get_field`` (same signature) no longer refuses a default of an unhashable class:
    the hook would relax nothing, and the probe of the rule refuses it."""
    pytest.importorskip("fairseq")
    import pid_plugins.fairseq as pf
    import pid_plugins_fairseq_compat as compat

    def _get_field(cls, a_name, a_type, default_kw_only=False):  # takes any default
        return dataclasses.field(default=getattr(cls, a_name))

    monkeypatch.setattr(compat, "target_holds", lambda: True)  # the signature is as expected: the rule is probed
    monkeypatch.setattr(dataclasses._get_field, "_pid_plugins_original", _get_field, raising=False)
    assert not pf.internals.DATACLASS_FIELD.check()
    with pytest.raises(InternalChanged, match=r"dataclasses\._get_field"):
        pf.internals.DATACLASS_FIELD.require()
    monkeypatch.undo()
    assert pf.internals.DATACLASS_FIELD.check()


def test_a_fairseq_release_that_only_rewrites_the_text_passes(monkeypatch, fresh_checks):
    """The attention, its buffer and the checkpoint loader written another way, computing the same: the probes pass
    (the source-text checks they replace read these functions' text and refused any rewrite)."""
    pytest.importorskip("fairseq")
    import pid_plugins.fairseq as pf
    from fairseq import checkpoint_utils
    from fairseq.modules.multihead_attention import MultiheadAttention

    def reorder_incremental_state(self, incremental_state, new_order):  # a comprehension instead of the loop
        buffer = self._get_input_buffer(incremental_state)
        if buffer is not None:
            buffer = {k: None if v is None else v.index_select(0, new_order) for k, v in buffer.items()}
            incremental_state = self._set_input_buffer(incremental_state, buffer)
        return incremental_state

    def load_checkpoint_to_cpu(path, arg_overrides=None, load_on_all_ranks=False):  # map_location spelled otherwise
        with open(path, "rb") as f:
            return checkpoint_utils.torch.load(f, map_location="cpu")

    monkeypatch.setattr(MultiheadAttention, "reorder_incremental_state", reorder_incremental_state)
    monkeypatch.setattr(checkpoint_utils, "load_checkpoint_to_cpu", load_checkpoint_to_cpu)
    assert pf.internals.INPUT_BUFFER.check() and pf.internals.MHA.check()
    assert pf.internals.CHECKPOINT_TORCH.check()


def test_a_scheme_mmengine_adds_without_a_weights_only_loader_is_refused(monkeypatch, fresh_checks):
    """mmengine's table gaining a scheme of mmengine's own that pid-plugins pairs with no weights-only loader (a path
    of that scheme would be unpickled around the hook): refused; another library's scheme is its own, and passes."""
    pytest.importorskip("mmseg")
    import pid_plugins.mmseg as pm
    from mmengine.runner import checkpoint as mm_checkpoint

    loader = mm_checkpoint.CheckpointLoader
    assert pm.internals.CHECKPOINT_SCHEMES.check()

    def theirs(filename, map_location=None):
        return {}

    monkeypatch.setattr(loader, "_schemes", {**loader._schemes, "other-lib://": theirs})
    monkeypatch.setattr(loader, "_schemes", dict(sorted(loader._schemes.items(), reverse=True)))
    assert pm.internals.CHECKPOINT_SCHEMES.check()  # not mmengine's: the other library's own

    def new_scheme(filename, map_location=None):
        return {}

    new_scheme.__module__ = mm_checkpoint.__name__  # a loader mmengine registers itself
    monkeypatch.setattr(loader, "_schemes", dict(sorted({**loader._schemes, "hub://": new_scheme}.items(),
                                                        reverse=True)))
    assert not pm.internals.CHECKPOINT_SCHEMES.check()
    with pytest.raises(InternalChanged, match=changed("mmengine", pm.internals.CHECKPOINT_SCHEMES.name)):
        pm.checkpoint.load_checkpoint("/nonexistent/weights.pth")


def test_a_changed_history_buffer_statistic_is_refused(monkeypatch, fresh_checks):
    """A ``HistoryBuffer`` whose statistic table maps a name to another function (what a training checkpoint pickles
    would no longer be what the weights-only loader allows): the check fails; the release the adapter knows passes."""
    pytest.importorskip("mmseg")
    import pid_plugins.mmseg as pm
    from mmengine.logging.history_buffer import HistoryBuffer

    assert pm.internals.HISTORY_BUFFER.check()
    monkeypatch.setattr(HistoryBuffer, "_statistics_methods", {**HistoryBuffer._statistics_methods,
                                                               "mean": HistoryBuffer.max})
    assert not pm.internals.HISTORY_BUFFER.check()
