"""The gain warm-up of a transformers model: one :class:`~pid_plugins.core.GainWarmup` counter, the outermost model's
``attention_warmup`` (saved with the weights), when ``config.<method>`` asks for ``warmup_steps > 0``.
"""
from __future__ import annotations

from typing import Any, Optional

from torch import nn
from transformers import PreTrainedModel

from ..core import GainWarmup, make_warmup
from .config import WARMUP_ATTR, WARMUP_SOURCE, method_of, model_method_config

__all__ = ["WARMUP_ATTR", "attach_warmup", "counter_of", "give_counter"]

WARMUP_MISSING_KEY = rf"(^|\.){WARMUP_ATTR}\.step$"  # for transformers' _keys_to_ignore_on_load_missing
ANY_COUNTER = [False]  # whether a counter was ever made (else a model's construction scans for none to adopt)


def counter_of(model: nn.Module) -> Optional[GainWarmup]:
    """The warm-up counter a model's layers read: its own, or the outermost model's (set at discovery)."""
    counter = model._modules.get(WARMUP_ATTR)
    return counter if counter is not None else model.__dict__.get(WARMUP_SOURCE)


def give_counter(model: PreTrainedModel, counter: GainWarmup) -> None:
    """Make ``counter`` ``model``'s ``attention_warmup``."""
    ignore = getattr(model, "_keys_to_ignore_on_load_missing", None)
    model._keys_to_ignore_on_load_missing = {*(ignore or ()), WARMUP_MISSING_KEY}
    setattr(model, WARMUP_ATTR, counter)


def attach_warmup(model: PreTrainedModel, config: Any = None) -> None:
    """Give ``model`` the counter its method's parameters ask for (keeping an existing ``t``), or remove it."""
    current = model._modules.get(WARMUP_ATTR)
    if config is None:
        method = method_of(model.config)
        if method is not None and getattr(model.config, method.name, None) is not None:
            config = model_method_config(model.config, method)
    steps = getattr(config, "warmup_steps", 0)
    if not steps and current is None:
        return
    counter = make_warmup(steps, current, like=next(model.parameters(), None))
    if counter is None:
        del model._modules[WARMUP_ATTR]
        return
    ANY_COUNTER[0] = True
    if counter is not current:
        counter.train(model.training)  # a counter made in training mode would count the forwards of an eval model
        give_counter(model, counter)

