"""The ``"pid"`` attention implementation for transformers' attention interface.

The attention function has ``sdpa_attention_forward``'s signature and runs it, then applies
:func:`pid_plugins.core.pid_update` to the per-head output before the model's output projection.

The PID state is per forward pass. A forward pre-hook on the model's base model puts a fresh
:class:`PIDForwardState` into the forward's keyword arguments; transformers passes keyword arguments
down to every attention call (and gradient checkpointing captures them with each layer, so recomputation
sees the same state). Each layer reads the state of the previous layer by ``layer_idx`` and records its
own. With a KV cache, only the values of the query positions enter the PID term: they sit at
``[past_length, past_length + q_len)`` of the returned value tensor (dynamic caches end there, static
caches are longer).

Models loaded with ``attn_implementation="pid"`` get the hook on their first forward (the mask
function, which every forward calls once before its layers, installs it); :func:`to_pid` installs it
at once.
"""
from __future__ import annotations

import functools
import sys
import threading
from dataclasses import dataclass, field
from typing import Any, Dict, Optional

import torch
from torch import Tensor, nn
from transformers import AttentionInterface, AttentionMaskInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from ..core import PIDConfig, PIDState, pid_update

__all__ = [
    "ATTN_IMPLEMENTATION", "PIDForwardState", "pid_attention_forward", "pid_mask", "install_pid_hooks",
    "model_pid_config", "to_pid",
]

ATTN_IMPLEMENTATION = "pid"
DEFAULT_PRESET = "lm"
_HOOK_FLAG = "_pid_plugins_hook"
_HOOK_LOCK = threading.Lock()  # two threads' first forwards must not both register the hook


@dataclass
class PIDForwardState:
    """The PID state of one forward pass: gains, cache offset, and each layer's outgoing state."""

    config: PIDConfig
    past_length: int = 0
    layers: Dict[int, PIDState] = field(default_factory=dict)

    def previous(self, layer_idx: int) -> Optional[PIDState]:
        """The state left by the nearest earlier PID layer of this pass (None at the first layer)."""
        state = self.layers.get(layer_idx - 1)  # the usual case: consecutive layers, O(1) per layer
        if state is not None:
            return state
        earlier = [i for i in self.layers if i < layer_idx]
        return self.layers[max(earlier)] if earlier else None


def model_pid_config(config: Any) -> PIDConfig:
    """The gains a model runs with: ``config.pid`` (dict or PIDConfig) over the ``lm`` preset."""
    raw = getattr(config, "pid", None)
    if isinstance(raw, dict):
        # called once per forward (every decoding step): parse a given dict once, not every time
        try:
            return _coerce_items(tuple(sorted(raw.items())))
        except TypeError:  # unhashable values: let coerce report or accept them
            pass
    return PIDConfig.coerce(raw, default=DEFAULT_PRESET)


@functools.lru_cache(maxsize=64)
def _coerce_items(items: tuple) -> PIDConfig:
    return PIDConfig.coerce(dict(items), default=DEFAULT_PRESET)


def _is_cross_attention(module: nn.Module) -> bool:
    return bool(getattr(module, "is_cross_attention", False)) or _cross_attention_type(type(module))


@functools.lru_cache(maxsize=None)
def _cross_attention_type(cls: type) -> bool:
    return "CrossAttention" in cls.__name__


def pid_attention_forward(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Optional[Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    is_causal: Optional[bool] = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """SDPA attention followed by the PID update; ``(B, q, H, D)`` output like ``sdpa_attention_forward``."""
    run: Optional[PIDForwardState] = kwargs.pop("pid_state", None)
    out, weights = sdpa_attention_forward(
        module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
    )
    if _is_cross_attention(module):
        return out, weights  # cross-attention stays softmax: its values come from another sequence
    if run is None:
        raise RuntimeError(
            "attn_implementation='pid' needs its per-forward PID state, which pid_plugins installs on the model: "
            "call pid_plugins.hf.to_pid(model) once (models loaded with attn_implementation='pid' get it on "
            "their first forward unless that forward passes a ready-made 4-D attention mask)"
        )
    if run.config.is_zero:
        return out, weights
    layer_idx = getattr(module, "layer_idx", None)
    if layer_idx is None:
        raise RuntimeError(f"{type(module).__name__} has no layer_idx: PID needs the layer order")
    q_len = query.shape[-2]
    start = run.past_length if value.shape[-2] >= run.past_length + q_len else value.shape[-2] - q_len
    # the PID term in the output's (B, q, heads, D) layout: the values are viewed the same way, so the
    # output stays contiguous for the model's output projection
    v_q = value[:, :, start:start + q_len].transpose(1, 2)
    u, run.layers[layer_idx] = pid_update(out, v_q, run.previous(layer_idx), run.config, head_dim=-2)
    return u, weights


def _past_length(past_key_values: Any) -> int:
    if past_key_values is None or not hasattr(past_key_values, "get_seq_length"):
        return 0
    for layer in getattr(past_key_values, "layers", []):
        if "Sliding" in type(layer).__name__ or getattr(layer, "is_sliding", False):
            raise NotImplementedError(
                "PID attention with sliding-window cache layers is not supported: the query positions' values "
                "cannot be located in a rolling buffer; use a dynamic or static cache"
            )
    return int(past_key_values.get_seq_length())


def _check_checkpointing(model: nn.Module) -> None:
    for m in model.modules():
        if getattr(m, "gradient_checkpointing", False):
            func = getattr(m, "_gradient_checkpointing_func", None)
            keywords = getattr(func, "keywords", None) or {}
            if keywords.get("use_reentrant", False):
                raise ValueError(
                    "PID attention needs non-reentrant gradient checkpointing (reentrant checkpointing drops "
                    "the per-forward PID state and gives wrong gradients): use "
                    "model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': False})"
                )
            return


def _pre_hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    if getattr(module.config, "_attn_implementation", None) != ATTN_IMPLEMENTATION:
        return args, kwargs
    if module.training and torch.is_grad_enabled():
        _check_checkpointing(module)
    kwargs["pid_state"] = PIDForwardState(model_pid_config(module.config), _past_length(kwargs.get("past_key_values")))
    return args, kwargs


def _stacks(model: PreTrainedModel) -> list[nn.Module]:
    """The modules whose forward runs a layer stack: the base model, or its encoder and decoder."""
    base = getattr(model, "base_model", model)
    stacks = []
    for getter in ("get_encoder", "get_decoder"):
        fn = getattr(base, getter, None)
        try:
            part = fn() if callable(fn) else None
        except (AttributeError, NotImplementedError, TypeError):
            part = None
        if part is not None and part is not base and isinstance(part, nn.Module):
            stacks.append(part)
    return stacks or [base]


def install_pid_hooks(model: PreTrainedModel) -> PreTrainedModel:
    """Attach the per-forward PID state hook (idempotent) and persist the choice in the config."""
    with _HOOK_LOCK:
        for stack in _stacks(model):
            if not getattr(stack, _HOOK_FLAG, False):
                stack.register_forward_pre_hook(_pre_hook, with_kwargs=True)
                setattr(stack, _HOOK_FLAG, True)
    _persist(model.config)
    return model


def _persist(config: Any) -> None:
    # transformers does not serialise `_attn_implementation`; a plain `attn_implementation` entry in
    # config.json is read back by the config's __init__, so a saved PID model reloads as PID.
    config.attn_implementation = ATTN_IMPLEMENTATION
    config.pid = model_pid_config(config).to_dict()


def to_pid(model: PreTrainedModel, config: Any = None) -> PreTrainedModel:
    """Switch a transformers model to PID attention in place (weights untouched) and return it.

    ``config``: a :class:`PIDConfig`, a dict of overrides of the ``lm`` preset, a preset name, or None
    (keep ``model.config.pid`` if set, else the ``lm`` preset).
    """
    if config is not None or not hasattr(model.config, "pid"):
        cfg = PIDConfig.coerce(config, default=model_pid_config(model.config))
        if cfg.learnable:
            raise ValueError("learnable gains are not supported by the transformers adapter; use fixed gains")
        model.config.pid = cfg.to_dict()
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    return install_pid_hooks(model)


def pid_mask(*args: Any, **kwargs: Any):
    """SDPA's mask function; on a model's first PID forward it also installs the PID hook (see module doc)."""
    config = kwargs.get("config")
    if config is not None:
        _bootstrap(config)
    return sdpa_mask(*args, **kwargs)


def _bootstrap(config: Any) -> None:
    """Find the running model that owns ``config`` (a few frames up); if it lacks the PID hook, hook it and
    hand this forward its state (later forwards get theirs from the hook). A forward that started before
    another thread installed the hook has no state yet either: it gets one here too."""
    frame = sys._getframe(2)
    for _ in range(12):
        if frame is None:
            return
        owner = frame.f_locals.get("self")
        if isinstance(owner, PreTrainedModel) and owner.config is config:
            if not getattr(owner, _HOOK_FLAG, False):
                install_pid_hooks(owner)
            local_kwargs = frame.f_locals.get("kwargs")
            if isinstance(local_kwargs, dict) and "pid_state" not in local_kwargs:
                local_kwargs["pid_state"] = PIDForwardState(
                    model_pid_config(config), _past_length(frame.f_locals.get("past_key_values")))
            return
        frame = frame.f_back


AttentionInterface.register(ATTN_IMPLEMENTATION, pid_attention_forward)
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, pid_mask)
