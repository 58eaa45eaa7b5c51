"""What every PID timm family shares: gains from kwargs, the PID step and the block loop, local-only
pretrained sources, strict key checks, and registration of the catalogue's entries with timm's
``register_model``."""
from __future__ import annotations

import os
from functools import partial
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn
from timm.layers import register_notrace_function
from timm.models import generate_default_cfgs, register_model
from timm.models._builder import resolve_pretrained_cfg
from timm.models._manipulate import checkpoint

from ..catalogue import ModelEntry, load_catalogue
from ..core import PIDConfig, PIDState, layer_gains, pid_update, scaled_gains

ATTENTION_CHOICES = ("pid", "softmax")


def resolve_pid(pid: Any = None, attention: str = "pid", default: Union[PIDConfig, str] = "deit") -> Optional[PIDConfig]:
    """The PID config a model is built with; ``None`` means stock softmax attention."""
    if attention not in ATTENTION_CHOICES:
        raise ValueError(f"attention must be one of {ATTENTION_CHOICES}, got {attention!r}")
    if attention == "softmax":
        return None
    return PIDConfig.coerce(pid, default=default)


@register_notrace_function
def pid_step(
    layer: nn.Module, attn_out: Tensor, value: Tensor, state: Optional[PIDState], scale: Optional[Tensor] = None,
) -> Tuple[Tensor, PIDState]:
    """The PID update of one attention ``layer`` (its ``pid`` config and ``pid_gains``), its gains multiplied by
    the model's warm-up ``scale`` for this forward (None: no warm-up).

    Registered with timm's ``register_notrace_function``: torch.fx (timm's and torchvision's feature
    extraction) records it as one call instead of tracing into :func:`pid_update`, whose shape checks are
    Python control flow. Its result is a tuple: index it (``res[0]``) or unpack it into a fixed number of
    names; ``*rest`` unpacking of a traced value is not possible.
    """
    return pid_update(attn_out, value, state, scaled_gains(layer_gains(layer.pid, layer.pid_gains), scale))


def state_outputs(state: Optional[PIDState]) -> Tuple[Any, ...]:
    """A block's PID state as the flat tail of its output tuple (``()`` for softmax attention).

    Indexes the state field by field, so it also works on a torch.fx proxy of a :func:`pid_step` result.
    """
    if state is None:
        return ()
    return tuple(state[i] for i in range(len(PIDState._fields)))


def run_blocks(
    blocks: Iterable[nn.Module],
    x: Tensor,
    args: Sequence[Any],
    use_checkpoint: bool,
    take_indices: Optional[Sequence[int]] = None,
    norm: Optional[nn.Module] = None,
    pid_scale: Optional[Tensor] = None,
    **kwargs: Any,
) -> Tuple[Tensor, List[Tensor]]:
    """Run ``block(x, *args, *state, **kwargs) -> (x, *state)`` over a PID group, threading the state.

    Optionally under timm's ``checkpoint`` (then ``kwargs`` must be empty). Returns the output and the
    block outputs at ``take_indices`` (after ``norm`` if given). Block outputs are indexed, never
    ``*``-unpacked, so torch.fx can trace the loop. ``pid_scale`` (the warm-up scale of this forward) reaches
    every block as the keyword ``pid_scale``; under checkpointing it is bound to the block (a value computed
    once per forward, so the recomputation sees the same scale).
    """
    state: Tuple[Any, ...] = ()
    intermediates: List[Tensor] = []
    if pid_scale is not None:
        kwargs = dict(kwargs, pid_scale=pid_scale)
    for i, blk in enumerate(blocks):
        if use_checkpoint and not torch.jit.is_scripting():
            out = checkpoint(blk if pid_scale is None else partial(blk, pid_scale=pid_scale), x, *args, *state)
        else:
            out = blk(x, *args, *state, **kwargs)
        x, state = out[0], tuple(out[1:])
        if take_indices is not None and i in take_indices:
            intermediates.append(norm(x) if norm is not None else x)
    return x, intermediates


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


def _dropped_classifier_keys(model: nn.Module, keys: Iterable[str]) -> set:
    """The classifier parameters timm's ``load_pretrained`` discards after the filter has run.

    timm drops ``pretrained_cfg['classifier']`` (and loads non-strictly) when the model's ``num_classes``
    differs from the pretrained cfg's: ``num_classes=0`` (features / linear probe) or a new label set.
    """
    cfg = getattr(model, "pretrained_cfg", None) or {}
    classifiers = cfg.get("classifier")
    if not classifiers or getattr(model, "num_classes", None) == cfg.get("num_classes"):
        return set()
    classifiers = (classifiers,) if isinstance(classifiers, str) else tuple(classifiers)
    names = {f"{c}.{p}" for c in classifiers for p in ("weight", "bias")}
    return {k for k in keys if k in names}


def finish_state_dict(out: Dict[str, Tensor], model: nn.Module, hint: str) -> Dict[str, Tensor]:
    """Fill learnable PID gains and the warm-up counter a softmax checkpoint lacks; raise listing
    missing/unexpected keys.

    Classifier keys that timm's ``load_pretrained`` is about to drop (the model's ``num_classes`` differs
    from the pretrained cfg's) are not counted: the new head keeps its fresh initialisation, as in timm.
    """
    expected = model.state_dict()
    for name, value in expected.items():
        if ".pid_gains." in name and name not in out:
            out[name] = value.detach().clone()
        elif name == "pid_warmup.step" and name not in out:  # no warm-up counter in the checkpoint: t starts at 0
            out[name] = torch.zeros_like(value)
    dropped = _dropped_classifier_keys(model, set(expected) | set(out))
    missing = sorted(set(expected) - set(out) - dropped)
    unexpected = sorted(set(out) - set(expected) - dropped)
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
