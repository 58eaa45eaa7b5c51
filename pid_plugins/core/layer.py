"""What a layer and a model hold for their attention method, once for every adapter: :class:`MethodLayer`,
:class:`MethodModel`, and :func:`replace_module`, how every adapter's ``convert`` switches a module's type."""
from __future__ import annotations

import logging
from typing import Any, Callable, Iterable, List, Optional, Tuple, Type, TypeVar

import torch
from torch import Tensor, nn

from .methods import AttentionMethod, LayerCall, MethodChoice, method_warmup
from .record import RECORD, attach_record, detach_record
from .warmup import GainWarmup

__all__ = [
    "MethodLayer", "MethodModel", "finish_warmup", "register_warmup_finisher", "finished_config", "LAYER_ATTRIBUTES",
    "MODEL_ATTRIBUTES", "strip_attributes", "settle_submodule", "warn_unfinished_warmup", "number_layers",
    "rebuild", "replace_module", "carries_trained_weights", "warn_switch_of_trained_weights", "finish_model_warmup",
]

logger = logging.getLogger(__name__)

class MethodLayer:
    """Mixed into an adapter's attention layer: ``attention_method`` (None for softmax), ``attention_config``,
    ``attention_params`` (the learnable per-layer parameters, a submodule, or None) and ``layer_index`` (0-based in its
    group, set by :func:`number_layers`), which the adapter passes as ``LayerCall.layer``."""

    attention_method: Optional[AttentionMethod]
    attention_config: Any
    attention_params: Optional[nn.Module]
    layer_index: Optional[int] = None

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

    @property
    def method_active(self) -> bool:
        """Whether the layer runs its method (False: softmax, or a config that computes the stock attention)."""
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
    """Mixed into an adapter's model (or the module owning a group of method layers): ``attention_method``,
    ``attention_config`` and ``attention_warmup`` (the :class:`~pid_plugins.core.GainWarmup` counter, a submodule, or
    None)."""

    attention_method: Optional[AttentionMethod]
    attention_config: Any
    attention_warmup: Optional[GainWarmup]

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
        attach_record(self, choice, like)  # what its checkpoints say they are (pid_plugins.core.record)

    def method_scale(self) -> Optional[Tensor]:
        """This forward's warm-up scale, read once per model forward (a training forward advances the counter); None
        on the fixed path, 1 for a finished stock-plus-term model."""
        counter = self.attention_warmup
        if counter is not None:
            return counter()
        return self._buffers.get("_warmup_finished")

    method_active = MethodLayer.method_active


def number_layers(layers: Iterable[MethodLayer]) -> None:
    """Give one group's method layers, in the order the state is threaded, their 0-based ``layer_index``."""
    for index, layer in enumerate(layers):
        layer.layer_index = index


#: what :class:`MethodLayer` adds to its zoo's attention module: every adapter's ``convert(model, "softmax")``
#: removes exactly these
LAYER_ATTRIBUTES = ("attention_method", "attention_config", "attention_params", "layer_index")
#: what :class:`MethodModel` adds to its zoo's model (or the module that owns a group of method layers)
MODEL_ATTRIBUTES = ("attention_method", "attention_config", "attention_warmup", "_stock_plus_term",
                    "_warmup_finished", RECORD)


def strip_attributes(module: nn.Module, names: Tuple[str, ...]) -> None:
    """Remove ``names`` from ``module`` wherever ``nn.Module`` keeps them."""
    if RECORD in names:
        detach_record(module)
    for name in names:
        for store in (module._modules, module._parameters, module._buffers):
            store.pop(name, None)
        module._non_persistent_buffers_set.discard(name)
        module.__dict__.pop(name, None)


ModuleT = TypeVar("ModuleT", bound=nn.Module)


def rebuild(module: nn.Module, kind: Type[ModuleT]) -> ModuleT:
    """A new ``kind`` module holding ``module``'s own parameters, buffers, submodules and hooks (the same objects) and
    its train/eval mode, without running ``kind.__init__``; ``module`` is left unchanged."""
    if not isinstance(module, nn.Module) or not (isinstance(module, kind) or issubclass(kind, type(module))):
        raise TypeError(f"rebuild: a {kind.__name__} can be rebuilt from its own class or a base of it, "
                        f"got {type(module).__name__}")
    new = kind.__new__(kind)
    state = dict(module.__dict__)
    for store in ("_parameters", "_buffers", "_modules"):
        state[store] = dict(state[store])  # new containers holding the same tensors and modules
    state["_non_persistent_buffers_set"] = set(state["_non_persistent_buffers_set"])
    new.__dict__.update(state)
    return new


def replace_module(parent: nn.Module, name: str, kind: Type[ModuleT]) -> ModuleT:
    """Replace ``parent``'s submodule ``name`` by :func:`rebuild` of it as ``kind`` (kept if already one), in place,
    and return it; ``state_dict`` keys, optimizer parameters, hooks and mode are unchanged."""
    old = parent._modules[name]
    if type(old) is kind:
        return old
    new = rebuild(old, kind)
    parent._modules[name] = new
    return new


def carries_trained_weights(model: nn.Module) -> bool:
    """Whether ``model``'s weights are trained rather than as built: some normalisation layer's weight or bias
    entries differ (every zoo initialises them constant). False on the meta device."""
    for module in model.modules():
        if "norm" not in type(module).__name__.lower():
            continue
        for name in ("weight", "bias"):
            param = module._parameters.get(name)
            if param is None or param.numel() < 2 or param.device.type == "meta":
                continue
            with torch.no_grad():
                flat = param.detach().reshape(-1)
                if bool((flat != flat[0]).any()):
                    return True
    return False


def warn_switch_of_trained_weights(model: nn.Module, choice: Optional[MethodChoice], where: str,
                                   current: Any = None) -> None:
    """Log one warning when trained weights are switched to a method that changes the function at full strength
    at once (active parameters, no warm-up): such a model must be fine-tuned into the method with ``warmup_steps``.
    Silent when ``current`` already runs ``choice``."""
    if choice is None or choice.method.is_identity(choice.config) or getattr(choice.config, "warmup_steps", 0):
        return
    if current is not None and (getattr(current, "attention_method", None),
                                getattr(current, "attention_config", None)) == (choice.method, choice.config):
        return
    if not carries_trained_weights(model):
        return
    has_warmup = "warmup_steps" in getattr(choice.config, "__dataclass_fields__", {})
    how = ("fine-tune it with a warm-up that grows the method from 0 ({'warmup_steps': N} in its parameters) "
           if has_warmup else "fine-tune it ")
    logger.warning(
        "%s: trained weights switched to attention method %r at full strength (%s): its outputs will change a lot "
        "until the model is fine-tuned (a softmax checkpoint run with PID's lm gains: SmolLM2-135M's perplexity "
        "58 -> 1.8e8). To keep what the weights learned, %sand see docs/finetuning.md for the recipe measured here "
        "(warm-up, gain scale).", where, choice.method.name, choice.config, how)


def settle_submodule(owner: nn.Module, name: str) -> None:
    """After a switch in place: a submodule the method just made takes its owner's train/eval mode; none leaves
    a plain ``name = None`` attribute."""
    if name in owner._modules and owner._modules[name] is None:
        del owner._modules[name]
        owner.__dict__[name] = None
    child = owner._modules.get(name)
    if child is not None:
        child.train(owner.training)


_FINISHERS: List[Callable[[nn.Module], bool]] = []


def register_warmup_finisher(finisher: Callable[[nn.Module], bool]) -> None:
    """For adapters that keep the warm-up outside a :class:`MethodModel`: ``finisher(model)`` finishes it in place
    and returns whether it found a method."""
    if finisher not in _FINISHERS:
        _FINISHERS.append(finisher)


def finished_config(config: Any) -> Any:
    """``config`` without its warm-up (``warmup_steps=0``): the method at its final parameters."""
    return config.replace(warmup_steps=0) if getattr(config, "warmup_steps", 0) else config


def finish_warmup(model: nn.Module) -> nn.Module:
    """End a model's gain warm-up, in place: the counter dropped (with its ``state_dict`` key), the config at
    ``warmup_steps=0``, learnable parameters as trained (one warning when stopped before ``t = N``). Returns ``model``;
    ``TypeError`` for a model without any attention method of pid-plugins."""
    found = False
    for name, module in model.named_modules():
        if isinstance(module, (MethodModel, MethodLayer)):
            found = True
            finish_model_warmup(module, name or type(model).__name__)
    for finisher in _FINISHERS:
        found = finisher(model) or found
    if not found:
        raise TypeError(
            f"finish_warmup: {type(model).__name__} has no attention method of pid-plugins (a stock model has no "
            "warm-up to finish); give it a model built or converted with a method"
        )
    return model


def finish_model_warmup(module: nn.Module, where: str) -> None:
    """:func:`finish_warmup` of one module holding a model's method: its config final, its counter dropped."""
    if module.attention_method is not None:
        module.attention_config = finished_config(module.attention_config)
    counter = getattr(module, "attention_warmup", None)  # (a MethodLayer has none)
    if counter is None:
        return
    warn_unfinished_warmup(counter, where)
    module.attention_warmup = None
    if getattr(module, "_stock_plus_term", False):  # keep the warmed-up form, at scale 1 (not saved)
        one = torch.ones((), dtype=counter.scale().dtype, device=counter.step.device)
        module.register_buffer("_warmup_finished", one, persistent=False)


def warn_unfinished_warmup(counter: GainWarmup, where: str) -> None:
    """One warning when a counter is dropped before ``t`` reached ``N``; for adapters' own finishers."""
    step = int(counter.step)
    if step < counter.warmup_steps:
        logger.warning("finish_warmup: %s had warmed up %d of %d steps (scale %.3f); it now runs at its final "
                       "parameters (scale 1)", where, step, counter.warmup_steps, step / counter.warmup_steps)
