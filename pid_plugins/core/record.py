"""The method record a timm, mmseg or fairseq method model saves with its weights: one ``uint8`` buffer
``<owner>.pid_plugins_method`` holding the UTF-8 JSON ``{"format": 1, "method": ..., "config": {...}}``, checked
before a load (:func:`check_saved_record`). Why a tensor: docs/checkpoints.md."""
from __future__ import annotations

import json
import warnings
from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch
from torch import Tensor, nn

__all__ = ["RECORD", "RECORD_KEY", "MethodRecordWarning", "attach_record", "detach_record",
           "check_saved_record", "decode_record", "encode_record", "is_record_key", "saved_method"]

#: the buffer name of the record on its owner: the key (suffix) it is saved under
RECORD = "pid_plugins_method"
RECORD_KEY = RECORD
_FORMAT = 1


class MethodRecordWarning(UserWarning):
    """A checkpoint saved from one attention method (or parameters) is loaded into a model that runs another."""


def encode_record(method: str, config: Any) -> Tensor:
    """The record of ``method`` run with ``config`` as the uint8 tensor of its JSON."""
    params = config.to_dict() if hasattr(config, "to_dict") else dict(config or {})
    text = json.dumps({"format": _FORMAT, "method": method, "config": params}, sort_keys=True)
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.uint8, device="cpu")


def decode_record(value: Any, source: str = "checkpoint") -> Dict[str, Any]:
    """``{"method": name, "config": {...}}`` from a saved record (a ``ValueError`` naming ``source`` otherwise)."""
    try:
        if not isinstance(value, Tensor) or value.dtype != torch.uint8 or value.dim() != 1:
            raise ValueError(f"a {type(value).__name__} {getattr(value, 'dtype', '')}, not a 1-D uint8 tensor")
        data = json.loads(bytes(value.cpu().tolist()).decode("utf-8"))
        if not isinstance(data, dict) or not isinstance(data.get("method"), str) \
                or not isinstance(data.get("config"), dict):
            raise ValueError("no method name and parameter dict in it")
        if data.get("format") != _FORMAT:
            raise ValueError(f"record format {data.get('format')!r}; this pid-plugins reads format {_FORMAT}: "
                             "upgrade pid-plugins")
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"{source}: the method record {RECORD_KEY!r} cannot be read ({exc}); the checkpoint is "
                         "damaged or was not written by pid-plugins") from None
    return {"method": data["method"], "config": data["config"]}


def is_record_key(key: str) -> bool:
    """Whether a state_dict key is a method record (``pid_plugins_method``, at any prefix)."""
    return key == RECORD_KEY or key.endswith("." + RECORD_KEY)


def saved_method(state_dict: Mapping[str, Any], source: str = "checkpoint") -> Optional[Tuple[str, Dict[str, Any]]]:
    """The method (name, parameters) a checkpoint's state_dict records, or None without a record (softmax)."""
    found = [decode_record(v, f"{source} ({k})") for k, v in state_dict.items() if is_record_key(k)]
    return (found[0]["method"], found[0]["config"]) if found else None


def how_to_load(method: str, config: Mapping[str, Any]) -> str:
    """The zoo-by-zoo line that builds a model running ``method`` with ``config``."""
    return (f"build the model with attention={method!r}, attention_cfg={dict(config)!r} (timm: "
            f"timm.create_model(<pid name>, attention=..., attention_cfg=...); mmseg: the same keys on "
            f"PIDVisionTransformer / PIDSegmenterMaskTransformerHead; fairseq: --attention-method {method} "
            f"--attention-cfg '<json>'), after importing the pid_plugins adapter (or under `pid-plugins run -- "
            "<command>`)")


def _running(owner: nn.Module) -> Optional[Tuple[str, Any]]:
    for module in owner.modules():
        method = getattr(module, "attention_method", None)
        if method is not None and hasattr(method, "name"):
            return method.name, module.attention_config
    return None


def check_saved_record(owner: nn.Module, state_dict: Dict[str, Any], prefix: str, local_metadata: Any, strict: bool,
                       missing_keys: List[str], *args: Any) -> None:
    """``load_state_dict`` pre-hook of a record's owner: ``ValueError`` for an unreadable record or an unregistered
    method; one :class:`MethodRecordWarning` for another method or other parameters."""
    key = prefix + RECORD_KEY
    if key not in state_dict:  # a softmax checkpoint: the model keeps its own record, which is not missing
        if RECORD in owner._buffers:
            state_dict[key] = owner._buffers[RECORD]
        return
    saved = decode_record(state_dict[key], f"state_dict key {key!r}")
    from .methods import list_methods  # the registry (methods imports nothing of this module)

    if saved["method"] not in list_methods():
        raise ValueError(f"{key}: the checkpoint was saved from a model running attention method {saved['method']!r}, "
                         f"which is not registered in this process (registered: {list_methods()}). Import the module "
                         f"that calls pid_plugins.register_method({saved['method']!r}, ...) before loading; nothing "
                         "was loaded")
    _refresh(owner)
    own = decode_record(owner._buffers[RECORD], "this model") if RECORD in owner._buffers else None
    if own != saved:
        runs = f"runs {own['method']!r} with {own['config']}" if own else "runs the stock attention"
        warnings.warn(
            f"{key}: the checkpoint was saved from a model running attention {saved['method']!r} with "
            f"{saved['config']}; this model {runs}, and the weights now run that. To run the checkpoint as saved, "
            f"{how_to_load(saved['method'], saved['config'])}", MethodRecordWarning, stacklevel=3)
    if RECORD in owner._buffers:  # the model keeps its own record (never read into the model)
        state_dict[key] = owner._buffers[RECORD]


def _refresh(owner: nn.Module, prefix: str = "", keep_vars: bool = False) -> None:
    """``state_dict`` pre-hook of a record's owner: write the method the owner runs now into its record."""
    running, old = _running(owner), owner._buffers.get(RECORD)
    if old is None or running is None:
        return
    value = encode_record(*running)
    if old.device.type == "meta":
        if old.shape != value.shape:
            owner._buffers[RECORD] = value.to("meta")
    elif not torch.equal(old.cpu(), value):
        owner._buffers[RECORD] = value.to(old.device)


def attach_record(owner: nn.Module, choice: Any, like: Optional[Tensor] = None) -> None:
    """Give ``owner`` the record of ``choice`` (None: no record), on ``like``'s device."""
    if choice is None:
        detach_record(owner)
        return
    value = encode_record(choice.method.name, choice.config)
    if like is not None:
        value = value.to(like.device)
    owner.register_buffer(RECORD, value)
    if _refresh not in owner._state_dict_pre_hooks.values():
        owner.register_state_dict_pre_hook(_refresh)
    if not any(getattr(h, "hook", None) is check_saved_record for h in owner._load_state_dict_pre_hooks.values()):
        owner.register_load_state_dict_pre_hook(check_saved_record)


def detach_record(owner: nn.Module) -> None:
    """Remove ``owner``'s record and its hook (the stock model's state_dict again)."""
    owner._buffers.pop(RECORD, None)
    owner.__dict__.pop(RECORD, None)
    for handle_id, hook in list(owner._state_dict_pre_hooks.items()):
        if hook is _refresh:
            del owner._state_dict_pre_hooks[handle_id]
    for handle_id, wrapped in list(owner._load_state_dict_pre_hooks.items()):
        if getattr(wrapped, "hook", None) is check_saved_record:
            del owner._load_state_dict_pre_hooks[handle_id]
