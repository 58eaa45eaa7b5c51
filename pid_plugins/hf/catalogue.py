"""The registry's transformers entries as ready-to-build configs."""
from __future__ import annotations

from typing import Any

from transformers import AutoConfig, PretrainedConfig

from .. import catalogue

__all__ = ["get_config", "list_models"]


def list_models(pattern: str = "*") -> list[str]:
    """The method variant names ``get_config`` knows (``registry/hf.toml``)."""
    return catalogue.list_models(pattern, zoo="hf")


def get_config(name: str, pid: Any = None, **overrides: Any) -> PretrainedConfig:
    """A transformers config for registry variant ``name``; ``pid`` overrides its method's parameters."""
    entry = catalogue.get_model_entry(name)
    if entry.zoo != "hf":
        raise ValueError(f"{name!r} is a {entry.zoo} model; pid_plugins.hf.list_models() shows the transformers ones")
    params = entry.configure(pid)
    config = AutoConfig.for_model(entry.base, **{**entry.kwargs, **overrides}, attn_implementation=entry.method)
    setattr(config, entry.method, params.to_dict())
    config.attn_implementation = entry.method
    return config
