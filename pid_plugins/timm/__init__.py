"""timm adapter: PID DeiT/ViT and FAN (and any registered attention method) in timm's model registry.

``import pid_plugins.timm`` registers every timm variant declared in ``registry/timm.toml``::

    import timm, pid_plugins.timm
    model = timm.create_model("pid_deit_tiny_patch16_224")                       # preset `deit`
    model = timm.create_model("pid_deit_tiny_patch16_224", attention_cfg=dict(lambda_p=0.5))
    model = timm.create_model("pid_deit_tiny_patch16_224", attention="<name>", attention_cfg={...})  # a method
    pid_plugins.timm.convert(stock_vit, "pid", {"lambda_p": 0.5})               # in place, the same tensors
    pid_plugins.timm.convert(stock_vit, "softmax")                               # timm's own classes again

``convert`` is the one way to switch a built model (ViT/DeiT, FAN); a stock ViT keeps its class, its ``blocks``
become a :class:`MethodBlocks` that threads the method's state and its ``forward_features`` /
``forward_intermediates`` the method classes' own, so it runs every path of the model built by name (see
:mod:`pid_plugins.timm.conversion`).

Import-time changes to third-party modules (all through timm's and torch.fx's own extension points):

* timm's model registry: ``register_model`` adds the ``pid_*`` names and the softmax ``fan_*`` names (with their
  ``default_cfgs``), so ``timm.create_model`` and timm's scripts find them.
* timm's fx leaf list: ``register_notrace_function`` of core's ``_fx_update`` (a method's update step, whose
  shape checks are Python control flow fx cannot trace) and ``_fx_check`` (a method's refusals, run with the
  concrete arguments when the traced graph runs), so timm's feature extraction records each as one call. Core marks
  the same two with ``torch.fx.wrap`` for plain torch.fx tracers (torchvision's feature extraction).
"""
try:
    import timm  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised only without timm
    raise ImportError(
        "pid_plugins.timm needs timm: pip install -c constraints.txt 'pid-plugins[timm]'"
    ) from exc

from ..versions import check_version

check_version("timm")

from .conversion import convert
from .fan import FAN, ChannelProcessing, FANBlock, TokenMixing
from .vision_transformer import (
    MethodBlocks,
    PIDAttention,
    PIDBlock,
    PIDVisionTransformer,
    PIDVisionTransformerDistilled,
    checkpoint_filter_fn,
)
from . import probes  # noqa: E402,F401  (the behavioural checks of the internals the method classes compute again)
from .internals import INTERNALS as _INTERNALS  # noqa: E402
from ..versions import settle as _settle  # noqa: E402

_settle(*_INTERNALS)  # every check now, outside any construction context (deepspeed.zero.Init builds under one)

__all__ = [
    "FAN", "FANBlock", "TokenMixing", "ChannelProcessing",
    "MethodBlocks", "PIDAttention", "PIDBlock", "PIDVisionTransformer", "PIDVisionTransformerDistilled",
    "checkpoint_filter_fn", "convert",
]
