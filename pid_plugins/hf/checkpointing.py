"""Activation checkpointing as a method's per-forward state meets it: reentrant checkpointing and a KV cache under
recomputation are refused; non-reentrant checkpointing with ``use_cache=False`` is exact.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import nn

from ..versions import InternalChanged
from .internals import TORCH_CHECKPOINT

__all__ = ["cache_message", "reentrant_message", "registry_key", "torch_checkpointing", "wrapper_message"]

_SUPPORTED = ("use non-reentrant checkpointing: checkpoint_wrapper(module) / apply_activation_checkpointing(model, "
              "check_fn=...) with their default checkpoint_impl=CheckpointImpl.NO_REENTRANT, "
              "torch.utils.checkpoint.checkpoint(..., use_reentrant=False), or "
              "model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': False})")


def torch_checkpointing(module: nn.Module) -> Optional[Tuple[str, bool]]:
    """``(what, reentrant)`` when torch's activation checkpointing wraps ``module``, else None."""
    impl = getattr(module, "checkpoint_impl", None)
    if impl is not None and hasattr(module, "_checkpoint_wrapped_module"):
        return "checkpoint_wrapper", getattr(impl, "name", str(impl)) == "REENTRANT"
    if _REGISTRY[0] is not None and "checkpoint" in (_REGISTRY[0](module) or ()):
        return "checkpoint", False  # torch's composable checkpoint is non-reentrant only
    return None


#: torch's composable-API registry reader and its key in a module's ``__dict__``, once known to hold
_REGISTRY: list = [None, ""]


def registry_key() -> str:
    """Where torch's composable ``checkpoint(module)`` marks a module, its internals checked once per process."""
    if _REGISTRY[0] is None and torch.distributed.is_available():
        TORCH_CHECKPOINT.require()
        from torch.distributed._composable import checkpoint
        from torch.distributed._composable.contract import REGISTRY_KEY, _get_registry

        marked = checkpoint(nn.Identity())  # the registry the plan reads is the one _get_registry reads
        if not isinstance(REGISTRY_KEY, str) or marked.__dict__.get(REGISTRY_KEY) is not _get_registry(marked):
            raise InternalChanged(TORCH_CHECKPOINT.message("the registry is not the module's __dict__[REGISTRY_KEY]"))
        _REGISTRY[:] = [_get_registry, REGISTRY_KEY]
    return _REGISTRY[1]


def wrapper_message(name: str, where: str) -> str:
    """Reentrant ``checkpoint_wrapper`` found at ``where`` (a module path)."""
    return (f"attention method {name!r} needs non-reentrant activation checkpointing, but {where} is wrapped by "
            "torch's checkpoint_wrapper with checkpoint_impl=CheckpointImpl.REENTRANT (apply_activation_checkpointing "
            "with checkpoint_wrapper_fn=partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.REENTRANT)): "
            "reentrant checkpointing runs the first forward without autograd, which cuts the gradient of the method's "
            f"state between layers. Instead {_SUPPORTED}")


def reentrant_message(name: str, module: nn.Module) -> str:
    """Autograd off inside a forward that began with it on: reentrant checkpointing by hand."""
    return (f"attention method {name!r}: {type(module).__name__} ran without autograd inside a forward that began with "
            "it: reentrant activation checkpointing (torch.utils.checkpoint.checkpoint(..., use_reentrant=True), also "
            "its default when use_reentrant is not given, or a reentrant wrapper) runs the "
            "first forward without autograd, which cuts the gradient of the method's state between layers (a "
            f"torch.no_grad() region inside the model's forward does the same). Instead {_SUPPORTED}")


def cache_message(name: str, where: Optional[str] = None) -> str:
    """A KV cache under activation checkpointing's recomputation (``where``: the wrapped module found, or None)."""
    found = f" ({where})" if where else ""
    return (f"attention method {name!r}: activation checkpointing{found} recomputes each layer in the backward, and "
            "with a KV cache the recomputation appends the layer's keys and values to the cache a second time: pass "
            "use_cache=False to the forward (or set model.config.use_cache = False) when training with activation "
            "checkpointing")
