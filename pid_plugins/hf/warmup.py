"""The gain warm-up of a transformers model: one counter per model (``attention_warmup``, a
:class:`~pid_plugins.core.GainWarmup` submodule of the outermost model, so its ``t`` is saved and loaded with the
weights), made when ``config.<method>`` asks for ``warmup_steps > 0``.

* :func:`attach_warmup` gives a model the counter its config asks for (keeping an existing one's ``t``), or removes it;
* :func:`counter_of` is the counter a model's layers read: its own, or the outermost model's (nested models, e.g.
  T5's stacks or a base model inside a ``*ForCausalLM``, are given it by discovery);
* :func:`warmup_scale` is this forward's scale ``min(1, t / N)`` (read once per forward by the pre-hook; the
  post-hook advances ``t`` after a training forward, so checkpointed layers recompute with the same scale).
"""
from __future__ import annotations

from typing import Any, Optional

from torch import Tensor, nn
from transformers import PreTrainedModel

from ..core import GainWarmup, make_warmup
from .config import method_of, model_method_config

__all__ = ["WARMUP_ATTR", "attach_warmup", "counter_of", "give_counter", "warmup_scale"]

WARMUP_ATTR = "attention_warmup"  # the outermost model's gain warm-up counter (a submodule: `attention_warmup.step`)
WARMUP_SOURCE = "_pid_plugins_warmup"  # on nested models: the outermost model's counter (not a submodule)
#: the counter's state-dict key for transformers' ``_keys_to_ignore_on_load_missing`` (a regex)
WARMUP_MISSING_KEY = rf"(^|\.){WARMUP_ATTR}\.step$"
#: whether a warm-up counter was ever made (else module registrations need no scan for counters to adopt)
ANY_COUNTER = [False]


def counter_of(model: nn.Module) -> Optional[GainWarmup]:
    """The warm-up counter a model's layers read: its own, or the outermost model's (set at discovery)."""
    counter = model._modules.get(WARMUP_ATTR)
    return counter if counter is not None else model.__dict__.get(WARMUP_SOURCE)


def warmup_scale(module: nn.Module, gains: Any) -> Optional[Tensor]:
    """This forward's warm-up scale for ``module``'s layers (``gains``: its method's parameters), None without
    warm-up (the fixed-parameter path); refused if the parameters ask for warm-up and the model has no counter."""
    steps = getattr(gains, "warmup_steps", 0)
    if not steps:
        return None
    counter = counter_of(module)
    if counter is None:
        method = method_of(getattr(module, "config", None))
        name = method.name if method is not None else "<method>"
        raise ValueError(
            f"the model's attention parameters set warmup_steps={steps} but {type(module).__name__} has no warm-up counter "
            f"(it was built before config.{name} asked for warm-up): call pid_plugins.hf.convert(model, {name!r}) once "
            "to add it"
        )
    if counter.warmup_steps != steps:  # config.pid changed after the model was built
        counter.warmup_steps = steps
    return counter.scale()


def _warmup_steps(config: Any) -> int:
    method = method_of(config)
    if method is None or getattr(config, method.name, None) is None:
        return 0
    return getattr(model_method_config(config, method), "warmup_steps", 0)


def give_counter(model: PreTrainedModel, counter: GainWarmup) -> None:
    """Make ``counter`` ``model``'s ``attention_warmup``; a checkpoint without it loads without a missing-key report
    (the wrapped ``_initialize_weights`` of :mod:`pid_plugins.hf.install` starts it at 0)."""
    ignore = getattr(model, "_keys_to_ignore_on_load_missing", None)
    model._keys_to_ignore_on_load_missing = {*(ignore or ()), WARMUP_MISSING_KEY}
    setattr(model, WARMUP_ATTR, counter)


def attach_warmup(model: PreTrainedModel, config: Any = None) -> None:
    """Give ``model`` the counter its method's parameters ask for (``config``, else read from ``model.config``),
    keeping an existing counter's t, or remove it."""
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

