"""Weights-only loading of fairseq checkpoints (:class:`argparse.Namespace` allowed), installed into
``fairseq.checkpoint_utils`` by importing :mod:`pid_plugins.fairseq`."""
import argparse
import types
from typing import Any, List

import torch

from ..core.checkpoint import UnsafeCheckpointError, load_weights_only

__all__ = ["FAIRSEQ_SAFE_GLOBALS", "UnsafeCheckpointError", "safe_torch_load", "install"]

#: the classes (beyond tensors and containers) fairseq checkpoints may hold
FAIRSEQ_SAFE_GLOBALS: List[Any] = [argparse.Namespace]


def safe_torch_load(f: Any, map_location: Any = None, **kwargs: Any) -> Any:
    """``torch.load(f, weights_only=True)`` with :data:`FAIRSEQ_SAFE_GLOBALS` allowed, always."""
    return load_weights_only(f, map_location, allowed=FAIRSEQ_SAFE_GLOBALS,
                             allowed_text="tensors, containers and argparse.Namespace", **kwargs)


class _TorchWithSafeLoad(types.ModuleType):
    """``torch`` as ``fairseq.checkpoint_utils`` sees it: everything is torch's, except ``load``."""

    load = staticmethod(safe_torch_load)

    def __init__(self) -> None:
        super().__init__("torch", "torch, with load() = pid_plugins.fairseq.checkpoint.safe_torch_load")

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def install() -> None:
    """Make ``fairseq.checkpoint_utils`` load every checkpoint with :func:`safe_torch_load` (idempotent)."""
    from fairseq import checkpoint_utils

    if not isinstance(checkpoint_utils.torch, _TorchWithSafeLoad):
        checkpoint_utils.torch = _TorchWithSafeLoad()
