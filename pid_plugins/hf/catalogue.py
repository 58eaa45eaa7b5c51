"""The registry's transformers entries as ready-to-build configs."""
from __future__ import annotations

from typing import Any

from transformers import AutoConfig, PretrainedConfig

from .. import catalogue
from .config import ATTN_IMPLEMENTATION

__all__ = ["get_config", "list_models"]


def list_models(pattern: str = "*") -> list[str]:
    """The PID variant names ``get_config`` knows (``registry/hf.toml``)."""
    return catalogue.list_models(pattern, zoo="hf")


def get_config(name: str, pid: Any = None, **overrides: Any) -> PretrainedConfig:
    """A transformers config for registry variant ``name`` with PID attention; ``pid`` overrides the gains."""
    entry = catalogue.get_model_entry(name)
    if entry.zoo != "hf":
        raise ValueError(f"{name!r} is a {entry.zoo} model; pid_plugins.hf.list_models() shows the transformers ones")
    gains = entry.configure(pid)
    config = AutoConfig.for_model(entry.base, **{**entry.kwargs, **overrides}, attn_implementation=ATTN_IMPLEMENTATION)
    config.pid = gains.to_dict()
    config.attn_implementation = ATTN_IMPLEMENTATION
    return config
