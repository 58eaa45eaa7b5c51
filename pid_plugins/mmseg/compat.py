"""A stand-in ``mmcv._ext`` under ``mmcv-lite`` whose ops raise a ``RuntimeError`` naming the op when called."""
from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
import types

from .internals import MMCV_EXT_NAME

__all__ = ["install_mmcv_ext_standin", "STANDIN_NAME"]

STANDIN_NAME = MMCV_EXT_NAME


class _MissingOps(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)

        def missing(*args, **kwargs):
            raise RuntimeError(f"mmcv op '{name}' needs the compiled mmcv (mmcv._ext), but only mmcv-lite is "
                               "installed; models built from pid-plugins' Segmenter configs never call it. Install "
                               "full mmcv (built from source) for models that do.")

        missing.__name__ = name
        return missing


def install_mmcv_ext_standin() -> bool:
    """Register the stand-in unless a real ``mmcv._ext`` exists. Returns True if the stand-in is active."""
    if STANDIN_NAME in sys.modules:
        return isinstance(sys.modules[STANDIN_NAME], _MissingOps)
    try:
        real = importlib.util.find_spec(STANDIN_NAME)
    except ModuleNotFoundError:  # mmcv itself is missing: the adapter's import reports it
        return False
    if real is not None:
        return False
    module = _MissingOps(STANDIN_NAME, "stand-in for mmcv's compiled ops (pid_plugins.mmseg.compat)")
    module.__spec__ = importlib.machinery.ModuleSpec(STANDIN_NAME, loader=None)
    sys.modules[STANDIN_NAME] = module
    return True
