"""What a layer and a model hold for their attention method, once for every adapter: :class:`MethodLayer` (the
layer's method, config and learnable parameters) and :class:`MethodModel` (the model's method, config and gain
warm-up counter), and the names releases before the rename saved them under (:func:`rename_legacy_keys`)."""
from __future__ import annotations

import logging
import warnings
from typing import Any, Callable, Dict, Iterable, List, MutableMapping, Optional, Tuple

import torch
from torch import Tensor, nn

from .methods import AttentionMethod, LayerCall, MethodChoice, method_warmup
from .warmup import GainWarmup

__all__ = [
    "MethodLayer", "MethodModel", "finish_warmup", "register_warmup_finisher", "finished_config", "LAYER_ATTRIBUTES",
    "MODEL_ATTRIBUTES", "strip_attributes", "settle_submodule", "warn_unfinished_warmup", "number_layers",
    "RENAMED_ATTRIBUTES", "rename_legacy_keys", "accept_legacy_keys", "holds_method",
]

logger = logging.getLogger(__name__)

# ------------------------------------------------------------------------------------ the names before the rename
#: the attributes releases before the rename called by PID's names, though they carry any method's things: the old
#: name -> today's. The old names stay readable (a :class:`DeprecationWarning`) for one deprecation period.
RENAMED_ATTRIBUTES: Dict[str, str] = {
    "pid_gains": "attention_params",  # the layer's learnable parameters (a submodule: in state_dicts)
    "pid_warmup": "attention_warmup",  # the model's gain warm-up counter (a submodule: ``...step`` in state_dicts)
    "pid": "attention_config",  # the layer's / model's method config (a plain attribute)
}
#: the renamed submodules, whose old names are in the state_dicts and checkpoints users saved
_RENAMED_SUBMODULES = {old: new for old, new in RENAMED_ATTRIBUTES.items() if old != "pid"}


def _deprecated_alias(old: str) -> property:
    new = RENAMED_ATTRIBUTES[old]

    def read(self: Any) -> Any:
        warnings.warn(f"{type(self).__name__}.{old} is renamed {new} (it carries any attention method's, not only "
                      f"PID's); read .{new}: .{old} goes away in a later release", DeprecationWarning, stacklevel=2)
        return getattr(self, new)

    read.__doc__ = f"Deprecated read-only alias of ``{new}`` (its name before the rename)."
    return property(read)


def _rename_under(state_dict: MutableMapping[str, Any], prefix: str) -> None:
    """In place: ``prefix + "pid_gains." + rest`` -> ``prefix + "attention_params." + rest`` (likewise
    ``pid_warmup.``), unless a key of today's name is there already."""
    for key in [k for k in state_dict if k.startswith(prefix)]:
        head, dot, rest = key[len(prefix):].partition(".")
        new = _RENAMED_SUBMODULES.get(head)
        if new is not None and dot and f"{prefix}{new}.{rest}" not in state_dict:
            state_dict[f"{prefix}{new}.{rest}"] = state_dict.pop(key)


def holds_method(module: nn.Module) -> bool:
    """Whether ``module`` holds an attention method's things under the renamed names: a :class:`MethodLayer` or
    :class:`MethodModel`, or a zoo module given ``attention_params`` / ``attention_warmup`` (transformers)."""
    return isinstance(module, (MethodLayer, MethodModel)) or any(n in module._modules for n in
                                                                 _RENAMED_SUBMODULES.values())


def rename_legacy_keys(state_dict: MutableMapping[str, Any], model: nn.Module,
                       prefix: str = "") -> MutableMapping[str, Any]:
    """``state_dict`` (changed in place and returned) with the keys a release before the rename saved under today's
    names: below every module of ``model`` that :func:`holds_method` (its key prefix: ``prefix`` + its name),
    ``<module>.pid_gains.<param>`` -> ``<module>.attention_params.<param>`` and ``<module>.pid_warmup.step`` ->
    ``<module>.attention_warmup.step``. Other keys, and keys already of today's name, are left alone. The one
    translation every adapter's loading path uses (a zoo's checkpoint filter, fairseq's upgrade, mmseg's init_cfg)."""
    for name, module in model.named_modules():
        if holds_method(module):
            _rename_under(state_dict, f"{prefix}{name}." if name else prefix)
    return state_dict


def _legacy_keys_pre_hook(state_dict: MutableMapping[str, Any], prefix: str, *args: Any) -> None:
    _rename_under(state_dict, prefix)


def accept_legacy_keys(module: nn.Module) -> None:
    """Make ``module.load_state_dict`` (and every loader that reaches its ``_load_from_state_dict``: torch's, mmengine's
    ``load_checkpoint``/init_cfg/Runner resume, fairseq's) take the keys a release before the rename saved below it
    (:func:`rename_legacy_keys`): a load-state-dict pre-hook, registered once. :class:`MethodLayer` and
    :class:`MethodModel` register it themselves; transformers' adapter on the modules it gives parameters or the
    counter."""
    hooks = module._load_state_dict_pre_hooks.values()
    if not any(getattr(h, "hook", h) is _legacy_keys_pre_hook for h in hooks):
        module._register_load_state_dict_pre_hook(_legacy_keys_pre_hook)


def _drop_legacy_keys_hook(module: nn.Module) -> None:
    hooks = module._load_state_dict_pre_hooks
    for key in [k for k, h in hooks.items() if getattr(h, "hook", h) is _legacy_keys_pre_hook]:
        del hooks[key]


class MethodLayer:
    """Mixed into an adapter's attention layer (an ``nn.Module``): the layer's method and parameters.

    ``attention_method`` (the :class:`~pid_plugins.core.AttentionMethod`, None for softmax),
    ``attention_config`` (its config) and ``attention_params`` (the method's learnable per-layer parameters, from
    ``method.make_learned``, or None; a submodule, so in the state_dict as ``<layer>.attention_params.<param>``).
    Checkpoints saved before the rename (``<layer>.pid_gains.<param>``) load unchanged (:func:`accept_legacy_keys`);
    ``pid`` and ``pid_gains`` are deprecated read-only aliases.
    ``layer_index``: the layer's 0-based position within its group (set by the model that owns the group with
    :func:`number_layers`, when it is built or converted; None for a layer outside a model), which the adapter
    passes as :attr:`LayerCall.layer <pid_plugins.core.LayerCall>`.
    """

    attention_method: Optional[AttentionMethod]
    attention_config: Any
    attention_params: Optional[nn.Module]
    layer_index: Optional[int] = None
    pid = _deprecated_alias("pid")
    pid_gains = _deprecated_alias("pid_gains")

    def set_attention(self, choice: Optional[MethodChoice], like: Optional[Tensor] = None) -> None:
        """Switch the layer to ``choice`` (None: softmax); learnable parameters are (re)initialised on ``like``'s
        device and dtype."""
        self.attention_method = choice.method if choice is not None else None
        self.attention_config = choice.config if choice is not None else None
        learned = choice.method.make_learned(choice.config) if choice is not None else None
        if learned is not None:
            if like is not None:
                learned = learned.to(device=like.device, dtype=like.dtype)
            learned.train(self.training)  # the layer's mode, whatever mode it is switched in
        self.attention_params = learned
        accept_legacy_keys(self)

    @property
    def method_active(self) -> bool:
        """Whether the layer runs its method (False: softmax, or a config that computes the stock attention: the
        adapter runs its zoo's own code path, bit for bit)."""
        method = self.attention_method
        return method is not None and not method.is_identity(self.attention_config)

    @property
    def state_size(self) -> int:
        """How many flat tensors this layer hands to the next (0: the stock attention, nothing threaded)."""
        return len(self.attention_method.state_fields) if self.method_active else 0

    def apply_method(self, call: LayerCall, state: Optional[tuple]) -> Tuple[Tensor, tuple]:
        """The layer's one :meth:`~pid_plugins.core.AttentionMethod.apply` with its own config and parameters."""
        return self.attention_method.apply(self.attention_config, self.attention_params, call, state)


class MethodModel:
    """Mixed into an adapter's model (or the module that owns a group of method layers): the method, its config and
    the gain warm-up counter, set in one place.

    ``attention_method`` (None for softmax), ``attention_config`` (the config) and ``attention_warmup`` (the
    :class:`~pid_plugins.core.GainWarmup` counter when the config has ``warmup_steps``, else None; a submodule, so its
    step is saved with the model: ``<model>.attention_warmup.step``). Checkpoints saved before the rename
    (``pid_warmup.step``) load unchanged (:func:`accept_legacy_keys`); ``pid`` and ``pid_warmup`` are deprecated
    read-only aliases.
    """

    attention_method: Optional[AttentionMethod]
    attention_config: Any
    attention_warmup: Optional[GainWarmup]
    pid = _deprecated_alias("pid")
    pid_warmup = _deprecated_alias("pid_warmup")

    def set_model_method(self, choice: Optional[MethodChoice], like: Optional[Tensor] = None, *,
                         stock_plus_term: bool = False, where: str = "this model") -> None:
        """Hold ``choice`` (None: softmax) and make (or keep, or drop) the warm-up counter on ``like``'s device;
        ``stock_plus_term``: see :func:`~pid_plugins.core.method_warmup`."""
        self.attention_method = choice.method if choice is not None else None
        self.attention_config = choice.config if choice is not None else None
        self._stock_plus_term = stock_plus_term
        self.__dict__.pop("_warmup_finished", None)
        self._buffers.pop("_warmup_finished", None)
        counter = method_warmup(choice, like, self.__dict__.get("_modules", {}).get("attention_warmup"),
                                stock_plus_term=stock_plus_term, where=where)
        if counter is not None:
            counter.train(self.training)  # a counter made on a model in eval mode must not count its forwards
        self.attention_warmup = counter
        accept_legacy_keys(self)

    def method_scale(self) -> Optional[Tensor]:
        """This forward's warm-up scale for the layers, read once per forward of the model (a training forward then
        advances the counter): None on the fixed path (no warm-up). A model whose adapter runs warm-up as the zoo's
        stock attention plus the method's term (mmseg, fairseq) keeps that form after :func:`finish_warmup`, at a
        constant scale of 1: exactly the function it was warmed up to."""
        counter = self.attention_warmup
        if counter is not None:
            return counter()
        return self._buffers.get("_warmup_finished")

    @property
    def method_active(self) -> bool:
        """Whether the model runs its method (False: softmax, or a config that computes the stock attention)."""
        method = self.attention_method
        return method is not None and not method.is_identity(self.attention_config)


def number_layers(layers: Iterable[MethodLayer]) -> None:
    """Give the method layers of one group, in the order the model threads its method's state through them, their
    0-based ``layer_index`` (a plain int attribute: not saved with the model, a constant for torch.fx and
    torch.compile). A model calls it when it builds or converts its layers; each group counts from 0."""
    for index, layer in enumerate(layers):
        layer.layer_index = index


# ------------------------------------------------------------------------------------ convert
#: what :class:`MethodLayer` adds to its zoo's attention module: every adapter's ``convert(model, "softmax")``
#: removes exactly these (and the pre-hook of :func:`accept_legacy_keys`)
LAYER_ATTRIBUTES = ("attention_method", "attention_config", "attention_params", "layer_index")
#: what :class:`MethodModel` adds to its zoo's model (or the module that owns a group of method layers)
MODEL_ATTRIBUTES = ("attention_method", "attention_config", "attention_warmup", "_stock_plus_term",
                    "_warmup_finished")


def strip_attributes(module: nn.Module, names: Tuple[str, ...]) -> None:
    """Remove ``names`` from ``module`` wherever ``nn.Module`` keeps them (plain attribute, submodule, parameter,
    buffer, non-persistent buffer name), and the pre-hook of :func:`accept_legacy_keys`: a module going back to its
    zoo's stock class keeps nothing of ours."""
    _drop_legacy_keys_hook(module)
    for name in names:
        for store in (module._modules, module._parameters, module._buffers):
            store.pop(name, None)
        module._non_persistent_buffers_set.discard(name)
        module.__dict__.pop(name, None)


def settle_submodule(owner: nn.Module, name: str) -> None:
    """After a method switch in place: a submodule the method just made (learnable parameters, the warm-up counter)
    takes its owner's train/eval mode (a counter made in training mode would advance on every forward of a model in
    eval mode); none: the plain ``name = None`` attribute of a module built without it, not a ``None`` submodule
    entry left by the previous method."""
    if name in owner._modules and owner._modules[name] is None:
        del owner._modules[name]
        owner.__dict__[name] = None
    child = owner._modules.get(name)
    if child is not None:
        child.train(owner.training)


# ------------------------------------------------------------------------------------ finish_warmup
_FINISHERS: List[Callable[[nn.Module], bool]] = []


def register_warmup_finisher(finisher: Callable[[nn.Module], bool]) -> None:
    """For adapters whose models hold the warm-up elsewhere than a :class:`MethodModel` (transformers keeps it in
    ``config`` and a counter per model): ``finisher(model)`` finishes that model's warm-up in place and returns
    whether it found a method there."""
    if finisher not in _FINISHERS:
        _FINISHERS.append(finisher)


def finished_config(config: Any) -> Any:
    """``config`` without its warm-up (``warmup_steps=0``): the method at its final parameters."""
    return config.replace(warmup_steps=0) if getattr(config, "warmup_steps", 0) else config


def finish_warmup(model: nn.Module) -> nn.Module:
    """End a model's gain warm-up: the model, in place, at its final parameters on the fixed path.

    A model fine-tuned with ``warmup_steps=N`` scales its method's term by ``min(1, t / N)``, a tensor read from
    its counter at every forward. After ``finish_warmup`` the model has no counter (its ``state_dict`` loses the
    ``attention_warmup.step`` key) and its config has ``warmup_steps=0``: the method runs at scale 1 with fixed gains
    (Python floats; learnable gains as trained). In timm and transformers that is the path of a model built
    without warm-up. In mmseg and fairseq, whose warm-up runs the zoo's fused attention plus the method's term, the
    finished model keeps that form (the fused kernel and the method path differ in rounding, about 1e-6): a model
    rebuilt from its saved config takes the method path. That is exactly the function of the model warmed up to ``t >= N``; a model
    stopped earlier (``t < N``) jumps to its final parameters, which one warning says. Learnable parameters are
    kept as trained. A model without warm-up is returned unchanged. Call it before inference or export.

    Returns ``model`` (changed in place). Raises ``TypeError`` for a model without any attention method of
    pid-plugins (a stock model: nothing to finish).
    """
    found = False
    for name, module in model.named_modules():
        if isinstance(module, (MethodLayer, MethodModel)):
            found = True
            if module.attention_method is not None:
                module.attention_config = finished_config(module.attention_config)
        if isinstance(module, MethodModel) and module.attention_warmup is not None:
            counter = module.attention_warmup
            warn_unfinished_warmup(counter, name or type(model).__name__)
            module.attention_warmup = None
            if getattr(module, "_stock_plus_term", False):  # keep the warmed-up form, at scale 1 (not saved)
                one = torch.ones((), dtype=counter.scale().dtype, device=counter.step.device)
                module.register_buffer("_warmup_finished", one, persistent=False)
    for finisher in _FINISHERS:
        found = finisher(model) or found
    if not found:
        raise TypeError(
            f"finish_warmup: {type(model).__name__} has no attention method of pid-plugins (a stock model has no "
            "warm-up to finish); give it a model built or converted with a method"
        )
    return model


def warn_unfinished_warmup(counter: GainWarmup, where: str) -> None:
    """One warning when a counter is dropped before ``t`` reached ``N`` (the model jumps to scale 1); for adapters
    whose finisher (:func:`register_warmup_finisher`) drops counters of their own."""
    step = int(counter.step)
    if step < counter.warmup_steps:
        logger.warning("finish_warmup: %s had warmed up %d of %d steps (scale %.3f); it now runs at its final "
                       "parameters (scale 1)", where, step, counter.warmup_steps, step / counter.warmup_steps)
