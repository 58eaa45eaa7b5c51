"""mmsegmentation adapter: ``PIDVisionTransformer``, a Segmenter/ViT backbone with PID attention.

List ``pid_plugins.mmseg`` in a config's ``custom_imports`` and set ``backbone=dict(type='PIDVisionTransformer',
...)``: it takes every argument of mmseg's ``VisionTransformer`` plus ``attention='pid'|'softmax'`` and the
gains (``pid=dict(...)`` and/or ``lambda_p``, ``lambda_i``, ``lambda_d``, ``beta``; preset ``segmenter``).
``decode_head=dict(type='PIDSegmenterMaskTransformerHead', attention='pid')`` puts PID in the decoder too.

Importing it also makes mmengine's checkpoint loading weights-only for every scheme, with mmengine's own
checkpoint classes allow-listed (:mod:`pid_plugins.mmseg.checkpoint`): ``init_cfg``, ``load_from``,
``resume`` and mmseg's tools never unpickle code, whatever ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` says.
"""
from .compat import install_mmcv_ext_standin

install_mmcv_ext_standin()  # must run before mmseg.models (and so mmcv.ops) is imported

try:
    import mmseg  # noqa: F401
    import mmseg.models  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised only without the mm stack
    raise ImportError(
        "pid_plugins.mmseg needs mmsegmentation: pip install -c constraints.txt 'pid-plugins[mmseg]' "
        f"({exc})"
    ) from exc

from . import checkpoint
from .head import PIDSegmenterMaskTransformerHead
from .vit import PIDTransformerEncoderLayer, PIDVisionTransformer, timm_vit_to_mmseg

checkpoint.install()

__all__ = ["PIDVisionTransformer", "PIDTransformerEncoderLayer", "PIDSegmenterMaskTransformerHead",
           "timm_vit_to_mmseg", "install_mmcv_ext_standin"]
