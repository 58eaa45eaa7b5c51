"""A method's learnable parameters in transformers models (``config.pid = {"learnable": True, ...}``): each
self-attention module's ``attention_params``, their initial values, tensor-parallel plan entries and weight decay.
"""
from __future__ import annotations

import re
from typing import Any, Iterable, List, Optional

import torch
from torch import nn

from ..core import AttentionMethod
from .internals import TP_PLAN, TP_STYLE

__all__ = ["GAINS_ATTR", "NoGainDecayTrainerMixin", "attach", "decay_parameter_names", "detach", "extend_tp_plan",
           "gain_parameter_names", "is_gain_name", "layer_gains_of", "reset"]

GAINS_ATTR = "attention_params"  # the gains' submodule on each self-attention module
MISSING_PATTERN = rf"(^|\.){GAINS_ATTR}\.[^.]+$"  # their state-dict keys (for _keys_to_ignore_on_load_missing)
#: a gain's parameter name, also inside peft's ``modules_to_save`` wrapper (its trained copy and frozen original)
_NAME = re.compile(rf"(^|\.){GAINS_ATTR}\.(modules_to_save\.[^.]+\.|original_module\.)?[^.]+$")
_ORIGIN = "_pid_plugins_origin"  # on a learned module made here: ``(method, config)`` it was made from


def _is_learned(module: Any) -> bool:
    return isinstance(module, nn.Module) and _ORIGIN in module.__dict__


def layer_gains_of(module: nn.Module) -> "nn.Module | None":
    """``module``'s learnable parameters (also through peft's ``original_module`` wrapper), else None."""
    gains = module._modules.get(GAINS_ATTR)
    held = getattr(gains, "original_module", None) if isinstance(gains, nn.Module) else None
    return gains if _is_learned(gains) or _is_learned(held) else None


@torch.no_grad()
def reset(module: nn.Module) -> bool:
    """Give a learned module made here its initial values (loaded ones kept); True if ``module`` is one."""
    origin = module.__dict__.get(_ORIGIN)
    if origin is None:
        return False
    from torch.distributed.tensor import DTensor, distribute_tensor
    from transformers import initialization as init  # skips parameters flagged as loaded

    fresh = origin[0].make_learned(origin[1])
    for name, param in module.named_parameters():
        value = fresh.get_parameter(name).detach().to(device=param.device, dtype=param.dtype)
        if isinstance(param, DTensor):  # with its mesh and placements
            value = distribute_tensor(value, param.device_mesh, param.placements, src_data_rank=None)
        init.copy_(param, value)
    return True


def attach(attention: nn.Module, config: Any, method: Optional[AttentionMethod]) -> bool:
    """Give ``attention`` (in its device, dtype and mode) ``method``'s learnable parameters unless it has them."""
    if method is None:
        return False
    current = layer_gains_of(attention)
    held = current if _is_learned(current) else getattr(current, "original_module", None)  # (peft's wrapper)
    if held is not None and held.__dict__[_ORIGIN][0].name == method.name:
        return False
    gains = method.make_learned(config)
    if gains is None:
        return False
    gains.__dict__[_ORIGIN] = (method, config)
    mine = attention._modules.get(GAINS_ATTR)
    own = {id(p) for p in mine.parameters()} if mine is not None else ()
    ref = next((p for p in attention.parameters() if p.is_floating_point() and id(p) not in own), None)
    if ref is not None:
        gains = gains.to(device=ref.device, dtype=ref.dtype)
    gains.train(attention.training)  # the layer's mode, whatever mode it gets them in
    if current is not None:
        delattr(attention, GAINS_ATTR)
    setattr(attention, GAINS_ATTR, gains)
    return True


def detach(attention: nn.Module) -> bool:
    """Remove ``attention``'s learnable parameters; True if it had some."""
    if layer_gains_of(attention) is None:
        return False
    delattr(attention, GAINS_ATTR)
    return True


def ignore_missing(model: nn.Module) -> None:
    """Name the gains in ``model._keys_to_ignore_on_load_missing``: a checkpoint without them loads silently."""
    current = getattr(model, "_keys_to_ignore_on_load_missing", None) or []
    if MISSING_PATTERN not in current:
        model._keys_to_ignore_on_load_missing = {*current, MISSING_PATTERN}


def extend_tp_plan(model: nn.Module) -> bool:
    """Add the learnable parameters' entries to ``model.tp_plan``; True if it added any."""
    entries = {re.sub(r"\.\d+(\.|$)", lambda m: ".*" + m.group(1), name): TP_STYLE
               for name, module in model.named_modules()
               if name.rpartition(".")[2] == GAINS_ATTR and _is_learned(module)}
    if not entries:
        return False
    if not TP_PLAN.holds():  # an older release: tensor parallelism with them is refused at the first forward
        return False
    plan = model.tp_plan
    missing = {k: v for k, v in entries.items() if plan.get(k) != v}
    if not plan or not missing:
        return False
    model.tp_plan = {**plan, **missing}
    return True


def is_gain_name(name: str) -> bool:
    """Whether a parameter name (as ``named_parameters`` gives it, any prefix) is a learnable PID gain."""
    return _NAME.search(name) is not None


def gain_parameter_names(model: nn.Module) -> List[str]:
    """The names of the model's learnable method parameters, peft's included."""
    return [n for n, _ in model.named_parameters() if is_gain_name(n)]


def decay_parameter_names(names: Iterable[str]) -> List[str]:
    """``names`` without the PID gains: what to return from ``Trainer.get_decay_parameter_names``."""
    return [n for n in names if not is_gain_name(n)]


class NoGainDecayTrainerMixin:
    """Keeps the learnable gains out of weight decay in transformers' ``Trainer`` (and e.g. TRL's ``SFTTrainer``)::

        class PIDTrainer(NoGainDecayTrainerMixin, Trainer):
            pass
    """

    def get_decay_parameter_names(self, model: nn.Module) -> List[str]:
        """The ``Trainer``'s own weight-decay names without the PID gains."""
        return decay_parameter_names(super().get_decay_parameter_names(model))  # type: ignore[misc]
