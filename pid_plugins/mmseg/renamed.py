"""What the rename of ``pid_gains`` (each layer's learnable method parameters, now ``attention_params``) means for an
mmseg config: mmengine's optimizer matches ``optim_wrapper.paramwise_cfg.custom_keys`` as substrings of parameter
names, so a config of its own that still says ``custom_keys={'pid_gains': dict(decay_mult=0.0)}`` matches nothing and
the parameters would decay, silently. :func:`check_custom_keys` refuses that, naming the fix;
:class:`~pid_plugins.mmseg.WeightsOnlyCheckpointHook` (in the shipped configs' ``custom_hooks``) calls it when a run
starts."""
from __future__ import annotations

from typing import Any, Mapping

from torch import nn

from ..core.layer import RENAMED_ATTRIBUTES

__all__ = ["check_custom_keys"]

_OLD, _NEW = "pid_gains", RENAMED_ATTRIBUTES["pid_gains"]


def check_custom_keys(optim_wrapper_cfg: Any, model: nn.Module) -> None:
    """Raise ``ValueError`` when ``optim_wrapper_cfg.paramwise_cfg.custom_keys`` names ``pid_gains`` and no key of it
    matches the model's ``attention_params`` (their settings, e.g. ``decay_mult=0.0``, would reach no parameter)."""
    paramwise = (optim_wrapper_cfg or {}).get("paramwise_cfg") or {}
    custom: Mapping[str, Any] = paramwise.get("custom_keys") or {}
    old = [key for key in custom if _OLD in key]
    if not old:
        return
    params = [name for name, _ in model.named_parameters() if f".{_NEW}." in f".{name}"]
    if not params or any(key in name for key in custom for name in params):
        return
    raise ValueError(
        f"optim_wrapper.paramwise_cfg.custom_keys names {old[0]!r}, which matches no parameter: pid-plugins renamed "
        f"each layer's learnable method parameters from {_OLD!r} to {_NEW!r} (e.g. {params[0]}), so these settings "
        f"({custom[old[0]]}) would not reach them. Write custom_keys={{{old[0].replace(_OLD, _NEW)!r}: "
        f"{custom[old[0]]}}} instead"
    )
