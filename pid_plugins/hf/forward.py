"""Every forward of a transformers model with a method (:class:`MethodForward`): checks its :class:`Plan`, refuses
what cannot run exactly, hands the forward a :class:`~pid_plugins.hf.attention.MethodForwardState`."""
from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass
from itertools import repeat
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from transformers.cache_utils import Cache, EncoderDecoderCache

from .attention import STATE_KEYWORD, MethodForwardState
from .cache import new_cache, static_past
from .config import WARMUP_ATTR, WARMUP_SOURCE, ConfigReading, method_of
from .internals import INTERFACE_SOURCE
from ..versions import InternalChanged

__all__ = ["GAINS_SOURCE", "PLAN", "MethodForward", "Plan", "checkpointing_layout", "drops_layers", "hooked",
           "layout", "unhook"]

PLAN, FORWARD = "_pid_plugins_plan", "_pid_plugins_forward"  # in a model's __dict__: its Plan, its MethodForward
GAINS_SOURCE = "_pid_plugins_gains_config"  # in a nested model's __dict__: the outermost model's config
LAYERDROP_KEYS = ("layerdrop", "encoder_layerdrop", "decoder_layerdrop")


@dataclass(eq=False)
class Plan:
    """What a forward of one model reads, worked out once from the model's structure (discovery)."""

    renew: Callable[..., "Plan"]  # discovery's renew(model, plan, changed, renamed=None)
    name: str  # the method it was made for
    owns_layers: bool
    cache_position: Optional[int]  # index of the cache keyword among the positional arguments, if any
    cache_keywords: tuple = ()
    learnable: bool = False  # whether discovery gave the self-attention modules their gains
    causal: bool = False  # whether a self-attention module it owns is causal (a decoder)
    counter: Optional[nn.Module] = None  # the model's own warm-up counter at discovery
    layerdrop: tuple = ()  # the owner and the modules below it with a ``layerdrop`` attribute
    layerdrop_keys: tuple = ()  # the config's LAYERDROP_KEYS
    first: bool = True  # the first forward has checks to make (``renew`` makes them)
    verified: bool = False  # an eager forward ran the method in its attention layers
    #: the steps from the model to each attention module (``parent._modules``, name), every module's ``__dict__``,
    #: those with a ``gradient_checkpointing`` flag, and the key of torch's composable-API registry
    parents: tuple = ()
    steps: tuple = ()
    nodes: tuple = ()
    flagged: tuple = ()
    registry: str = ""
    registered: list = dataclasses.field(default_factory=list)  # the registries as last read
    hooks_mark: int = -1  # RemovableHandle.next_id when they were read (-1: never)
    signature: list = dataclasses.field(default_factory=list)  # layout(plan) when the plan was made
    checkpointing: list = dataclasses.field(default_factory=list)  # checkpointing_layout(plan) then
    #: activation checkpointing found, as refusals: transformers' reentrant (in training), torch's reentrant wrapper
    #: (with autograd), a KV cache under torch's checkpointing; and transformers' checkpointing on a layer
    reentrant: Optional[str] = None
    wrapper: Optional[str] = None
    wrapped: Optional[str] = None
    checkpointed: bool = False
    reading: Optional[ConfigReading] = None  # what the model's config said at the last forward
    read: Optional[Callable[..., ConfigReading]] = None  # discovery's read(model) (under torch.compile)

    def __setstate__(self, state: dict) -> None:
        """A plan copied with its model holds ``__dict__`` copies no module uses: read again."""
        self.__dict__.update(state)
        self.signature = []
        self.hooks_mark = -1


def layout(plan: Plan) -> list:
    """The way from the model to its attention modules now (each step's module), compared by identity."""
    return list(map(dict.get, plan.parents, plan.steps))


def checkpointing_layout(plan: Plan) -> list:
    """The activation checkpointing on the plan's modules now: transformers' flags (and the layers' functions), then
    torch's composable-API registries, read again only when a hook was registered since (``checkpoint(module)``)."""
    flagged = plan.flagged
    entries = list(map(dict.get, flagged, repeat("gradient_checkpointing", len(flagged))))
    if any(entries):
        entries.append([d.get("_gradient_checkpointing_func") for d, on in zip(flagged, entries) if on])
    mark = RemovableHandle.next_id
    if mark != plan.hooks_mark:
        found = list(map(dict.get, plan.nodes, repeat(plan.registry, len(plan.nodes))))
        plan.registered = [found, list(map(len, filter(None, found)))] if any(found) else []
        plan.hooks_mark = mark
    entries += plan.registered
    return entries


class MethodForward:
    """``model.forward`` of a model with a method (an instance attribute, as accelerate's): the forward it replaced,
    handed the method's per-forward state; not a forward hook, so that dynamo traces one frame."""

    def __init__(self, model: nn.Module, inner: Optional[Callable[..., Any]] = None) -> None:
        self.model = model
        self.inner = inner  # an instance forward it wraps (accelerate's), else None
        self.active = True

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        model = self.model
        forward = self.inner or type(model).forward.__get__(model)
        if not self.active:  # taken off while another wrapper held on to it
            return forward(*args, **kwargs)
        prepared = _before_forward(model, args, kwargs)
        if prepared is not None:
            args, kwargs = prepared
        output = forward(*args, **kwargs)
        _after_forward(model, args, kwargs, output)
        return output

    @property
    def __signature__(self) -> inspect.Signature:
        return inspect.signature(self.inner or type(self.model).forward.__get__(self.model))


def hooked(model: nn.Module) -> bool:
    """Whether ``model`` runs :class:`MethodForward` (:func:`unhook` takes it off)."""
    return FORWARD in model.__dict__


def unhook(model: nn.Module) -> None:
    """Give ``model`` back the forward it had before :func:`hook`."""
    ours = model.__dict__.pop(FORWARD, None)
    if ours is None:
        return
    ours.active = False
    if model.__dict__.get("forward") is ours:
        if ours.inner is None:
            del model.__dict__["forward"]
        else:
            model.__dict__["forward"] = ours.inner


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def drops_layers(model: nn.Module, plan: Plan) -> bool:
    """Whether this forward of ``model`` may skip layers on purpose (layer dropout in training mode)."""
    if not model.training:
        return False
    if any((getattr(m, "layerdrop", 0) or 0) > 0 for m in plan.layerdrop):
        return True
    config = getattr(model, "config", None)
    return any(_number(value := getattr(config, key, None)) and value > 0 for key in plan.layerdrop_keys)


def _warmup_scale(module: nn.Module, gains: Any, name: str) -> Optional[torch.Tensor]:
    """This forward's warm-up scale (None without warm-up); refused if warm-up has no counter."""
    steps = getattr(gains, "warmup_steps", 0)
    if not steps:
        return None
    counter = module._modules.get(WARMUP_ATTR)
    if counter is None:
        counter = module.__dict__.get(WARMUP_SOURCE)
    if counter is None:
        raise ValueError(
            f"the model's attention parameters set warmup_steps={steps} but {type(module).__name__} has no warm-up "
            f"counter (it was built before config.{name} asked for warm-up): call pid_plugins.hf.convert(model, "
            f"{name!r}) once to add it"
        )
    if counter.warmup_steps != steps:
        counter.warmup_steps = steps
    return counter.scale()


def _renew(module: nn.Module, plan: Plan, changed: bool) -> Plan:
    """Discovery's :func:`~pid_plugins.hf.discovery.renew`; a changed model is refused under torch.compile."""
    if changed and torch.compiler.is_compiling():
        name = getattr(module.config, "_attn_implementation", None)
        raise RuntimeError(
            f"attn_implementation={name!r}: {type(module).__name__} changed after it was prepared for it (switched, "
            "its config or its modules replaced, its warm-up counter or learnable parameters), and torch.compile "
            f"reached the forward: call pid_plugins.hf.convert(model, {name!r}) (or run one eager forward) before "
            "compiling")
    return plan.renew(module, plan, changed)


def _before_forward(module: nn.Module, args: tuple, kwargs: dict) -> Optional[tuple[tuple, dict]]:
    """The forward's arguments with its state, after the checks that depend on no tensor (None: no state)."""
    config = module.config
    plan: Optional[Plan] = module.__dict__.get(PLAN)
    if plan is None:
        chosen = getattr(config, "_attn_implementation", None)
        raise RuntimeError(f"attn_implementation={chosen!r}: {type(module).__name__} was not prepared for it: call "
                           f"pid_plugins.hf.convert(model, {chosen!r})")
    reading = plan.reading
    compiling = torch.compiler.is_compiling()  # (dynamo guards the modules)
    if reading is None or not reading.holds(config, module.__dict__.get(GAINS_SOURCE, config), compiling):
        if compiling:  # read, not stored (a stored reading would be guarded on)
            reading = plan.read(module)
        else:
            plan = _renew(module, plan, False)  # the config changed: read again
            reading = plan.reading
    method = reading.method
    if method is None:  # switched to a stock implementation
        return None
    grad = torch.is_grad_enabled()
    if plan.name != method.name or plan.counter is not module._modules.get(WARMUP_ATTR) or (
            reading.gains_learnable and not plan.learnable) or (
            plan.owns_layers and not compiling and (layout(plan) != plan.signature or (
                (grad or module.training) and checkpointing_layout(plan) != plan.checkpointing))):
        plan = _renew(module, plan, True)  # the model changed
        reading = plan.reading
    elif not compiling and plan.first:
        plan = _renew(module, plan, False)
        reading = plan.reading
    gains = reading.gains
    if reading.refusal is not None:  # transformers' PP
        raise ValueError(reading.refusal)
    if not plan.owns_layers:
        return None
    scale = _warmup_scale(module, gains, method.name) if reading.warmup else None
    training = module.training
    if grad:
        if plan.reentrant is not None and training:
            raise ValueError(plan.reentrant)
        if plan.wrapper is not None:
            raise ValueError(plan.wrapper)
    base = reading.base
    if base != "eager" and (kwargs.get("output_attentions") or reading.output_attentions):
        raise ValueError(
            f"output_attentions needs the eager base attention under attention method {method.name!r}: "
            f"pid_plugins.hf.convert(model, {method.name!r}, base='eager')"
        )
    cache = None
    for keyword in plan.cache_keywords:
        cache = kwargs.get(keyword)
        if cache is not None:
            break
    if cache is None and plan.cache_position is not None and len(args) > plan.cache_position:
        cache = args[plan.cache_position]
    if cache is None:  # a release that passes the cache under a new keyword: refused (InternalChanged)
        for name, value in kwargs.items():
            if isinstance(value, Cache) and name not in plan.cache_keywords:
                plan.renew(module, plan, True, name)
    use_cache = kwargs.get("use_cache")
    if use_cache is None:
        use_cache = reading.use_cache
    if grad and plan.wrapped is not None and training and (cache is not None or use_cache):
        raise ValueError(plan.wrapped)
    active = not reading.zero
    restart = bool(method.state_fields) and training and drops_layers(module, plan)
    # transformers' checkpointed layers drop the cache in training (GradientCheckpointingLayer): so does the slot
    layers_cache = not (method.cache_slot and training and plan.checkpointed)
    if cache is None and method.cache_slot and active and layers_cache and plan.causal and \
            plan.cache_position is not None and len(args) <= plan.cache_position and use_cache:
        # the model would make its cache where the method cannot keep its slot (Twicing's A v): made here
        cache = new_cache(config)
        kwargs[plan.cache_keywords[0]] = cache
    own = cache.self_attention_cache if isinstance(cache, EncoderDecoderCache) else cache
    if method.keys_state and own is not None and active:
        sliding = getattr(own, "is_sliding", None)
        if sliding and any(sliding) and not all(sliding):
            raise ValueError(
                f"attention method {method.name!r} reads earlier layers' values at every key position, but this "
                f"{type(module).__name__}'s cache mixes sliding-window and full-attention layers, which keep different "
                "key positions: decode with use_cache=False, or use a model whose layers all attend alike"
            )
    past = static_past(cache, method.name, compiling) if cache is not None else None
    traced = not compiling and torch._C._is_tracing()
    chosen = reading.chosen if scale is None and not traced else None
    state = MethodForwardState(gains, base, past, scale, method, cached=cache is not None,
                               cache=own if method.cache_slot and layers_cache else None, restart=restart,
                               zero=not active, chosen=chosen)
    if chosen is None and scale is None and not compiling and not traced:
        reading.chosen = state.chosen()
    if traced:
        state.update = None
    state.grad = grad
    state.verify = not plan.verified and not compiling and not drops_layers(module, plan)
    kwargs[STATE_KEYWORD] = state
    return args, kwargs


def _after_forward(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
    """The first eager forward ran the method in its layers (else transformers' interface changed); warm-up steps."""
    run = kwargs.get(STATE_KEYWORD)
    if run is not None:
        run.finished = True
        plan = module.__dict__.get(PLAN) if run.verify else None
        if plan is not None:
            if not run.calls:
                raise InternalChanged(INTERFACE_SOURCE.message(
                    f"{type(module).__name__}'s forward ran none of its attention layers through the method"))
            plan.verified = True
    # once per training forward of the outermost model, after it: checkpointed layers recompute with the state's scale
    counter = module._modules.get(WARMUP_ATTR)
    if counter is not None and module.training and method_of(module.config) is not None:
        counter.advance()
