"""Every mmsegmentation, mmengine and mmcv internal the adapter reads, in one place: what, why, which versions, and the
check that runs where the adapter first uses it (:meth:`pid_plugins.versions.Internal.require`).

The public extension points carry most of the adapter: the ``MODELS`` / ``HOOKS`` registries (``register_module``),
``custom_imports``, mmengine's ``Hook`` and ``CheckpointLoader.register_scheme``, and the config keys of mmseg's
``VisionTransformer`` / ``SegmenterMaskTransformerHead``. What is left: the compiled-ops loader of mmcv-lite (the
``mmcv._ext`` stand-in), the parts of mmseg's ViT, encoder layer and Segmenter head (and mmcv's attention around
``torch.nn.MultiheadAttention``) that the method classes compute again with the method's step in between, and the
parts of mmengine's checkpoint module that the weights-only loading replaces or restores. If a release changes one of
these, the user gets :class:`~pid_plugins.versions.InternalChanged` naming the version and the tested range, never a
different result.

mmseg, mmengine and mmcv are imported inside the checks only (this module is imported before ``mmseg.models``: the
``mmcv._ext`` stand-in has to be in place first).
"""
from __future__ import annotations

import inspect
import sys
from typing import Callable, Dict

from ..versions import Internal, parameters, require, squashed

__all__ = ["INTERNALS", "require_all"]

MMSEG, MMENGINE, MMCV = "mmsegmentation", "mmengine", "mmcv-lite"


# ------------------------------------------------------------------------------------------------------ checks
def _mmcv_ext() -> bool:
    """By behaviour: ``load_ext(name, funcs)`` imports ``mmcv.<name>`` and refuses one that lacks a function (what
    the stand-in for mmcv's compiled ops, :mod:`pid_plugins.mmseg.compat`, answers to). Probed with a module of a
    name of its own, in ``sys.modules`` for the call only."""
    import types

    from mmcv.utils import ext_loader  # mmcv.utils imports no op: the stand-in is not needed yet

    name = "_pid_plugins_probe"
    module = types.ModuleType(f"mmcv.{name}")
    module.op = lambda: None
    sys.modules[module.__name__] = module
    try:
        if ext_loader.load_ext(name, ["op"]) is not module:
            return False
        try:
            ext_loader.load_ext(name, ["op", "missing_op"])
        except AssertionError:
            return True
        return False
    finally:
        sys.modules.pop(module.__name__, None)


# The method classes compute mmseg's ViT forward, its TransformerEncoderLayer, mmcv's MultiheadAttention and the
# Segmenter head again with the method's step in between. Whether they still compute what mmseg's and mmcv's do is
# checked by behaviour, not by reading their source: two probes build the stock part (a small backbone with a class
# token and a final norm; a small head) and the method's part on the same perturbed weights, and compare their outputs
# to float32 rounding (the method layer computes torch's MultiheadAttention as q, k, v, SDPA and the projection, in
# another order: 5e-7 apart here; a changed step moves them far more). The method's part runs PID on one layer with control_first_layer=False: that layer is the group's
# reference-only first layer, so it computes the attention through the method classes (q, k, v from the packed
# projection, the zoo's attention, the output projection) and adds nothing. (At zero gains the adapter keeps mmseg's
# own layers, which would test nothing.) A release that computes differently fails its probe, whatever its
# text; one that only rewrites the text passes. Signatures are compared too, and one source-text check is left: the
# Pretrained branch of init_weights, which runs only with a checkpoint file (the reason is in the check).

#: the behavioural probes by name ("layer", "backbone", "head"): :mod:`pid_plugins.mmseg.probes` registers them
#: (``import pid_plugins.mmseg`` imports it; they build the method classes, which import this module: hence a table)
PROBES: Dict[str, Callable[[], bool]] = {}


def _probe(name: str) -> bool:
    return PROBES[name]()


def _mmseg_vit() -> bool:
    from mmseg.models.backbones.vit import VisionTransformer

    resize = inspect.getattr_static(VisionTransformer, "resize_pos_embed")
    # source text: the Pretrained branch of init_weights (resizing a checkpoint's pos_embed) runs only with a
    # checkpoint file on disk, which the probe does not write
    init = squashed(VisionTransformer.init_weights)
    return (parameters(VisionTransformer.forward) == ["self", "inputs"]
            and parameters(VisionTransformer._pos_embeding) == ["self", "patched_img", "hw_shape", "pos_embed"]
            and isinstance(resize, staticmethod)
            and parameters(resize.__func__) == ["pos_embed", "input_shpae", "pos_shape", "mode"]
            and "self.resize_pos_embed(state_dict['pos_embed'],(h//self.patch_size,w//self.patch_size)," in init
            and _probe("backbone"))


def _encoder_layer() -> bool:
    from mmseg.models.backbones.vit import TransformerEncoderLayer

    return {"norm1", "norm2"} <= {n for n, _ in inspect.getmembers(TransformerEncoderLayer)} and _probe("layer")


def _mmcv_attention() -> bool:
    from mmcv.cnn.bricks.transformer import MultiheadAttention

    return parameters(MultiheadAttention.forward)[:4] == ["self", "query", "key", "value"] and _probe("layer")


def _segmenter_head() -> bool:
    from mmseg.models.decode_heads import SegmenterMaskTransformerHead

    return parameters(SegmenterMaskTransformerHead.forward) == ["self", "inputs"] and _probe("head")


#: mmengine's checkpoint schemes (the prefixes ``mmengine.runner.checkpoint`` registers, grouped by loader, in the
#: order :mod:`pid_plugins.mmseg.checkpoint` pairs them with its weights-only loaders)
SCHEME_PREFIXES = ((r"(\S+\:)?s3://", r"(\S+\:)?petrel://"), ("modelzoo://", "torchvision://"),
                   ("open-mmlab://", "openmmlab://"), ("mmcls://",), ("pavi://",), ("http://", "https://"), ("",))
#: the module name of mmcv's compiled ops (:mod:`pid_plugins.mmseg.compat` stands in for it where it is absent)
MMCV_EXT_NAME = "mmcv._ext"


#: a path each scheme of :data:`SCHEME_PREFIXES` answers to
_SCHEME_SAMPLES = {r"(\S+\:)?s3://": "s3://bucket/model.pth", r"(\S+\:)?petrel://": "cluster:petrel://b/model.pth",
                   "modelzoo://": "modelzoo://resnet50", "torchvision://": "torchvision://resnet50",
                   "open-mmlab://": "open-mmlab://resnet50_v1c", "openmmlab://": "openmmlab://resnet50_v1c",
                   "mmcls://": "mmcls://resnet50", "pavi://": "pavi://model.pth", "http://": "http://host/model.pth",
                   "https://": "https://host/model.pth", "": "work_dirs/model.pth"}


def _checkpoint_schemes() -> bool:
    """By behaviour: mmengine's table (prefix -> loader, a class attribute) holds, of mmengine's own loaders (and ours,
    which replace them during a run), exactly the schemes pid-plugins pairs with weights-only loaders (a scheme
    mmengine adds would load around them: refused; another library's schemes are its own), kept sorted as
    ``register_scheme`` sorts it, each path is loaded by the loader of its scheme (``_get_checkpoint_loader``), and
    ``register_scheme`` rebinds the table rather than editing it in place."""
    from mmengine.runner import checkpoint as mm_checkpoint

    loader = mm_checkpoint.CheckpointLoader
    schemes = vars(loader).get("_schemes")
    ours = {p for prefixes in SCHEME_PREFIXES for p in prefixes}
    if not (isinstance(schemes, dict) and set(_SCHEME_SAMPLES) == ours
            and parameters(loader.register_scheme)[:3] == ["prefixes", "loader", "force"]):
        return False
    owners = (mm_checkpoint.__name__, f"{__package__}.checkpoint")
    known = {p for p, fn in schemes.items() if getattr(fn, "__module__", None) in owners}
    if not (known == ours and list(schemes) == sorted(schemes, reverse=True)
            and all(loader._get_checkpoint_loader(path) is schemes[p] for p, path in _SCHEME_SAMPLES.items())):
        return False
    # register_scheme rebinds the table to a new sorted one (the weights-only scope restores mmengine's by rebinding
    # its saved copy): probed on a subclass holding a copy, which mmengine's own table never sees
    probe = type("Probe", (loader,), {"_schemes": dict(schemes)})
    before = probe._schemes
    probe.register_scheme("pid-plugins-probe://", loader=lambda *args, **kwargs: None)
    return (probe._schemes is not before
            and list(probe._schemes) == sorted(probe._schemes, reverse=True)
            and "pid-plugins-probe://" in probe._schemes and "pid-plugins-probe://" not in loader._schemes)


def _checkpoint_helpers() -> bool:
    from mmengine.runner import checkpoint as mm_checkpoint

    return (all(parameters(getattr(mm_checkpoint, name)) == [] for name in (
        "_get_mmengine_home", "get_torchvision_models", "get_external_models", "get_deprecated_model_names",
        "get_mmcls_models"))
        and parameters(mm_checkpoint._process_mmcls_checkpoint) == ["checkpoint"]
        and parameters(mm_checkpoint.get_file_backend)[:2] == ["uri", "backend_args"])


#: HistoryBuffer's statistic methods, which mmengine's training checkpoints pickle as getattr(HistoryBuffer, name)
STATISTICS = ("min", "max", "current", "mean")


def _history_buffer() -> bool:
    """By behaviour: a ``HistoryBuffer`` maps each statistic's name to the class's function of that name (what a
    training checkpoint pickles and the weights-only loader allows)."""
    from mmengine.logging.history_buffer import HistoryBuffer

    methods = HistoryBuffer()._statistics_methods
    return (set(STATISTICS) <= set(methods)
            and all(methods[name] is getattr(HistoryBuffer, name) for name in STATISTICS))


# ------------------------------------------------------------------------------------------------- the internals
MMCV_EXT = Internal(
    MMCV, "mmcv.utils.ext_loader.load_ext imports mmcv._ext and only checks that each op name is there",
    "importing mmseg.models with mmcv-lite: a stand-in mmcv._ext whose ops exist and raise when called", "2.1.0",
    _mmcv_ext)
MMSEG_VIT = Internal(
    MMSEG, "mmseg VisionTransformer.forward (what it computes: the backbone probe), _pos_embeding, resize_pos_embed "
    "and the Pretrained branch of init_weights",
    "PIDVisionTransformer computes mmseg's ViT forward again with the method's state threaded through the layers, and "
    "loads its init_cfg checkpoint as mmseg does (position-embedding resizing)", "1.2.2", _mmseg_vit)
ENCODER_LAYER = Internal(
    MMSEG, "mmseg TransformerEncoderLayer: what its forward computes (the layer probe), norm1 / norm2",
    "PIDTransformerEncoderLayer computes mmseg's encoder layer again with the method in its attention", "1.2.2",
    _encoder_layer)
MMCV_ATTENTION = Internal(
    MMCV, "mmcv.cnn.bricks.transformer.MultiheadAttention: forward(query, key, value, ...) and what it computes (the "
    "layer probe)",
    "the method layer's q/k/v from the packed in_proj_weight, and mmcv's own attention as the warm-up's stock path",
    "2.1.0", _mmcv_attention)
SEGMENTER_HEAD = Internal(
    MMSEG, "mmseg SegmenterMaskTransformerHead.forward (what it computes: the head probe) and its "
    "TransformerEncoderLayer layers",
    "PIDSegmenterMaskTransformerHead computes mmseg's head again with the method's state threaded through the layers",
    "1.2.2", _segmenter_head)
CHECKPOINT_SCHEMES = Internal(
    MMENGINE, "mmengine CheckpointLoader._schemes (a class attribute register_scheme rebinds) and the schemes "
    "mmengine.runner.checkpoint registers",
    "loading every mmengine checkpoint scheme weights-only inside WeightsOnlyCheckpointHook's run, and restoring "
    "mmengine's table exactly afterwards", "0.10.7", _checkpoint_schemes)
CHECKPOINT_HELPERS = Internal(
    MMENGINE, "mmengine.runner.checkpoint._get_mmengine_home, _process_mmcls_checkpoint, get_*_models, "
    "get_file_backend",
    "the weights-only loaders of the open-mmlab://, mmcls://, torchvision:// and s3:// schemes (mmengine's lookups)",
    "0.10.7", _checkpoint_helpers)
HISTORY_BUFFER = Internal(
    MMENGINE, "mmengine HistoryBuffer's statistic methods (min, max, current, mean; _set_default_statistics)",
    "allow-listing exactly what mmengine's training checkpoints pickle by reference (getattr(HistoryBuffer, name))",
    "0.10.7", _history_buffer)

INTERNALS = (MMCV_EXT, MMSEG_VIT, ENCODER_LAYER, MMCV_ATTENTION, SEGMENTER_HEAD, CHECKPOINT_SCHEMES,
             CHECKPOINT_HELPERS, HISTORY_BUFFER)

#: what the method layers rely on
#: in the order the parts build on each other (a probe failure names the lowest part whose probe fails)
LAYERS = (MMCV_ATTENTION, ENCODER_LAYER)
#: what a method backbone / head relies on (built from a config, or converted)
BACKBONE = (*LAYERS, MMSEG_VIT)
HEAD = (*LAYERS, SEGMENTER_HEAD)
#: what the weights-only checkpoint loading relies on
CHECKPOINTS = (CHECKPOINT_SCHEMES, CHECKPOINT_HELPERS, HISTORY_BUFFER)


def require_all() -> None:
    """Check every internal now (the mmcv._ext one only where the stand-in is in use)."""
    ext = sys.modules.get(MMCV_EXT_NAME)
    standin = ext is not None and getattr(getattr(ext, "__spec__", None), "loader", 0) is None  # compat's: no loader
    require(*(i for i in INTERNALS if i is not MMCV_EXT or standin))
