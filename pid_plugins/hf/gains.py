"""Learnable parameters of a method for transformers models (``config.pid = {"learnable": True, ...}``, likewise
``config.value_residual``): PID's gains, or what another method's ``make_learned`` makes (value residual: ``lambda_1``,
``lambda_2``).

Where they live: every self-attention module of a model running the method gets a submodule ``attention_params``
(what the method's ``make_learned`` makes; for PID a :class:`~pid_plugins.core.gains.PIDGains`: ``lambda_p_raw``, ``lambda_i_raw``,
``lambda_d_raw``, each of shape ``(1,)``, gain = softplus(raw)), so its parameters are named like
``model.layers.3.self_attn.attention_params.lambda_p_raw`` and belong to their layer: FSDP2's ``fully_shard`` per
decoder layer shards them with the layer, ``device_map`` puts them on the layer's device, gradient
checkpointing recomputes them with the layer. Cross-attention has none (it runs the base attention).

How they survive transformers' own paths:

* construction: :mod:`pid_plugins.hf.install`'s module-registration hook calls :func:`attach` whenever a model
  whose method's parameters are learnable registers a child (for every self-attention module below it), so
  ``Model(config)``, ``from_config`` and ``from_pretrained(..., attn_implementation="pid")`` build them before any
  weight is loaded, and the saved values load into them;
* missing keys (a softmax or fixed-gain checkpoint loaded into a learnable model): transformers materialises
  missing parameters with ``torch.empty`` and then runs its weight initialisation on every module it does not
  know to be initialised. :mod:`pid_plugins.hf.install` makes that initialisation call :func:`reset`
  (the config's gains, through ``transformers.initialization``, which leaves loaded parameters alone), and the
  model's ``_keys_to_ignore_on_load_missing`` names the gains, so their absence is not reported;
* sharded parameters: under FSDP2 (``DistributedConfig(fsdp_size=...)``, ``fully_shard``) the missing parameters are
  DTensor shards when transformers initialises them; :func:`reset` gives each rank its shard of the initial values;
* tensor parallelism (``from_pretrained(..., tp_plan="auto")``, ``DistributedConfig(tp_size=...)``): the parameters
  are replicated on every rank, but each rank's attention sees only its own heads, so each rank's gradient is a
  part of the whole. :func:`extend_tp_plan` (run when the model is built, :mod:`pid_plugins.hf.install`) adds
  ``"<path>.attention_params": "replicated_with_grad_allreduce"`` to the model's ``tp_plan`` for every attention
  module that has them, so transformers sums their gradients over the tensor-parallel group after the backward;
* weight decay: transformers' ``Trainer`` decides by parameter name (``bias``, ``norm`` patterns) and
  ``nn.LayerNorm`` type only, with no model hook. :class:`NoGainDecayTrainerMixin` (or
  :func:`decay_parameter_names`) keeps the gains out; see its docstring.
* peft: ``modules_to_save=["attention_params"]`` trains a copy of each layer's gains beside the adapter and saves it
  with the adapter (``"attention_warmup"`` likewise saves the warm-up counter); :func:`layer_gains_of` and
  :func:`is_gain_name` recognise peft's wrapper, so rediscovery keeps it and the weight-decay helpers skip its
  gains. Tested in tests/test_peft.py.
"""
from __future__ import annotations

import re
from typing import Any, Dict, Iterable, List, Optional

import torch
from torch import nn

from ..core import AttentionMethod
from .internals import TP_PLAN, TP_STYLE

__all__ = ["GAINS_ATTR", "NoGainDecayTrainerMixin", "attach", "decay_parameter_names", "detach",
           "extend_tp_plan", "gain_parameter_names", "is_gain_name", "layer_gains_of", "make", "reset",
           "tp_plan_entries"]

#: the attribute (submodule name) of the gains on each self-attention module
GAINS_ATTR = "attention_params"
#: matches the state-dict keys of the gains (transformers' ``_keys_to_ignore_on_load_missing`` is a regex list)
MISSING_PATTERN = rf"(^|\.){GAINS_ATTR}\.[^.]+$"
#: a gain's parameter name, also inside peft's ``modules_to_save`` wrapper
#: (``attention_params.modules_to_save.<adapter>.`` the trained copy, ``attention_params.original_module.`` the
#: frozen original)
_NAME = re.compile(rf"(^|\.){GAINS_ATTR}\.(modules_to_save\.[^.]+\.|original_module\.)?[^.]+$")
#: on a learned module made here: ``(method, config)`` it was made from (its initial values)
_ORIGIN = "_pid_plugins_origin"


def _is_learned(module: Any) -> bool:
    return isinstance(module, nn.Module) and _ORIGIN in module.__dict__


def layer_gains_of(module: nn.Module) -> "nn.Module | None":
    """``module``'s learnable parameters: the method's ``make_learned`` module made here (:func:`make`),
    or a wrapper holding one as ``original_module`` (peft's ``modules_to_save=["attention_params"]``: calling it gives
    the active adapter's copy), else None."""
    gains = module._modules.get(GAINS_ATTR)
    held = getattr(gains, "original_module", None) if isinstance(gains, nn.Module) else None
    return gains if _is_learned(gains) or _is_learned(held) else None


def _method_of_learned(gains: nn.Module) -> Optional[str]:
    """The name of the method whose parameters ``gains`` (or the module a wrapper holds) are."""
    held = gains if _is_learned(gains) else getattr(gains, "original_module", None)
    origin = held.__dict__.get(_ORIGIN) if held is not None else None
    return origin[0].name if origin is not None else None


def make(method: AttentionMethod, config: Any) -> Optional[nn.Module]:
    """One layer's learnable parameters for ``method`` with ``config`` (None for fixed parameters): the method's
    ``make_learned`` module (PID: :class:`~pid_plugins.core.gains.PIDGains`), marked with what it was made from, so
    that transformers' initialisation of missing weights restores those values (:func:`reset`)."""
    learned = method.make_learned(config)
    if learned is not None:
        learned.__dict__[_ORIGIN] = (method, config)
    return learned


@torch.no_grad()
def reset(module: nn.Module) -> bool:
    """Give a learned module made here the initial values of what it was made from, leaving the parameters
    transformers loaded alone (``transformers.initialization``); True if ``module`` is one."""
    origin = module.__dict__.get(_ORIGIN)
    if origin is None:
        return False
    from transformers import initialization as init  # skips parameters flagged as loaded

    fresh = origin[0].make_learned(origin[1])
    for name, param in module.named_parameters():
        init.copy_(param, _like(param, fresh.get_parameter(name).detach()))
    return True


def _like(param: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``value`` (the whole initial tensor, the same on every rank) on ``param``'s device and dtype, and, when
    ``param`` is a DTensor (FSDP2's shard, a tensor-parallel placement), with its mesh and placements: each rank
    takes its own part with no communication, so copying it in needs no placement change."""
    value = value.to(device=param.device, dtype=param.dtype)
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(param, DTensor):
        return distribute_tensor(value, param.device_mesh, param.placements, src_data_rank=None)
    return value


def attach(attention: nn.Module, config: Any, method: Optional[AttentionMethod]) -> bool:
    """Give ``attention`` the learnable parameters of ``method`` with ``config`` unless it has some of that method
    (another method's are replaced); True if it added them (False too for no method: a stock config).

    They take the device and dtype of the module's first floating-point parameter (the current default device and
    dtype if it has none yet, e.g. transformers' meta-device construction) and the module's train/eval mode."""
    if method is None:
        return False
    current = layer_gains_of(attention)
    if current is not None and _method_of_learned(current) == method.name:
        return False
    gains = make(method, config)
    if gains is None:
        return False
    ref = next((p for p in attention.parameters() if p.is_floating_point() and not _is_gain_param(attention, p)),
               None)
    if ref is not None:
        gains = gains.to(device=ref.device, dtype=ref.dtype)
    gains.train(attention.training)  # the layer's mode, whatever mode it gets them in
    if current is not None:
        delattr(attention, GAINS_ATTR)
    setattr(attention, GAINS_ATTR, gains)
    return True


def _is_gain_param(attention: nn.Module, param: torch.Tensor) -> bool:
    gains = attention._modules.get(GAINS_ATTR)
    return gains is not None and any(param is p for p in gains.parameters())


def detach(attention: nn.Module) -> bool:
    """Remove ``attention``'s learnable parameters; True if it had some."""
    if layer_gains_of(attention) is None:
        return False
    delattr(attention, GAINS_ATTR)
    return True


def ignore_missing(model: nn.Module) -> None:
    """Name the gains in ``model._keys_to_ignore_on_load_missing`` (instance attribute; ``post_init`` keeps it
    and outer models collect it from their children), so loading a checkpoint without them reports nothing."""
    current = getattr(model, "_keys_to_ignore_on_load_missing", None) or []
    if MISSING_PATTERN not in current:
        model._keys_to_ignore_on_load_missing = {*current, MISSING_PATTERN}


# ------------------------------------------------------------------------------------------ tensor parallelism
def _wildcard(name: str) -> str:
    """A module name with its layer numbers as ``*``, as transformers' plans name modules
    (``model.layers.3.self_attn`` -> ``model.layers.*.self_attn``)."""
    return re.sub(r"\.\d+(\.|$)", lambda m: ".*" + m.group(1), name)


def tp_plan_entries(model: nn.Module) -> Dict[str, str]:
    """The tensor-parallel plan entries for ``model``'s learnable method parameters: every ``attention_params``
    module made here, replicated with its gradient summed over the tensor-parallel group
    (``{"model.layers.*.self_attn.attention_params": "replicated_with_grad_allreduce"}``)."""
    return {_wildcard(name): TP_STYLE for name, module in model.named_modules()
            if name.rpartition(".")[2] == GAINS_ATTR and _is_learned(module)}


def extend_tp_plan(model: nn.Module) -> bool:
    """Add :func:`tp_plan_entries` to ``model.tp_plan`` (transformers' public plan, which ``from_pretrained`` applies
    with ``tp_plan="auto"`` / ``DistributedConfig(tp_size=...)``, and outer models collect from their children);
    True if it added any. A model without a plan is left alone (transformers refuses tensor parallelism for it)."""
    entries = tp_plan_entries(model)
    if not entries:
        return False
    if not TP_PLAN.holds():  # an older release: no entry; tensor parallelism with these parameters is refused at the
        return False          # first forward (discovery._pre_hook), everything else runs
    plan = model.tp_plan
    missing = {k: v for k, v in entries.items() if plan.get(k) != v}
    if not plan or not missing:
        return False
    model.tp_plan = {**plan, **missing}
    return True


# ---------------------------------------------------------------------------------------------- weight decay
def is_gain_name(name: str) -> bool:
    """Whether a parameter name (as ``named_parameters`` gives it, any prefix) is a learnable PID gain."""
    return _NAME.search(name) is not None


def gain_parameter_names(model: nn.Module) -> List[str]:
    """The names of the model's learnable method parameters (``...attention_params.lambda_p_raw`` etc., peft's names
    included)."""
    return [n for n, _ in model.named_parameters() if is_gain_name(n)]


def decay_parameter_names(names: Iterable[str]) -> List[str]:
    """``names`` without the PID gains: what to return from ``Trainer.get_decay_parameter_names``."""
    return [n for n in names if not is_gain_name(n)]


class NoGainDecayTrainerMixin:
    """Keeps the learnable PID gains out of weight decay in transformers' ``Trainer`` (and its subclasses,
    e.g. TRL's ``SFTTrainer``)::

        from transformers import Trainer
        from pid_plugins.hf import NoGainDecayTrainerMixin

        class PIDTrainer(NoGainDecayTrainerMixin, Trainer):
            pass

    The Trainer puts every parameter it does not exclude by name (``bias``, ``norm``) or type
    (``nn.LayerNorm``) into the weight-decay group and offers no model-side hook, so without this the gains
    decay whenever ``weight_decay > 0`` (pulling each raw value towards 0, i.e. each gain towards log 2).
    """

    def get_decay_parameter_names(self, model: nn.Module) -> List[str]:
        """The ``Trainer``'s own weight-decay names without the PID gains."""
        return decay_parameter_names(super().get_decay_parameter_names(model))  # type: ignore[misc]
