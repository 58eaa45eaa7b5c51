"""The method record in a transformers model's weights: ``pid_plugins_method`` (:mod:`pid_plugins.core.record`) on the
outermost model that runs a method, written by ``save_pretrained`` beside the weights and rewritten from ``config``
at every ``state_dict()``; never read into the model.
"""
from __future__ import annotations

from typing import Any, List

import torch
from torch import Tensor, nn
from transformers import PreTrainedModel

from ..core.record import RECORD, encode_record
from .config import method_of, model_method_config

__all__ = ["MISSING_KEY", "SIZE", "refresh", "sync_record"]

#: the record's length: the JSON padded with spaces to a multiple of this
SIZE = 1024
#: the record's state-dict key for transformers' ``_keys_to_ignore_on_load_missing`` (a regex)
MISSING_KEY = rf"(^|\.){RECORD}$"
#: whether a record was ever made (else a stock model's construction scans nothing)
_MADE = [False]
#: on a transformers model nested in one that holds the record (a ``*ForCausalLM``'s base model): it holds none
_HELD_ABOVE = "_pid_plugins_record_held_above"


def _encode(config: Any) -> Tensor:
    """The record of the method ``config`` runs, padded with spaces (JSON whitespace) to a multiple of :data:`SIZE`."""
    method = method_of(config)
    value = encode_record(method.name, model_method_config(config, method))
    pad = -value.numel() % SIZE
    return torch.cat([value, torch.full((pad,), ord(" "), dtype=torch.uint8, device="cpu")]) if pad else value


def _write(model: nn.Module) -> None:
    """Write the record of the method ``model.config`` runs into its buffer (a meta buffer keeps its shape)."""
    old, value = model._buffers[RECORD], _encode(model.config)
    if old.device.type == "meta":
        if old.shape != value.shape:
            model._buffers[RECORD] = value.to("meta")
    elif old.shape != value.shape:
        model._buffers[RECORD] = value.to(old.device)
    elif not torch.equal(old.cpu(), value):
        with torch.no_grad():
            old.copy_(value)


def _before_state_dict(model: nn.Module, prefix: str = "", keep_vars: bool = False) -> None:
    """``state_dict`` pre-hook: the record of the method the config runs now; none while it runs no method."""
    if method_of(model.config) is None:
        model._non_persistent_buffers_set.add(RECORD)
        return
    model._non_persistent_buffers_set.discard(RECORD)
    _write(model)


def _keep_own(model: nn.Module, state_dict: dict, prefix: str, *args: Any) -> None:
    """``load_state_dict`` pre-hook: the model keeps its own record."""
    if RECORD not in model._non_persistent_buffers_set:
        state_dict[prefix + RECORD] = model._buffers[RECORD]


def refresh(module: nn.Module) -> None:
    """Give ``module``'s record the bytes of its method, if it holds one."""
    if RECORD in module._buffers and method_of(getattr(module, "config", None)) is not None:
        _write(module)


def _attach(model: nn.Module) -> None:
    if RECORD not in model._buffers:
        like = next(model.parameters(), None)
        value = _encode(model.config)
        model.register_buffer(RECORD, value if like is None else value.to(like.device))
        model.register_state_dict_pre_hook(_before_state_dict)
        model.register_load_state_dict_pre_hook(_keep_own)
        model._keys_to_ignore_on_load_missing = {*(model._keys_to_ignore_on_load_missing or ()), MISSING_KEY}
        _MADE[0] = True
    else:
        model._non_persistent_buffers_set.discard(RECORD)
        _write(model)


def _detach(model: nn.Module) -> None:
    model._buffers.pop(RECORD, None)
    model._non_persistent_buffers_set.discard(RECORD)
    for hooks, hook in ((model._state_dict_pre_hooks, _before_state_dict),
                        (model._load_state_dict_pre_hooks, _keep_own)):
        for handle_id, held in list(hooks.items()):
            if held is hook or getattr(held, "hook", None) is hook:
                del hooks[handle_id]
    ignore = model.__dict__.get("_keys_to_ignore_on_load_missing")
    if isinstance(ignore, set):
        ignore.discard(MISSING_KEY)


def sync_record(model: nn.Module) -> None:
    """Give ``model`` the record of the method its config runs; take those of its nested models."""
    runs = method_of(model.config) is not None
    if runs and model.__dict__.get(_HELD_ABOVE):
        return
    if runs:
        _attach(model)
    elif not _MADE[0]:
        return
    nested: List[nn.Module] = [m for m in model.modules() if m is not model and isinstance(m, PreTrainedModel)]
    for m in nested:
        if runs:
            m.__dict__[_HELD_ABOVE] = True
        else:
            m.__dict__.pop(_HELD_ABOVE, None)
    for m in [model, *nested]:
        if RECORD in m._buffers and ((m is not model) if runs else method_of(m.config) is None):
            _detach(m)
