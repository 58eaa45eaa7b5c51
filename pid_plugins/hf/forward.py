"""What runs on every forward of a transformers model with a method: :class:`MethodForward`, its ``forward``.
It checks by identity that the model's :class:`Plan` holds (else renews it), refuses what cannot run exactly, hands
the forward a fresh :class:`~pid_plugins.hf.attention.MethodForwardState` and advances the gain warm-up after it."""
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

PLAN = "_pid_plugins_plan"  # in a model's __dict__: its Plan
FORWARD = "_pid_plugins_forward"  # in a model's __dict__: its MethodForward
GAINS_SOURCE = "_pid_plugins_gains_config"  # in a nested model's __dict__: the outermost model's config
#: the config keys transformers' layer dropout reads (BART, Whisper, M2M100: ``*_layerdrop``; wav2vec2: ``layerdrop``)
LAYERDROP_KEYS = ("layerdrop", "encoder_layerdrop", "decoder_layerdrop")


@dataclass(eq=False)
class Plan:
    """What a forward of one model reads, worked out once from the model's structure (discovery)."""

    #: discovery's: (model, plan, changed, renamed) -> the plan to use; ``changed``: the plan is stale;
    #: ``renamed``: a forward got the KV cache under a keyword the plan does not know (refused)
    renew: Callable[..., "Plan"]
    name: str  # the method it was made for
    owns_layers: bool
    cache_position: Optional[int]  # index of the cache keyword among the positional arguments, if any
    cache_keywords: tuple = ()  # the keywords its forward takes the KV cache under
    learnable: bool = False  # whether discovery gave the self-attention modules their gains
    causal: bool = False  # whether a self-attention module it owns is causal (a decoder)
    counter: Optional[nn.Module] = None  # the model's own warm-up counter at discovery
    layerdrop: tuple = ()  # the owner and the modules below it with a ``layerdrop`` attribute
    layerdrop_keys: tuple = ()  # the config's ``*layerdrop`` keys (LAYERDROP_KEYS it has)
    first: bool = True  # the first forward has checks to make (``renew`` makes them)
    verified: bool = False  # an eager forward found its attention layers running the method (:func:`_verify`)
    #: the modules on the way from the model to each attention module: ``(parent._modules, name)`` of each step,
    #: each module's ``__dict__``, and of those the ones with transformers' ``gradient_checkpointing`` flag
    parents: tuple = ()  # each step's parent ``_modules``
    steps: tuple = ()  # each step's name
    nodes: tuple = ()
    flagged: tuple = ()
    registry: str = ""  # the key of torch's composable-API registry (its ``checkpoint(module)``) in a ``__dict__``
    #: the composable-API registries on ``nodes`` as last read (:func:`checkpointing_layout`), and the number of hooks
    #: registered in the process then (``RemovableHandle.next_id``; -1: never read)
    registered: list = dataclasses.field(default_factory=list)
    hooks_mark: int = -1
    signature: list = dataclasses.field(default_factory=list)  # layout(plan) when the plan was made
    checkpointing: list = dataclasses.field(default_factory=list)  # checkpointing_layout(plan) then
    #: activation checkpointing found on those modules, as refusals (for the plan's method) or where it is
    reentrant: Optional[str] = None  # transformers' reentrant gradient checkpointing (refused in training)
    wrapper: Optional[str] = None  # torch's reentrant checkpoint_wrapper (refused whenever autograd is on)
    wrapped: Optional[str] = None  # the KV-cache refusal where torch's (non-reentrant) checkpointing wraps a module
    checkpointed: bool = False  # transformers' gradient checkpointing is on for a layer
    #: what the model's config said at the last forward (re-read when a watched entry changes)
    reading: Optional[ConfigReading] = None
    #: discovery's: (model) -> a fresh reading of its config (under torch.compile, where it is not stored)
    read: Optional[Callable[..., ConfigReading]] = None

    def __setstate__(self, state: dict) -> None:
        """A plan copied with its model (deepcopy, pickle) holds ``__dict__`` copies no module uses: read again."""
        self.__dict__.update(state)
        self.signature = []
        self.hooks_mark = -1


def layout(plan: Plan) -> list:
    """The way from the model to its attention modules now (each step's module), compared by identity: one
    ``dict.get`` per step (:attr:`Plan.parents`, :attr:`Plan.steps`)."""
    return list(map(dict.get, plan.parents, plan.steps))


def checkpointing_layout(plan: Plan) -> list:
    """The activation checkpointing on the plan's modules now: transformers' ``gradient_checkpointing`` flags (and
    the checkpointed layers' functions), then torch's composable-API registries, read again only when a hook was
    registered in the process since (``checkpoint(module)`` and ``fully_shard`` register hooks on what they mark)."""
    flagged = plan.flagged
    entries = list(map(dict.get, flagged, repeat("gradient_checkpointing", len(flagged))))
    if any(entries):  # the function each checkpointed layer calls (reentrant or not)
        entries.append([d.get("_gradient_checkpointing_func") for d, on in zip(flagged, entries) if on])
    mark = RemovableHandle.next_id
    if mark != plan.hooks_mark:
        found = list(map(dict.get, plan.nodes, repeat(plan.registry, len(plan.nodes))))
        plan.registered = [found, list(map(len, filter(None, found)))] if any(found) else []
        plan.hooks_mark = mark
    entries += plan.registered
    return entries


class MethodForward:
    """``model.forward`` of a transformers model with a method (an instance attribute, as accelerate's hooks set one):
    the forward it replaced, handed the method's per-forward state. Not a forward hook, so that dynamo traces it with
    the forward in one frame (docs/architecture.md); ``inspect.signature`` reads the class's forward."""

    def __init__(self, model: nn.Module, inner: Optional[Callable[..., Any]] = None) -> None:
        self.model = model
        self.inner = inner  # an instance forward it wraps (accelerate's), else None: the class's
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


def hook(model: nn.Module) -> None:
    """Make ``model.forward`` a :class:`MethodForward` (once)."""
    if hooked(model):
        return
    ours = MethodForward(model, model.__dict__.get("forward"))
    model.__dict__[FORWARD] = ours
    model.__dict__["forward"] = ours


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
    if counter.warmup_steps != steps:  # config.<method> changed after the model was built
        counter.warmup_steps = steps
    return counter.scale()


def _renamed_cache(kwargs: dict, known: tuple) -> Optional[str]:
    """The keyword under which a forward got a transformers ``Cache`` that is not one of ``known``, or None."""
    for name, value in kwargs.items():
        if isinstance(value, Cache) and name not in known:
            return name
    return None


def _renew(module: nn.Module, plan: Plan, changed: bool) -> Plan:
    """Discovery's :func:`~pid_plugins.hf.discovery.renew`: the plan (discovered again if ``changed``) with the
    config read again; a changed model is refused under torch.compile (discovery reads source code and the module
    tree), a changed config is read again."""
    if changed and torch.compiler.is_compiling():
        name = getattr(module.config, "_attn_implementation", None)
        raise RuntimeError(
            f"attn_implementation={name!r}: {type(module).__name__} changed after it was prepared for it (switched, "
            "its config or its modules replaced, its warm-up counter or learnable parameters), and torch.compile "
            f"reached the forward: call pid_plugins.hf.convert(model, {name!r}) (or run one eager forward) before "
            "compiling")
    return plan.renew(module, plan, changed)


def _before_forward(module: nn.Module, args: tuple, kwargs: dict) -> Optional[tuple[tuple, dict]]:
    """Hand the forward its :class:`~pid_plugins.hf.attention.MethodForwardState`, after the checks that depend on
    no tensor: the plan and the config's reading still hold (else renewed), and what cannot run exactly is refused."""
    config = module.config
    plan: Optional[Plan] = module.__dict__.get(PLAN)
    if plan is None:
        chosen = getattr(config, "_attn_implementation", None)
        raise RuntimeError(f"attn_implementation={chosen!r}: {type(module).__name__} was not prepared for it: call "
                           f"pid_plugins.hf.convert(model, {chosen!r})")
    reading = plan.reading
    compiling = torch.compiler.is_compiling()  # (dynamo guards the modules: no layout check)
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
    # (a model whose nested model owns the layers has no modules to check; checkpointing matters only to a forward in
    # training or with autograd on)
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
    # (a release that passes the cache under a new name passes none under the names the plan knows)
    renamed = _renamed_cache(kwargs, plan.cache_keywords) if cache is None else None
    if renamed is not None:
        plan.renew(module, plan, True, renamed)  # refused (InternalChanged), naming the keyword
    use_cache = kwargs.get("use_cache")
    if use_cache is None:  # not passed (or None from an outer model): the config's
        use_cache = reading.use_cache
    if grad and plan.wrapped is not None and training and (cache is not None or use_cache):
        raise ValueError(plan.wrapped)
    active = not reading.zero
    restart = bool(method.state_fields) and training and drops_layers(module, plan)
    # transformers' checkpointed layers drop the cache in training (GradientCheckpointingLayer): so does the slot
    layers_cache = not (method.cache_slot and training and plan.checkpointed)
    if cache is None and method.cache_slot and active and layers_cache and plan.causal and \
            plan.cache_position is not None and len(args) <= plan.cache_position and use_cache:
        # the model would make its cache inside the forward, where the method cannot reach it to keep its
        # per-position slot (Twicing's A v) next to the keys: make the same cache here and hand it down
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
    # TorchScript tracing (torch.onnx's older exporter) takes core's apply, whose update traces sizes
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


def _verify(module: nn.Module, run: MethodForwardState) -> None:
    """A model's first eager forward: its attention layers reached the method through transformers' attention
    interface (else that interface changed), then no forward is checked."""
    plan = module.__dict__.get(PLAN)
    if plan is None:
        return
    if not run.calls:
        raise InternalChanged(INTERFACE_SOURCE.message(
            f"{type(module).__name__}'s forward ran none of its attention layers through the method"))
    plan.verified = True


def _after_forward(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
    run = kwargs.get(STATE_KEYWORD)
    if run is not None:
        run.finished = True
        if run.verify:
            _verify(module, run)
    # the gain warm-up advances once per training forward of the model that owns the counter (the outermost),
    # after the forward: checkpointed layers recompute with the scale their MethodForwardState holds
    counter = module._modules.get(WARMUP_ATTR)
    if counter is not None and module.training and method_of(module.config) is not None:
        counter.advance()
