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
from typing import Any

from ..versions import Internal, parameters, reads, require, squashed

__all__ = ["INTERNALS", "require_all"]

MMSEG, MMENGINE, MMCV = "mmsegmentation", "mmengine", "mmcv-lite"


# ------------------------------------------------------------------------------------------------------ checks
def _mmcv_ext() -> bool:
    from mmcv.utils import ext_loader  # mmcv.utils imports no op: the stand-in is not needed yet

    source = squashed(ext_loader.load_ext)
    return (parameters(ext_loader.load_ext) == ["name", "funcs"]
            and "importlib.import_module('mmcv.'+name)" in source and "hasattr(ext,fun)" in source)


#: what mmseg's ``VisionTransformer.forward`` reads: :class:`~pid_plugins.mmseg.PIDVisionTransformer` computes it again
VIT_READS = frozenset({"_pos_embeding", "cls_token", "final_norm", "layers", "norm1", "out_indices", "out_origin",
                       "output_cls_token", "patch_embed", "pos_embed", "pre_ln", "pre_norm", "with_cls_token"})


def _mmseg_vit() -> bool:
    from mmseg.models.backbones.vit import VisionTransformer

    resize = inspect.getattr_static(VisionTransformer, "resize_pos_embed")
    init = squashed(VisionTransformer.init_weights)
    return (parameters(VisionTransformer.forward) == ["self", "inputs"]
            and reads(VisionTransformer.forward) == VIT_READS
            and "x,hw_shape=self.patch_embed(inputs)" in squashed(VisionTransformer.forward)
            and parameters(VisionTransformer._pos_embeding) == ["self", "patched_img", "hw_shape", "pos_embed"]
            and isinstance(resize, staticmethod)
            and parameters(resize.__func__) == ["pos_embed", "input_shpae", "pos_shape", "mode"]
            and "self.resize_pos_embed(state_dict['pos_embed'],(h//self.patch_size,w//self.patch_size)," in init
            and "self.layers.append(TransformerEncoderLayer(" in squashed(VisionTransformer.__init__))


def _encoder_layer() -> bool:
    from mmseg.models.backbones.vit import TransformerEncoderLayer

    forward, init = squashed(TransformerEncoderLayer.forward), squashed(TransformerEncoderLayer.__init__)
    return (reads(TransformerEncoderLayer.forward) == {"attn", "ffn", "norm1", "norm2", "with_cp"}
            and "x=self.attn(self.norm1(x),identity=x)" in forward and "x=self.ffn(self.norm2(x),identity=x)" in forward
            and all(f"self.{n}_name,{n}=build_norm_layer(" in init for n in ("norm1", "norm2"))
            and "self.with_cp=with_cp" in init
            and "self.attn=MultiheadAttention(**attn_cfg)" in squashed(TransformerEncoderLayer.build_attn))


def _mmcv_attention() -> bool:
    from mmcv.cnn.bricks.transformer import MultiheadAttention

    forward = squashed(MultiheadAttention.forward)
    return (reads(MultiheadAttention.forward) == {"__class__", "attn", "batch_first", "dropout_layer", "proj_drop"}
            and "self.attn=nn.MultiheadAttention(" in squashed(MultiheadAttention.__init__)
            and forward.endswith("returnidentity+self.dropout_layer(self.proj_drop(out))"))


#: what mmseg's ``SegmenterMaskTransformerHead.forward`` reads: the method head computes it again
HEAD_READS = frozenset({"_transform_inputs", "classes_proj", "cls_emb", "dec_proj", "decoder_norm", "layers",
                        "mask_norm", "num_classes", "patch_proj"})


def _segmenter_head() -> bool:
    from mmseg.models.decode_heads import SegmenterMaskTransformerHead

    return (parameters(SegmenterMaskTransformerHead.forward) == ["self", "inputs"]
            and reads(SegmenterMaskTransformerHead.forward) == HEAD_READS
            and "self.layers.append(TransformerEncoderLayer(" in squashed(SegmenterMaskTransformerHead.__init__))


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
    MMSEG, "mmseg VisionTransformer.forward (the attributes it reads), _pos_embeding, resize_pos_embed and the "
    "Pretrained branch of init_weights",
    "PIDVisionTransformer computes mmseg's ViT forward again with the method's state threaded through the layers, and "
    "loads its init_cfg checkpoint as mmseg does (position-embedding resizing)", "1.2.2", _mmseg_vit)
ENCODER_LAYER = Internal(
    MMSEG, "mmseg TransformerEncoderLayer: forward (attn(norm1(x), identity=x), ffn(norm2(x), identity=x)), "
    "norm1_name / norm2_name / with_cp, attn built as mmcv's MultiheadAttention",
    "PIDTransformerEncoderLayer computes mmseg's encoder layer again with the method in its attention", "1.2.2",
    _encoder_layer)
MMCV_ATTENTION = Internal(
    MMCV, "mmcv.cnn.bricks.transformer.MultiheadAttention: attn (torch's), batch_first, proj_drop, dropout_layer and "
    "forward's identity + dropout_layer(proj_drop(out))",
    "the method layer's q/k/v from the packed in_proj_weight, and mmcv's own attention as the warm-up's stock path",
    "2.1.0", _mmcv_attention)
SEGMENTER_HEAD = Internal(
    MMSEG, "mmseg SegmenterMaskTransformerHead.forward (the attributes it reads) and its TransformerEncoderLayer "
    "layers",
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
LAYERS = (ENCODER_LAYER, MMCV_ATTENTION)
#: what a method backbone / head relies on (built from a config, or converted)
BACKBONE = (MMSEG_VIT, *LAYERS)
HEAD = (SEGMENTER_HEAD, *LAYERS)
#: what the weights-only checkpoint loading relies on
CHECKPOINTS = (CHECKPOINT_SCHEMES, CHECKPOINT_HELPERS, HISTORY_BUFFER)


def require_all() -> None:
    """Check every internal now (the mmcv._ext one only where the stand-in is in use)."""
    ext = sys.modules.get(MMCV_EXT_NAME)
    standin = ext is not None and getattr(getattr(ext, "__spec__", None), "loader", 0) is None  # compat's: no loader
    require(*(i for i in INTERNALS if i is not MMCV_EXT or standin))
