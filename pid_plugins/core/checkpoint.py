"""Reading a checkpoint, once for every adapter: the weights-only load and its refusal, which entry holds the
state_dict, and the strict key check."""
from __future__ import annotations

import contextlib
import pickle
from typing import Any, Dict, Iterable, Iterator, Mapping, Optional, Sequence

import torch
from torch import Tensor

__all__ = ["STATE_DICT_KEYS", "UnsafeCheckpointError", "weights_only", "load_weights_only", "refusal_reason",
           "unwrap_state_dict", "check_keys"]


class UnsafeCheckpointError(pickle.UnpicklingError):
    """A checkpoint holds objects outside plain weights and its zoo's allow-list: it is not loaded."""


def refusal_reason(exc: BaseException) -> str:
    """The line of torch's weights-only error that names what was refused (its first line otherwise)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    detail = [line for line in lines if "GLOBAL" in line or "Unsupported" in line or "unrecognized" in line
              or "getattr" in line]
    rest = [line for line in lines[1:] if not line.startswith(("Check the documentation", "Please file"))]
    return (detail or rest or lines or ["unreadable pickle"])[0]


@contextlib.contextmanager
def weights_only(name: Any, allowed: Sequence[Any] = (), allowed_text: str = "tensors and containers"
                 ) -> Iterator[None]:
    """Around a ``torch.load(..., weights_only=True)``: ``allowed`` globals for this load only, a refusal turned
    into one :class:`UnsafeCheckpointError` naming the file, what was refused and what to do."""
    with torch.serialization.safe_globals(list(allowed)):
        try:
            yield
        except pickle.UnpicklingError as exc:
            if isinstance(exc, UnsafeCheckpointError):
                raise
            raise UnsafeCheckpointError(f"refused to load checkpoint {str(name)!r}: it holds objects other than "
                                        f"{allowed_text} ({refusal_reason(exc)}). pid-plugins loads checkpoints with "
                                        "torch.load(weights_only=True) whatever TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD "
                                        "says, so no code in a checkpoint runs; save the weights as a plain "
                                        "state_dict of tensors instead") from None


def load_weights_only(source: Any, map_location: Any = None, *, name: Optional[Any] = None,
                      allowed: Sequence[Any] = (), allowed_text: str = "tensors and containers",
                      **kwargs: Any) -> Any:
    """``torch.load(source, weights_only=True)`` under :func:`weights_only` (always weights-only)."""
    kwargs.pop("weights_only", None)
    with weights_only(name if name is not None else getattr(source, "name", source), allowed, allowed_text):
        return torch.load(source, map_location=map_location, weights_only=True, **kwargs)

#: the entries a checkpoint keeps its weights under, in timm's order (mmengine: ``state_dict``, DeiT: ``model``)
STATE_DICT_KEYS = ("state_dict", "model")


def unwrap_state_dict(checkpoint: Any, source: str = "checkpoint") -> Dict[str, Tensor]:
    """The parameters of a checkpoint saved bare or wrapped in ``state_dict`` / ``model`` entries; a
    ``ValueError`` naming ``source`` if none is found."""
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
    """Raise one ``ValueError`` listing the missing and unexpected keys of a strict load (``ignore``: dropped on
    purpose)."""
    from .record import is_record_key  # a softmax checkpoint has no method record: never a missing key

    expected, given, ignore = set(expected), set(given), set(ignore)
    missing = sorted(k for k in expected - given - ignore if not is_record_key(k))
    unexpected = sorted(given - expected - ignore)
    if missing or unexpected:
        raise ValueError(f"checkpoint does not fit {owner}: missing keys {missing}; unexpected keys {unexpected}."
                         + (f" {hint}" if hint else ""))
