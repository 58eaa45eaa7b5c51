"""timm adapter: PID DeiT/ViT and FAN (any registered method) in timm's registry (``registry/timm.toml``) and
:func:`convert`."""
try:
    import timm  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised only without timm
    raise ImportError("pid_plugins.timm needs timm: pip install -c constraints.txt 'pid-plugins[timm]'") from exc

from ..versions import check_version

check_version("timm")

from .conversion import convert
from .fan import FAN, ChannelProcessing, FANBlock, TokenMixing
from .vision_transformer import (
    MethodBlocks, PIDAttention, PIDBlock, PIDVisionTransformer, PIDVisionTransformerDistilled, checkpoint_filter_fn,
)
from . import probes  # noqa: E402,F401  (registers the doctor's probes of what the method classes compute again)

__all__ = [
    "FAN", "FANBlock", "TokenMixing", "ChannelProcessing",
    "MethodBlocks", "PIDAttention", "PIDBlock", "PIDVisionTransformer", "PIDVisionTransformerDistilled",
    "checkpoint_filter_fn", "convert",
]
