"""Lets fairseq 0.12.2 and hydra-core 1.0.7 import on Python 3.11+ (loaded at start-up by a .pth file).

Python 3.11 refuses a dataclass field whose default is an unhashable object ("mutable default ... use
default_factory"); fairseq's and hydra's config dataclasses use instances of other (eq=True, so unhashable)
dataclasses as defaults (fairseq issue #5012, fixed after its last release). This gives exactly those
default objects' classes an identity ``__hash__`` while their owner class is being processed, so the
defaults stay shared as on Python 3.10. Only classes defined in ``fairseq``, ``fairseq_cli``, ``hydra``
and ``pid_plugins.fairseq`` are touched; on Python < 3.11 nothing is installed. Kept free of imports
beyond the standard library: every interpreter start in the environment runs it.
"""
from __future__ import annotations

import dataclasses
import sys

SCOPE = ("fairseq.", "fairseq_cli.", "hydra.", "pid_plugins.fairseq")


def _in_scope(module: str) -> bool:
    return module.startswith(SCOPE) or module in ("fairseq", "fairseq_cli", "hydra")


def install() -> bool:
    """Install the hook (idempotent). Returns True if it is active."""
    if sys.version_info < (3, 11):
        return False
    original = dataclasses._get_field
    if getattr(original, "_pid_plugins_compat", False):
        return True

    def _get_field(cls, a_name, a_type, *args, **kwargs):
        if _in_scope(getattr(cls, "__module__", "")):
            default = cls.__dict__.get(a_name, dataclasses.MISSING)
            if isinstance(default, dataclasses.Field):
                default = default.default
            default_cls = type(default)
            if (dataclasses.is_dataclass(default) and not isinstance(default, type)
                    and default_cls.__hash__ is None and _in_scope(default_cls.__module__)):
                default_cls.__hash__ = object.__hash__
        return original(cls, a_name, a_type, *args, **kwargs)

    _get_field._pid_plugins_compat = True
    dataclasses._get_field = _get_field
    return True


install()
