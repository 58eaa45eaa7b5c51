"""What every PID timm family shares: gains from kwargs, local-only pretrained sources, strict key checks,
and registration of the catalogue's entries with timm's ``register_model``."""
from __future__ import annotations

import os
from typing import Any, Callable, Dict, Iterable, Optional, Union

from torch import Tensor, nn
from timm.models import generate_default_cfgs, register_model
from timm.models._builder import resolve_pretrained_cfg

from ..catalogue import ModelEntry, load_catalogue
from ..core import PIDConfig

ATTENTION_CHOICES = ("pid", "softmax")


def resolve_pid(pid: Any = None, attention: str = "pid", default: Union[PIDConfig, str] = "deit") -> Optional[PIDConfig]:
    """The PID config a model is built with; ``None`` means stock softmax attention."""
    if attention not in ATTENTION_CHOICES:
        raise ValueError(f"attention must be one of {ATTENTION_CHOICES}, got {attention!r}")
    if attention == "softmax":
        return None
    return PIDConfig.coerce(pid, default=default)


def check_pretrained_source(name: str, base: str, kwargs: Dict[str, Any]) -> None:
    """Refuse ``pretrained=True`` unless a local file (or an in-memory state_dict) is given."""
    cfg = resolve_pretrained_cfg(
        name, pretrained_cfg=kwargs.get("pretrained_cfg"), pretrained_cfg_overlay=kwargs.get("pretrained_cfg_overlay"),
    )
    hint = (
        f"pid-plugins never downloads weights: point {name} at a local checkpoint with "
        "create_model(..., pretrained=True, pretrained_cfg_overlay=dict(file='/path/to/weights.pth')) "
        "(.pth, .pth.tar or .safetensors; timm train.py: --pretrained --pretrained-path PATH). A softmax "
        f"checkpoint of {base} loads as is"
    )
    if cfg.state_dict is not None:
        return
    if not cfg.file:
        raise FileNotFoundError(f"no pretrained weights file given for {name}. {hint}")
    if not os.path.isfile(cfg.file):
        raise FileNotFoundError(f"pretrained weights file not found: {cfg.file!r}. {hint}")


def unwrap_state_dict(state_dict: Dict[str, Any]) -> Dict[str, Tensor]:
    """The parameters of a checkpoint saved as ``{"model": ...}``, ``{"state_dict": ...}`` or bare."""
    for key in ("model", "state_dict"):
        if key in state_dict and isinstance(state_dict[key], dict):
            return state_dict[key]
    return state_dict


def finish_state_dict(out: Dict[str, Tensor], model: nn.Module, hint: str) -> Dict[str, Tensor]:
    """Fill learnable PID gains a softmax checkpoint lacks; raise listing missing/unexpected keys."""
    expected = model.state_dict()
    for name, value in expected.items():
        if ".pid_gains." in name and name not in out:
            out[name] = value.detach().clone()
    missing = sorted(set(expected) - set(out))
    unexpected = sorted(set(out) - set(expected))
    if missing or unexpected:
        raise ValueError(
            f"checkpoint does not fit {type(model).__name__}: missing keys {missing}; unexpected keys "
            f"{unexpected}. {hint}"
        )
    return out


def register_entries(
    module_name: str,
    entries: Iterable[ModelEntry],
    create: Callable[..., nn.Module],
    pretrained_cfg: Callable[[ModelEntry], Dict[str, Any]],
    with_base: bool = False,
) -> Dict[str, Any]:
    """Register each entry's PID name (and, with ``with_base``, its softmax base name) into timm.

    ``create(entry, name, default_attention, pretrained, **kwargs)`` builds the model (a user's
    ``attention=`` kwarg overrides ``default_attention``). Returns the module's
    ``default_cfgs`` (timm's ``register_model`` reads it from the module named ``module_name``).
    """
    import sys

    entries = list(entries)
    names = [(e, e.name, "pid") for e in entries] + ([(e, e.base, "softmax") for e in entries] if with_base else [])
    module = sys.modules[module_name]
    module.default_cfgs = generate_default_cfgs({name: pretrained_cfg(e) for e, name, _ in names})
    for entry, name, attention in names:
        register_model(_entrypoint(module_name, entry, name, attention, create))
    return module.default_cfgs


def _entrypoint(module_name: str, entry: ModelEntry, name: str, attention: str, create: Callable[..., nn.Module]):
    def model_fn(pretrained: bool = False, **kwargs: Any) -> nn.Module:
        return create(entry, name, attention, pretrained, **kwargs)

    model_fn.__name__ = model_fn.__qualname__ = name
    model_fn.__module__ = module_name
    kind = f"PID attention, preset `{entry.preset}`" if attention == "pid" else "softmax attention"
    model_fn.__doc__ = f"{entry.description} ({kind})."
    return model_fn


def catalogue_entries(arches: Iterable[str]) -> list[ModelEntry]:
    arches = set(arches)
    return [e for e in load_catalogue().values() if e.zoo == "timm" and e.arch in arches]
