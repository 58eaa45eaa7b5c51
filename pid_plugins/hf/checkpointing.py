"""Activation checkpointing by torch's own wrappers, as a method's per-forward state meets it.

A method's state crosses layers outside the layers' explicit inputs (in the forward's keyword arguments, see
:class:`~pid_plugins.hf.attention.MethodForwardState`). Two ways of checkpointing break it:

* **reentrant** checkpointing runs a layer's first forward without autograd (an autograd ``Function``), so the state
  a layer hands on carries no gradient: gradients are silently wrong. transformers' own
  ``gradient_checkpointing_enable(use_reentrant=True)`` is refused in :func:`~pid_plugins.hf.discovery` as before;
  torch's ``checkpoint_wrapper(..., checkpoint_impl=CheckpointImpl.REENTRANT)`` (also through
  ``apply_activation_checkpointing``, and under FSDP2's ``fully_shard``) is refused before the forward, naming the
  wrapped module; ``torch.utils.checkpoint.checkpoint(..., use_reentrant=True)`` by hand is recognised in the first
  attention call it wraps (autograd off inside a forward that began with it on) and refused there, before any
  gradient.
* **a KV cache under recomputation**: torch's wrappers do not know about the cache (transformers' checkpointed layers
  drop it; torch's recompute each layer with it), so the recomputation in the backward appends the layer's keys to
  the cache a second time. Refused with one message telling the user to pass ``use_cache=False``: before the forward
  when a wrapper is found in a training forward, else at the recomputation (``torch.utils.checkpoint`` by hand, or a
  wrapper in eval mode).

Non-reentrant checkpointing (``checkpoint_wrapper``'s default ``CheckpointImpl.NO_REENTRANT``, torch's composable
``checkpoint(module)``) with ``use_cache=False`` is exact for every method: the recomputed layer reads the state the
first forward left, whose graph the non-reentrant checkpoint recomputes on demand.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import nn

from .internals import TORCH_CHECKPOINT

__all__ = ["cache_message", "reentrant_message", "require", "torch_checkpointing", "wrapper_message"]

_SUPPORTED = ("use non-reentrant checkpointing: checkpoint_wrapper(module) / apply_activation_checkpointing(model, "
              "check_fn=...) with their default checkpoint_impl=CheckpointImpl.NO_REENTRANT, "
              "torch.utils.checkpoint.checkpoint(..., use_reentrant=False), or "
              "model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': False})")


def torch_checkpointing(module: nn.Module) -> Optional[Tuple[str, bool]]:
    """``(what, reentrant)`` when torch's activation checkpointing wraps ``module``: ``what`` names the API
    (``checkpoint_wrapper`` or the composable ``checkpoint``), ``reentrant`` whether it is reentrant; else None.
    :func:`require` first (once per process)."""
    impl = getattr(module, "checkpoint_impl", None)
    if impl is not None and hasattr(module, "_checkpoint_wrapped_module"):
        return "checkpoint_wrapper", getattr(impl, "name", str(impl)) == "REENTRANT"
    if _REGISTRY[0] is not None and "checkpoint" in (_REGISTRY[0](module) or ()):
        return "checkpoint", False  # torch's composable checkpoint is non-reentrant only
    return None


_REGISTRY: list = [None]  # torch's composable-API registry reader, once torch.distributed is known to have it


def require() -> None:
    """Check the torch internals :func:`torch_checkpointing` reads (once per process; none without
    torch.distributed, whose wrappers then do not exist)."""
    if _REGISTRY[0] is None and torch.distributed.is_available():
        TORCH_CHECKPOINT.require()
        from torch.distributed._composable.contract import _get_registry

        _REGISTRY[0] = _get_registry


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
    """A KV cache under activation checkpointing's recomputation (``where``: the wrapped module found, or None at
    the recomputation itself)."""
    found = f" ({where})" if where else ""
    return (f"attention method {name!r}: activation checkpointing{found} recomputes each layer in the backward, and "
            "with a KV cache the recomputation appends the layer's keys and values to the cache a second time: pass "
            "use_cache=False to the forward (or set model.config.use_cache = False) when training with activation "
            "checkpointing")
