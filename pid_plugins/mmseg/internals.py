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

import ast
import inspect
import re
import sys
from typing import Any, Callable, Dict

from ..versions import Internal, parameters, require, squashed

__all__ = ["INTERNALS", "require_all"]

MMSEG, MMENGINE, MMCV = "mmsegmentation", "mmengine", "mmcv-lite"


# ------------------------------------------------------------------------------------------------------ checks
def _mmcv_ext() -> bool:
    from mmcv.utils import ext_loader  # mmcv.utils imports no op: the stand-in is not needed yet

    source = squashed(ext_loader.load_ext)
    return (parameters(ext_loader.load_ext) == ["name", "funcs"]
            and "importlib.import_module('mmcv.'+name)" in source and "hasattr(ext,fun)" in source)


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


def registered_prefixes(module: Any) -> set:
    """The prefixes ``module``'s source registers with ``@CheckpointLoader.register_scheme(prefixes=...)``."""
    found = set()
    for node in ast.walk(ast.parse(inspect.getsource(module))):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "register_scheme"
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "CheckpointLoader"):
            for keyword in node.keywords:
                if keyword.arg == "prefixes":
                    value = ast.literal_eval(keyword.value)
                    found.update([value] if isinstance(value, str) else value)
    return found


#: mmengine's checkpoint schemes (the prefixes ``mmengine.runner.checkpoint`` registers, grouped by loader, in the
#: order :mod:`pid_plugins.mmseg.checkpoint` pairs them with its weights-only loaders)
SCHEME_PREFIXES = ((r"(\S+\:)?s3://", r"(\S+\:)?petrel://"), ("modelzoo://", "torchvision://"),
                   ("open-mmlab://", "openmmlab://"), ("mmcls://",), ("pavi://",), ("http://", "https://"), ("",))
#: the module name of mmcv's compiled ops (:mod:`pid_plugins.mmseg.compat` stands in for it where it is absent)
MMCV_EXT_NAME = "mmcv._ext"


def _checkpoint_schemes() -> bool:
    from mmengine.runner import checkpoint as mm_checkpoint

    loader = mm_checkpoint.CheckpointLoader
    ours = {p for prefixes in SCHEME_PREFIXES for p in prefixes}
    return (isinstance(vars(loader).get("_schemes"), dict)
            and parameters(loader.register_scheme)[:3] == ["prefixes", "loader", "force"]
            and "cls._schemes=OrderedDict(sorted(cls._schemes.items()" in squashed(loader._register_scheme)
            and "forpincls._schemes:" in squashed(loader._get_checkpoint_loader)
            and registered_prefixes(mm_checkpoint) == ours)


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
    from mmengine.logging.history_buffer import HistoryBuffer

    source = squashed(HistoryBuffer._set_default_statistics)
    found = set(re.findall(r"self\._statistics_methods\.setdefault\('(\w+)',HistoryBuffer\.(\w+)\)", source))
    return (found == {(name, name) for name in STATISTICS}
            and all(callable(getattr(HistoryBuffer, name)) for name in STATISTICS))


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
