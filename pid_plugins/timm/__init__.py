"""timm adapter: PID DeiT/ViT registered into timm's model registry.

``import pid_plugins.timm`` registers every timm variant declared in ``registry/timm.toml``::

    import timm, pid_plugins.timm
    model = timm.create_model("pid_deit_tiny_patch16_224")                       # preset `deit`
    model = timm.create_model("pid_deit_tiny_patch16_224", pid=dict(lambda_p=0.5))
    model = pid_plugins.timm.to_pid(stock_vit, PIDConfig.preset("deit"))       # convert, weights kept
"""
try:
    import timm  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised only without timm
    raise ImportError(
        "pid_plugins.timm needs timm: pip install -c constraints.txt 'pid-plugins[timm]'"
    ) from exc

from .fan import FAN, ChannelProcessing, FANBlock, TokenMixing
from .vision_transformer import (
    PIDAttention,
    PIDBlock,
    PIDVisionTransformer,
    PIDVisionTransformerDistilled,
    checkpoint_filter_fn,
    to_pid,
)

__all__ = [
    "FAN", "FANBlock", "TokenMixing", "ChannelProcessing",
    "PIDAttention", "PIDBlock", "PIDVisionTransformer", "PIDVisionTransformerDistilled",
    "checkpoint_filter_fn", "to_pid",
]
