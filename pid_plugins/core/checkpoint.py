"""Reading a checkpoint's weights, once for every adapter: which entry holds the state_dict, and the strict key check.

Reading the file itself stays with each zoo's own loader (timm's ``load_state_dict``, mmengine's
``CheckpointLoader``, fairseq's ``checkpoint_utils``), which the adapters make weights-only; this module decides
what is done with what they read.
"""
from __future__ import annotations

from typing import Any, Dict, Iterable, Mapping

from torch import Tensor

__all__ = ["STATE_DICT_KEYS", "unwrap_state_dict", "check_keys"]

#: the entries a training checkpoint keeps its weights under, in the order they are looked for (timm's
#: ``load_state_dict`` order: ``state_dict`` before ``model``; mmengine writes ``state_dict``, DeiT ``model``)
STATE_DICT_KEYS = ("state_dict", "model")


def unwrap_state_dict(checkpoint: Any, source: str = "checkpoint") -> Dict[str, Tensor]:
    """The parameters of a checkpoint saved bare or as ``{"state_dict": ...}`` / ``{"model": ...}`` (nested wrappers
    are unwrapped in turn). Raises a ``ValueError`` naming ``source`` if no mapping of names to tensors is found."""
    seen = 0
    while isinstance(checkpoint, Mapping) and seen < 4:
        inner = next((checkpoint[k] for k in STATE_DICT_KEYS if isinstance(checkpoint.get(k), Mapping)), None)
        if inner is None:
            break
        checkpoint, seen = inner, seen + 1
    if not isinstance(checkpoint, Mapping):
        raise ValueError(f"{source} holds a {type(checkpoint).__name__}, not a state_dict (a dict of tensors)")
    return dict(checkpoint)


def check_keys(expected: Iterable[str], given: Iterable[str], owner: str, hint: str = "",
               ignore: Iterable[str] = ()) -> None:
    """Raise one ``ValueError`` listing the missing and unexpected keys of a strict load (``ignore``: keys the
    caller drops on purpose, e.g. a classifier the zoo re-initialises)."""
    expected, given, ignore = set(expected), set(given), set(ignore)
    missing = sorted(expected - given - ignore)
    unexpected = sorted(given - expected - ignore)
    if missing or unexpected:
        raise ValueError(
            f"checkpoint does not fit {owner}: missing keys {missing}; unexpected keys {unexpected}."
            + (f" {hint}" if hint else "")
        )
