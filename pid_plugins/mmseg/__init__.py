"""mmsegmentation adapter (``custom_imports``): ``PIDVisionTransformer`` and ``PIDSegmenterMaskTransformerHead``
with an attention method, and :func:`convert`. Under mmcv-lite the import adds a stand-in ``mmcv._ext``."""
from importlib import resources as _resources

from .._entry import finding_main
from .compat import install_mmcv_ext_standin  # (imports no zoo)

#: the folder of the shipped Segmenter configs (``python -m pid_plugins.mmseg`` prints it), for a config's ``_base_``
CONFIGS = str(_resources.files("pid_plugins.mmseg.configs"))

if not finding_main(__name__):  # the whole adapter, unless `python -m pid_plugins.mmseg` only asks for CONFIGS
    install_mmcv_ext_standin()  # must run before mmseg.models (and so mmcv.ops) is imported

    try:
        import mmseg  # noqa: F401
        import mmseg.models  # noqa: F401
    except ImportError as exc:  # pragma: no cover - exercised only without the mm stack
        raise ImportError("pid_plugins.mmseg needs mmsegmentation: pip install -c constraints.txt "
                          f"'pid-plugins[mmseg]' ({exc})") from exc

    from ..versions import check_version

    for _dist in ("mmsegmentation", "mmengine", "mmcv-lite"):
        check_version(_dist)

    from . import checkpoint
    from .head import PIDSegmenterMaskTransformerHead
    from .vit import PIDTransformerEncoderLayer, PIDVisionTransformer, timm_vit_to_mmseg
    from .checkpoint import WeightsOnlyCheckpointHook
    from .conversion import convert
    from ..catalogue import load_installed_methods

    load_installed_methods()  # the methods of installed packages (entry-point group pid_plugins.methods)

__all__ = ["PIDVisionTransformer", "PIDTransformerEncoderLayer", "PIDSegmenterMaskTransformerHead",
           "WeightsOnlyCheckpointHook", "timm_vit_to_mmseg", "install_mmcv_ext_standin", "convert", "CONFIGS"]
