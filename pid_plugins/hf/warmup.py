"""The gain warm-up of a transformers model: one counter (``attention_warmup``, a :class:`~pid_plugins.core.GainWarmup`
submodule of the outermost model, saved with the weights) when ``config.<method>`` asks for ``warmup_steps > 0``.
:func:`attach_warmup` gives or removes it; :func:`counter_of` is the counter a model's layers read.
"""
from __future__ import annotations

from typing import Any, Optional

from torch import nn
from transformers import PreTrainedModel

from ..core import GainWarmup, make_warmup
from .config import WARMUP_ATTR, WARMUP_SOURCE, method_of, model_method_config

__all__ = ["WARMUP_ATTR", "attach_warmup", "counter_of", "give_counter"]

#: the counter's state-dict key for transformers' ``_keys_to_ignore_on_load_missing`` (a regex)
WARMUP_MISSING_KEY = rf"(^|\.){WARMUP_ATTR}\.step$"
#: whether a warm-up counter was ever made (else module registrations need no scan for counters to adopt)
ANY_COUNTER = [False]


def counter_of(model: nn.Module) -> Optional[GainWarmup]:
    """The warm-up counter a model's layers read: its own, or the outermost model's (set at discovery)."""
    counter = model._modules.get(WARMUP_ATTR)
    return counter if counter is not None else model.__dict__.get(WARMUP_SOURCE)


def _warmup_steps(config: Any) -> int:
    method = method_of(config)
    if method is None or getattr(config, method.name, None) is None:
        return 0
    return getattr(model_method_config(config, method), "warmup_steps", 0)


def give_counter(model: PreTrainedModel, counter: GainWarmup) -> None:
    """Make ``counter`` ``model``'s ``attention_warmup``."""
    ignore = getattr(model, "_keys_to_ignore_on_load_missing", None)
    model._keys_to_ignore_on_load_missing = {*(ignore or ()), WARMUP_MISSING_KEY}
    setattr(model, WARMUP_ATTR, counter)


def attach_warmup(model: PreTrainedModel, config: Any = None) -> None:
    """Give ``model`` the counter its method's parameters ask for (keeping an existing ``t``), or remove it."""
    current = model._modules.get(WARMUP_ATTR)
    steps = getattr(config, "warmup_steps", 0) if config is not None else _warmup_steps(model.config)
    if not steps and current is None:
        return
    param = next(model.parameters(), None)
    counter = make_warmup(steps, current, like=param)
    if counter is None:
        del model._modules[WARMUP_ATTR]
        return
    ANY_COUNTER[0] = True
    if counter is not current:
        counter.train(model.training)  # a counter made in training mode would count the forwards of an eval model
        give_counter(model, counter)

