"""The guard on the internals the timm, mmseg and fairseq adapters read (transformers': test_versions.py): each listed
internal holds and is required, and a faked change of one is refused where a user meets it (building, converting,
importing) with one error naming the version and the tested range, before anything changes."""
from __future__ import annotations

import ast
import dataclasses
import functools
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


@pytest.mark.parametrize("adapter", ["timm", "mmseg", "fairseq"])
def test_every_internal_holds_and_is_required(adapter):
    pytest.importorskip(adapter)
    import importlib

    importlib.import_module(f"pid_plugins.{adapter}")  # (mmseg: the mmcv._ext stand-in, then mmseg.models)
    internals = importlib.import_module(f"pid_plugins.{adapter}.internals")
    assert_listed_and_required(internals, ROOT / "pid_plugins" / adapter, aliases={"FAN_INTERNALS": "FAN"})


def test_a_changed_vit_internal_is_refused_at_build_and_convert(monkeypatch, fresh_checks):
    """A timm release whose ``VisionTransformer.forward_features`` does one more step: the doctor's model probe finds
    it; where the step also takes an argument, the method ViT (which computes it again) is refused by name and by
    ``convert``, and the stock model given to ``convert`` is left as it was."""
    timm = pytest.importorskip("timm")
    import pid_plugins.timm as pt
    from timm.models.vision_transformer import VisionTransformer

    torch.manual_seed(0)
    stock = timm.create_model("deit_tiny_patch16_224", **TINY).eval()
    before = snapshot(stock)

    def forward_features(self, x, attn_mask=None, is_causal=False):  # a release with a step the method ViT lacks
        x = self.norm_pre(self.patch_drop(self._pos_embed(self.patch_embed(x))))
        return self.norm(self.blocks(x * 2))

    monkeypatch.setattr(VisionTransformer, "forward_features", forward_features)
    assert pt.internals.VIT_FORWARD.check()  # the same signature: only the probe sees the step
    [(_, problem)] = versions.doctor([pt.internals.VIT_FORWARD])
    assert problem == "its probe found it changed"

    def forward_features(self, x, attn_mask=None, is_causal=False, rope=None):
        x = self.norm_pre(self.patch_drop(self._pos_embed(self.patch_embed(x))))
        return self.norm(self.blocks(self.rope_mixer(x, rope)))

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


# timm's other checks, each against a release that changed what it guards (the adapter's code reads each where it
# builds a model; here the check and its refusal)
def _load_pretrained(model, pretrained_cfg=None, num_classes=1000, in_chans=3, filter_fn=None, strict=True,
                     cache_dir=None):  # a release that keeps every classifier key
    model.load_state_dict(pretrained_cfg["state_dict"], strict=strict)


def _build_model_with_cfg(model_cls, variant, pretrained, pretrained_cfg=None, pretrained_cfg_overlay=None,
                          model_cfg=None, feature_cfg=None, pretrained_strict=True, pretrained_filter_fn=None,
                          cache_dir=None, kwargs_filter=None, **kwargs):  # a release without the 'getter' class
    return model_cls(**kwargs)


def _register_model(fn):  # a release whose registry no longer reads the module's default_cfgs
    return fn


def _scaled(function):
    @functools.wraps(function)
    def changed(*args, **kwargs):  # a release whose part scales what it returns (its signature as before)
        return function(*args, **kwargs) * 1.01
    return changed


def _ignores_reentrant(function):
    @functools.wraps(function)
    def checkpoint(fn, *args, use_reentrant=None, **kwargs):  # a release that always checkpoints non-reentrantly
        return function(fn, *args, use_reentrant=False, **kwargs)
    return checkpoint


TIMM_CHANGES = {  # internal: (module, attribute, the change of the attribute's current value)
    "ATTN_LAYERS": ("timm.models.vision_transformer", "ATTN_LAYERS",
                    lambda layers: {k: v for k, v in layers.items() if k != "attn"}),
    "BLOCK": ("timm.models.vision_transformer.Block", "forward", _scaled),
    "CHECKPOINT": ("timm.models._manipulate", "checkpoint", _ignores_reentrant),
    "CLASSIFIER_DROP": ("timm.models._builder", "load_pretrained", lambda old: _load_pretrained),
    "BUILD_MODEL_WITH_CFG": ("timm.models", "build_model_with_cfg", lambda old: _build_model_with_cfg),
    "VIT_CHECKPOINT_FILTER": ("timm.models.vision_transformer", "checkpoint_filter_fn",
                              lambda old: lambda state_dict, model, interpolation="bicubic": state_dict),
    "XCIT": ("timm.models.xcit", "checkpoint_filter_fn", lambda old: lambda state_dict, model: state_dict),
    "DEFAULT_CFGS": ("timm.models._registry", "register_model", lambda old: _register_model),
}


#: the changes only a probe sees (the same signatures, other behaviour)
PROBED = {"BLOCK", "CHECKPOINT", "XCIT"}


def _without(name):
    def change(mapping):  # the mapping without ``name``
        return {k: v for k, v in mapping.items() if k != name}
    return change


HF_CHANGES = {  # internal: (module, attribute, the change of the attribute's current value)
    "CACHE_LAYERS": ("transformers.cache_utils", "DynamicLayer",
                     lambda layer: type("DynamicLayer", (layer,), {"crop": None})),  # a release without crop
    "TORCH_CHECKPOINT": ("torch.distributed.algorithms._checkpoint.checkpoint_wrapper", "CheckpointImpl",
                         lambda old: type("CheckpointImpl", (), {})),  # a release without the reentrant choice
    "GLOBAL_MAPPING": ("transformers.AttentionInterface", "_global_mapping", _without("sdpa")),
    "TP_PLAN": ("transformers.distributed.tensor_parallel", "ALL_PARALLEL_STYLES",
                _without("replicated_with_grad_allreduce")),
}


@pytest.mark.parametrize("zoo, name", [*(("timm", n) for n in TIMM_CHANGES), *(("hf", n) for n in HF_CHANGES)])
def test_each_check_refuses_a_release_that_changed_what_it_guards(zoo, name, monkeypatch, fresh_checks):
    """timm's and transformers' (and torch's) checks that no other test changes: each refuses, with the message, a
    release without what it guards (or, where the change is behaviour, the doctor's probe finds it)."""
    pytest.importorskip("timm" if zoo == "timm" else "transformers")
    import importlib

    importlib.import_module(f"pid_plugins.{zoo}")
    internals = importlib.import_module(f"pid_plugins.{zoo}.internals")
    where, attribute, change = (TIMM_CHANGES if zoo == "timm" else HF_CHANGES)[name]
    try:
        owner = importlib.import_module(where)
    except ImportError:  # a class: its module, then the class
        module, cls = where.rsplit(".", 1)
        owner = getattr(importlib.import_module(module), cls)
    internal = getattr(internals, name)
    if zoo == "hf" and not internal.check():
        pytest.skip(f"{internal.name}: not in transformers {versions.installed_version('transformers')}")
    assert internal.check()
    monkeypatch.setattr(owner, attribute, change(getattr(owner, attribute)))
    if name in PROBED:  # what the change alters is behaviour: the doctor's probe finds it
        assert internal.check()
        [(_, problem)] = versions.doctor([internal])
        assert problem is not None and problem.startswith("its probe"), problem
        return
    assert not internal.check()
    owner_zoo = {"timm": "timm", "hf": "transformers"}[zoo] if name != "TORCH_CHECKPOINT" else "torch"
    with pytest.raises(InternalChanged, match=changed(owner_zoo, internal.name)):
        internal.require()


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


def test_changed_mmengine_checkpoint_helpers_are_refused(monkeypatch, fresh_checks):
    """An mmengine release whose ``_process_mmcls_checkpoint`` takes another argument (the weights-only mmcls://
    loader calls it as mmengine 0.10.7 does): refused before the loading starts."""
    pytest.importorskip("mmseg")
    import pid_plugins.mmseg as pm
    from mmengine.runner import checkpoint as mm_checkpoint

    assert pm.internals.CHECKPOINT_HELPERS.check()
    monkeypatch.setattr(mm_checkpoint, "_process_mmcls_checkpoint", lambda checkpoint, prefix="": checkpoint)
    with pytest.raises(InternalChanged, match=changed("mmengine", pm.internals.CHECKPOINT_HELPERS.name)):
        pm.checkpoint.load_checkpoint("/nonexistent/weights.pth")
