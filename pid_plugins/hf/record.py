"""The method record in a transformers model's weights (:mod:`pid_plugins.core.record`): a buffer of the outermost
model's first module with a parameter of its own (docs/checkpoints.md), rewritten at every ``state_dict()``."""
from __future__ import annotations

from collections import Counter
from typing import Any, List, Optional

import torch
from torch import Tensor, nn
from transformers import PreTrainedModel

from ..core.record import RECORD, encode_record
from .config import method_of, model_method_config

__all__ = ["MISSING_KEY", "SIZE", "record_key", "refresh", "sync_record"]

SIZE = 1024  # the record's length: the JSON padded with spaces to a multiple of this
#: the record's key for transformers' ``_keys_to_ignore_on_load_missing`` and ``..._unexpected`` (a regex)
MISSING_KEY = rf"(^|\.){RECORD}$"
_MADE = [False]  # whether a record was ever made (else a stock model's construction scans nothing)
_HELD_ABOVE = "_pid_plugins_record_held_above"
_OWNER = "_pid_plugins_record_owner"  # on the model holding it: the path of the module whose buffer it is


def _encode(config: Any) -> Tensor:
    """The record of the method ``config`` runs, padded with spaces to a multiple of :data:`SIZE`."""
    method = method_of(config)
    value = encode_record(method.name, model_method_config(config, method))
    pad = -value.numel() % SIZE
    return torch.cat([value, torch.full((pad,), ord(" "), dtype=torch.uint8, device="cpu")]) if pad else value


def _owner_path(model: nn.Module) -> str:
    """The first submodule with a parameter of its own and one name, else "" (every device map places it)."""
    uses = Counter(id(m) for _, m in model.named_modules(remove_duplicate=False))
    for path, module in model.named_modules():
        if path and uses[id(module)] == 1 and any(p is not None for p in module._parameters.values()):
            return path
    return ""


def _owner(model: nn.Module) -> nn.Module:
    return model.get_submodule(model.__dict__[_OWNER])


def _held(model: nn.Module) -> nn.Module:
    """The record's module, its buffer saved; given one if it has none (replaced by ``resize_token_embeddings``)."""
    owner = _owner(model)
    if RECORD not in owner._buffers:
        like = next(owner.parameters(), None)
        value = _encode(model.config)
        owner.register_buffer(RECORD, value if like is None else value.to(like.device))
    owner._non_persistent_buffers_set.discard(RECORD)
    return owner


def record_key(model: nn.Module) -> Optional[str]:
    """The state-dict key of the record ``model`` holds (``model.embed_tokens.pid_plugins_method``), else None."""
    path = model.__dict__.get(_OWNER)
    return None if path is None else f"{path}.{RECORD}" if path else RECORD


def _write(owner: nn.Module, config: Any) -> None:
    """Write the record of the method ``config`` runs into ``owner``'s buffer (a meta buffer stays meta)."""
    old, value = owner._buffers[RECORD], _encode(config)
    if old.shape != value.shape:
        owner._buffers[RECORD] = value.to(old.device)
    elif old.device.type != "meta" and not torch.equal(old.cpu(), value):
        with torch.no_grad():
            old.copy_(value)


def _before_state_dict(model: nn.Module, prefix: str = "", keep_vars: bool = False) -> None:
    """``state_dict`` pre-hook: the record of the method the config runs now; none while it runs no method."""
    if method_of(model.config) is None:
        owner = _owner(model)
        if RECORD in owner._buffers:
            owner._non_persistent_buffers_set.add(RECORD)
        return
    _write(_held(model), model.config)


def _keep_own(model: nn.Module, state_dict: dict, prefix: str, *args: Any) -> None:
    """``load_state_dict`` pre-hook: the model keeps its own record (one where older releases saved it is dropped)."""
    key = record_key(model)
    if key != RECORD:
        state_dict.pop(prefix + RECORD, None)
    if method_of(model.config) is not None:
        state_dict[prefix + key] = _held(model)._buffers[RECORD]


def refresh(model: nn.Module, module: nn.Module) -> None:
    """Give ``module``'s record, if it holds one, the bytes of ``model``'s method."""
    if RECORD in module._buffers and method_of(getattr(model, "config", None)) is not None:
        _write(module, model.config)


def _ignore(model: nn.Module, add: bool) -> None:
    """Add (or remove) :data:`MISSING_KEY` to the keys transformers' loader does not report missing or unexpected."""
    for attribute in ("_keys_to_ignore_on_load_missing", "_keys_to_ignore_on_load_unexpected"):
        if add:
            setattr(model, attribute, {*(getattr(model, attribute, None) or ()), MISSING_KEY})
        else:
            own = model.__dict__.get(attribute)
            if isinstance(own, set):
                own.discard(MISSING_KEY)


def _attach(model: nn.Module) -> None:
    if _OWNER not in model.__dict__:
        model.__dict__[_OWNER] = _owner_path(model)
        model.register_state_dict_pre_hook(_before_state_dict)
        model.register_load_state_dict_pre_hook(_keep_own)
        _ignore(model, True)
        _MADE[0] = True
    _write(_held(model), model.config)


def _detach(model: nn.Module, keep: Optional[nn.Module] = None) -> None:
    """Take ``model``'s record (its buffer, unless on ``keep``, the owner now), hooks and ignored keys."""
    owner = _owner(model)
    if owner is not keep:
        owner._buffers.pop(RECORD, None)
        owner._non_persistent_buffers_set.discard(RECORD)
    del model.__dict__[_OWNER]
    for hooks, hook in ((model._state_dict_pre_hooks, _before_state_dict),
                        (model._load_state_dict_pre_hooks, _keep_own)):
        for handle_id, held in list(hooks.items()):
            if held is hook or getattr(held, "hook", None) is hook:
                del hooks[handle_id]
    _ignore(model, False)


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
    keep = _owner(model) if runs else None
    for m in [model, *nested]:
        if _OWNER in m.__dict__ and ((m is not model) if runs else method_of(m.config) is None):
            _detach(m, keep)
