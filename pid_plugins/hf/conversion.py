"""``convert(model, attention, attention_cfg)``: switch a built transformers model's attention, in place; and
:func:`finish` (``finish_warmup`` for transformers models)."""
from __future__ import annotations

import copy
from types import SimpleNamespace
from typing import Any, Iterator, Optional, TypeVar

from torch import nn
from transformers import PreTrainedModel, PretrainedConfig

from ..core import SOFTMAX, GainWarmup, MethodChoice, finished_config, list_methods, resolve_attention
from ..core.layer import warn_switch_of_trained_weights, warn_unfinished_warmup
from . import gains as learned_gains
from .record import sync_record
from .config import (
    ATTN_IMPLEMENTATION, BASE_ATTR, BASES, STOCK_ATTR, WARMUP_ATTR, attach_warmup, base_attention, check_learnable,
    is_persisted, method_named, method_of, model_method_config, pipeline_refusal,
)
from .discovery import check_model, discovered, rediscover, undiscover

__all__ = ["convert", "finish"]

ModelT = TypeVar("ModelT", bound=nn.Module)


def convert(model: ModelT, attention: str = ATTN_IMPLEMENTATION, attention_cfg: Any = None, *,
            base: Optional[str] = None) -> ModelT:
    """Switch a ``PreTrainedModel`` to ``attention`` with ``attention_cfg`` (over ``config.<method>``; saved
    there) on ``base`` (``sdpa``, ``eager`` or ``flex_attention``; None keeps the model's), in place; returns
    ``model``. ``"softmax"`` returns to the ``attn_implementation`` the model had before."""
    where = type(model).__name__
    if not isinstance(model, PreTrainedModel):
        hint = "; convert the model before torch.compile" if hasattr(model, "_orig_mod") else (
            "; convert the transformers model inside a wrapper (peft: before get_peft_model)")
        raise TypeError(f"convert: a transformers PreTrainedModel, got {where}{hint}")
    if base is not None and attention == SOFTMAX:
        raise ValueError(f"{where}: base={base!r} is the attention a method is added to; attention='softmax' takes "
                         "none: drop base=")
    method = method_named(attention)
    default = None
    if method is not None and getattr(model.config, method.name, None) is not None:
        default = model_method_config(model.config, method)  # a dict overrides the model's own parameters
    choice = resolve_attention(attention, attention_cfg, zoo="hf", default=default, where=where)
    if choice is None:
        _to_stock(model)
        return model
    check_learnable(choice.method, choice.config)
    resolved_base = _check_base(model, base)
    check_model(model, choice.method.name)
    refusal = pipeline_refusal(model.config, choice.method, choice.config)  # transformers' own PP
    if refusal is not None:
        raise ValueError(refusal)
    # a model switched without convert (set_attn_implementation) never ran the method its config names
    running = method_of(model.config) if discovered(model) else None
    current = None if running is None else SimpleNamespace(
        attention_method=running, attention_config=model_method_config(model.config, running))
    warn_switch_of_trained_weights(model, choice, where, current=current)
    _to_method(model, choice, resolved_base)
    return model


def _check_base(model: PreTrainedModel, base: Optional[str]) -> str:
    """The base attention the model will run its method on; refused before anything changes if it cannot run."""
    if base is not None and base not in BASES:
        raise ValueError(f"base attention {base!r} is not one of {BASES}")
    config = copy.copy(model.config)  # only read here: set by _to_method
    if base is not None:
        setattr(config, BASE_ATTR, base)
    resolved = base_attention(config)
    if resolved == "flex_attention" and not getattr(model, "_supports_flex_attn", False):
        raise ValueError(f"{type(model).__name__} does not support flex attention: use base 'sdpa' or 'eager'")
    return resolved


def _to_method(model: PreTrainedModel, choice: MethodChoice, base: str) -> None:
    config, name = model.config, choice.method.name
    if method_of(config) is None and isinstance(config._attn_implementation, str):
        setattr(config, STOCK_ATTR, config._attn_implementation)  # what attention="softmax" returns to
    for other in list_methods():  # the parameters of a method the model leaves
        if other != name:
            config.__dict__.pop(other, None)
    setattr(config, name, choice.config.to_dict())
    if not getattr(choice.config, "learnable", False):  # fixed parameters: learned ones would be left unused
        for m in model.modules():
            learned_gains.detach(m)
    attach_warmup(model, choice.config)
    setattr(config, BASE_ATTR, base)
    model.set_attn_implementation(name)
    rediscover(model)
    sync_record(model)


def _configs(model: nn.Module) -> Iterator[PretrainedConfig]:
    """Every config of every transformers model in ``model`` and their sub-configs, once each."""
    seen = set()
    stack = [m.config for m in model.modules() if isinstance(getattr(m, "config", None), PretrainedConfig)]
    while stack:
        config = stack.pop()
        if id(config) in seen:
            continue
        seen.add(id(config))
        yield config
        stack.extend(sub for key in getattr(config, "sub_configs", {})
                     if isinstance(sub := getattr(config, key, None), PretrainedConfig))


def _to_stock(model: PreTrainedModel) -> None:
    """Back to the stock implementation, with everything pid-plugins added removed."""
    config = model.config
    if method_of(config) is not None:
        stock = config.__dict__.get(STOCK_ATTR)
        model.set_attn_implementation(stock if isinstance(stock, str) and method_named(stock) is None else None)
    undiscover(model)
    for cfg in _configs(model):
        for attr in (*list_methods(), BASE_ATTR, STOCK_ATTR):
            cfg.__dict__.pop(attr, None)
        if is_persisted(cfg):
            del cfg.__dict__["attn_implementation"]
    sync_record(model)


def finish(model: nn.Module) -> bool:
    """:func:`pid_plugins.finish_warmup` for the transformers models in ``model``; True if one runs a method."""
    names = {name: m for name, m in model.named_modules() if isinstance(m, PreTrainedModel)}
    with_method = {name: m for name, m in names.items() if method_of(m.config) is not None}
    if not with_method:
        return False
    for name, m in with_method.items():
        counter = m._modules.pop(WARMUP_ATTR, None)
        if counter is not None:
            held = [c for c in counter.modules() if isinstance(c, GainWarmup)]  # peft: the trained copy is last
            if held:
                warn_unfinished_warmup(held[-1], name or type(m).__name__)
    for config in _configs(model):
        method = method_of(config)
        if method is not None and getattr(config, method.name, None) is not None:
            cfg = model_method_config(config, method)
            if getattr(cfg, "warmup_steps", 0):
                setattr(config, method.name, finished_config(cfg).to_dict())
    # rediscover from each outermost transformers model (it hands its config and counter to the nested ones)
    outermost = [m for name, m in with_method.items()
                 if not any(name.startswith(f"{other}.") or (other == "" and name) for other in names if other != name)]
    for m in outermost:
        rediscover(m)
    return True
