"""Attention methods by name: PID and any method a user registers. A method changes one self-attention layer's
output from ``q``, ``k``, ``v`` and a *state* handed on by the earlier layers; an adapter makes one
:meth:`AttentionMethod.apply` per layer."""
from __future__ import annotations

import functools
import keyword
import logging
import threading
from typing import Any, Callable, ClassVar, Dict, List, Mapping, NamedTuple, Optional, Tuple

import torch
from torch import Tensor, nn

from .config import MethodConfig, fx_constant
from .heads import move_heads
from .warmup import GainWarmup, make_warmup

__all__ = [
    "AttentionMethod", "AttentionContext", "CacheSlot", "LayerCall", "StockPath", "MethodConfig", "MethodChoice",
    "MissingLayerState", "missing_state_message",
    "register_method", "get_method", "find_method", "list_methods",
    "resolve_attention", "on_register", "reserve_names", "method_warmup", "calls_once", "makes_state", "update_once",
    "SOFTMAX",
]

logger = logging.getLogger(__name__)

#: the attention choice that means "the zoo's stock attention, no method"
SOFTMAX = "softmax"

Attend = Callable[[Tensor, Tensor], Tensor]


class AttentionContext(NamedTuple):
    """What an adapter knows about one attention call, for :meth:`AttentionMethod.check`."""

    causal: bool = False  #: each position attends to itself and earlier positions only
    cached: bool = False  #: the keys/values include positions that are not queries here (a KV cache)
    dropout: bool = False  #: attention dropout is active in this call
    grouped: bool = False  #: fewer key/value heads than query heads (grouped-query attention)


class AttentionMethod:
    """One layer-coupled attention method: ``name``, ``config_type`` (with ``coerce(value, default=)``),
    ``state_fields`` and :meth:`update`, and the capabilities it needs from an adapter (docs/methods/custom.md).
    Adapters call only :meth:`apply` and :meth:`configure`."""

    name: ClassVar[str]
    config_type: ClassVar[Any]
    state_fields: ClassVar[Tuple[str, ...]]
    #: the preset each zoo starts from (``{"timm": "deit", "*": ...}``)
    default_presets: ClassVar[Mapping[str, str]] = {}
    #: :meth:`update` is ``out + term(value_q, state)``: a fused stock layer plus the term (:class:`StockPath`)
    additive: ClassVar[bool] = True
    #: the state is built from every key position's values (cached ones included), not only the query rows
    keys_state: ClassVar[bool] = False
    #: :meth:`prepare` reads which keys each query attends to (``visible=``)
    reads_visible: ClassVar[bool] = False
    #: :meth:`attend` stores a per-position tensor next to the layer's cached keys/values (``slot=``)
    cache_slot: ClassVar[bool] = False
    #: :meth:`attend` calls the zoo's attention once with each position's values mixed with its state
    mixes_values: ClassVar[bool] = False
    #: :meth:`update` computes each head from that head's state only: tensor parallelism may shard the state
    per_head_state: ClassVar[bool] = False

    def configure(self, value: Any = None, zoo: str = "*", default: Any = None) -> Any:
        """The frozen parameters for ``value`` (instance, dict of overrides, preset name or None) over ``default``
        (else this zoo's default preset)."""
        if default is None:
            default = self.default_presets.get(zoo, self.default_presets.get("*"))
        return self.config_type.coerce(value, default=default)

    def check(self, config: Any, context: AttentionContext) -> None:
        """Refuse (``ValueError``) a call the method cannot compute exactly. Default: refuse nothing."""

    def is_identity(self, config: Any) -> bool:
        """Whether ``config`` computes the stock attention exactly (adapters then run the stock path)."""
        return bool(getattr(config, "is_zero", False))

    def make_learned(self, config: Any) -> Optional[nn.Module]:
        """One layer's learnable parameters (registered as ``attention_params``), or None for fixed parameters."""
        if getattr(config, "learnable", False):
            raise ValueError(f"attention method {self.name!r} has no learnable parameters: set learnable=False")
        return None

    def layer_params(self, config: Any, learned: Optional[nn.Module], layer: Optional[int] = None) -> Any:
        """What one layer's rule reads (``params``): by default the config; ``layer``: the index in its group."""
        return config

    def require_layer(self, layer: Optional[int]) -> int:
        """``layer``, or a ``ValueError`` naming this method when the adapter passed none."""
        if layer is None:
            raise ValueError(f"attention method {self.name!r} reads the layer's index within its group of layers, but "
                             "the adapter passed none: an adapter must call it with LayerCall(..., layer=i), i the "
                             "0-based position of the layer among the layers it threads the method's state through (a "
                             "layer called outside its model has none)")
        return layer

    def make_state(self, *tensors: Optional[Tensor]) -> Tuple[Optional[Tensor], ...]:
        """The state from its flat tensors (as adapters thread it through checkpointed blocks)."""
        return tuple(tensors)

    def prepare(self, params: Any, query: Tensor, value: Tensor, state: Optional[tuple],
                visible: Optional[Tensor] = None) -> Tensor:
        """Before attention: the queries the attention uses (default: unchanged); ``visible``: a boolean
        ``(B or 1, 1, q, K)`` mask of the keys each query sees, or None."""
        return query

    def attend(self, params: Any, attend: Attend, query: Tensor, value: Tensor, state: Optional[tuple] = None,
               head_dim: int = -3, slot: Optional["CacheSlot"] = None) -> Tensor:
        """How the method calls the zoo's attention (default: once, ``A v``)."""
        return attend(query, value)

    def update(self, params: Any, out: Tensor, value_q: Tensor, state: Optional[tuple], scale: Optional[Tensor],
               head_dim: int) -> Tuple[Tensor, tuple]:
        """After attention: the layer's output from the attention output and the state for the next layer."""
        raise NotImplementedError

    def bind_update(self, config: Any, head_dim: int) -> Optional[Callable[..., Tuple[Tensor, tuple]]]:
        """:meth:`update` bound to fixed ``config`` for every layer of a forward (an adapter's hot path); None when
        :meth:`layer_params` is overridden."""
        if type(self).layer_params is not AttentionMethod.layer_params:
            return None
        return functools.partial(self.update, config, scale=None, head_dim=head_dim)

    def apply(self, config: Any, learned: Optional[nn.Module], call: "LayerCall",
              state: Optional[tuple]) -> Tuple[Tensor, tuple]:
        """One layer, the call every adapter makes: the layer's attention output and the next layer's state."""
        return _apply(self, config, learned, call, state)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"

    def __fx_create_arg__(self, tracer: Any) -> Any:  # a constant of a torch.fx graph (the leaves take the method)
        return fx_constant(self, tracer)


class CacheSlot:
    """A per-layer store next to a layer's cached keys/values: ``slot(rows)`` stores ``(B, H, q, D)`` and returns
    it for every key position ``(B, H, K, D)``."""

    def __call__(self, rows: Tensor) -> Tensor:  # pragma: no cover - the interface
        raise NotImplementedError

    def past(self, k_len: int) -> Optional[Tuple[Tensor, Tensor]]:
        """For one query over ``k_len`` keys: the stored rows at every key position, zero at the query's own,
        ``(B, H, K, D)``, and that position as a one-hot column ``(K, 1)``; None: not offered (two calls)."""
        return None


class StockPath(NamedTuple):
    """The zoo's fused attention layer under warm-up of an additive method: ``output() + project_term(term)``."""

    output: Callable[[], Tensor]
    project_term: Callable[[Tensor], Tensor]


class LayerCall(NamedTuple):
    """One attention call of one layer, as its adapter knows it: ``query`` ``(B, H, q, D)``, ``value``
    ``(B, H_kv, K, D)``, ``layer`` the index in its group; ``state_route`` ends :class:`MissingLayerState`."""

    attend: Optional[Attend]
    query: Optional[Tensor]
    value: Optional[Tensor]
    value_q: Tensor
    head_dim: int = -3
    context: AttentionContext = AttentionContext()
    scale: Optional[Tensor] = None
    visible: Optional[Callable[[], Optional[Tensor]]] = None
    slot: Optional[Callable[[], Optional["CacheSlot"]]] = None
    project: Optional[Callable[[Tensor], Tensor]] = None
    stock: Optional[StockPath] = None
    layer: Optional[int] = None
    restart: bool = False
    state_route: Optional[str] = None


class MissingLayerState(RuntimeError):
    """A layer after its group's first got no state from the layers before it (a pipeline stage, a loop)."""


#: what :class:`MissingLayerState` says when the adapter gave no ``state_route``
DEFAULT_STATE_ROUTE = ("Run the group's layers in one forward of the model, which threads the state from layer to "
                       "layer, or hand the previous layer's state to this one.")


def missing_state_message(method: "AttentionMethod", layer: int, route: Optional[str] = None) -> str:
    """The message of :class:`MissingLayerState` for ``method`` at ``layer``, ending with ``route``."""
    fields = ", ".join(method.state_fields)
    return (
        f"attention method {method.name!r}: layer {layer} of its group got no state from the layers before it. The "
        f"method hands ({fields}) from layer to layer within one forward, so layer {layer} would silently take itself "
        f"for the group's first layer. Its forward started in the middle of the group: pipeline parallelism (a stage "
        f"that starts at layer {layer}), or a loop that calls the layers one by one. {route or DEFAULT_STATE_ROUTE}"
    )


def _fx_check(method: AttentionMethod, config: Any, context: AttentionContext, query: Tensor) -> Tensor:
    method.check(config, AttentionContext(*(bool(flag) for flag in context)))
    return query


def _fx_update(method: AttentionMethod, params: Any, out: Tensor, value_q: Tensor, state: Optional[tuple],
                  scale: Optional[Tensor], head_dim: int) -> Tuple[Tensor, tuple]:
    return method.update(params, out, value_q, state, scale, head_dim)


torch.fx.wrap("_fx_check")
torch.fx.wrap("_fx_update")

#: the torch.fx leaves of :meth:`AttentionMethod.apply`; a zoo with its own tracer registers each (timm)
FX_LEAVES: Tuple[Callable[..., Any], ...] = (_fx_check, _fx_update)
__all__ += ["FX_LEAVES"]


def _apply(method: AttentionMethod, config: Any, learned: Optional[nn.Module], call: LayerCall,
           state: Optional[tuple]) -> Tuple[Tensor, tuple]:
    kind = _kind_of(method)
    params = method.layer_params(config, learned, layer=call.layer)
    if state is None:
        previous = None
        if call.layer and method.state_fields and not call.restart:
            # the state rule: a later layer never starts a new state silently (LayerCall)
            raise MissingLayerState(missing_state_message(method, call.layer, call.state_route))
    else:  # flat tensors (threaded through checkpointed blocks) become the method's state; its own state is kept
        previous = method.make_state(*state) if kind.makes_state and type(state) is tuple else state
    value_q = call.value_q
    traced = isinstance(value_q, torch.fx.Proxy)
    if call.stock is not None and call.scale is not None and method.additive:
        _fx_check(method, config, call.context, value_q)
        term, new_state = _fx_update(method, params, torch.zeros_like(value_q), value_q, previous, call.scale,
                                     call.head_dim)
        return call.stock.output() + call.stock.project_term(term), new_state
    if call.attend is None or call.query is None or call.value is None:
        raise ValueError(f"attention method {method.name!r}: the adapter gave no attention to call (attend, query, "
                         "value) and no stock path for this call")
    query = call.query
    if traced:  # torch.fx: the refusals are a leaf of the graph (the context is known when the graph runs)
        query = _fx_check(method, config, call.context, query)
    elif kind.checks:
        context = call.context
        if not (type(context.causal) is bool and type(context.cached) is bool and type(context.dropout) is bool
                and type(context.grouped) is bool):
            context = AttentionContext(*(bool(flag) for flag in context))
        method.check(config, context)
    if kind.once:  # the common case: the zoo's attention once, then the update
        out = call.attend(query, call.value)
    else:
        if method.reads_visible:
            query = method.prepare(params, query, call.value, previous,
                                   visible=call.visible() if call.visible is not None else None)
        else:
            query = method.prepare(params, query, call.value, previous)
        if method.cache_slot:
            out = method.attend(params, call.attend, query, call.value, previous, call.head_dim,
                                slot=call.slot() if call.slot is not None else None)
        else:
            out = method.attend(params, call.attend, query, call.value, previous, call.head_dim)
    state_values = move_heads(call.value, -3, call.head_dim) if method.keys_state else value_q
    if traced:
        out, new_state = _fx_update(method, params, out, state_values, previous, call.scale, call.head_dim)
    else:
        out, new_state = method.update(params, out, state_values, previous, call.scale, call.head_dim)
    return (call.project(out) if call.project is not None else out), new_state


def update_once(method: AttentionMethod, config: Any, out: Tensor, value_q: Tensor, state: Optional[tuple],
                head_dim: int, layer: Optional[int] = None, restart: bool = False,
                state_route: Optional[str] = None) -> Tuple[Tensor, tuple]:
    """:meth:`AttentionMethod.apply` of a method that :func:`calls_once`, fixed parameters, no warm-up, after the
    attention (``out``): the eager adapters' hot path."""
    if state is None:
        if layer and method.state_fields and not restart:
            raise MissingLayerState(missing_state_message(method, layer, state_route))
    elif type(state) is tuple and type(method).make_state is not AttentionMethod.make_state:  # (_Kind.makes_state)
        state = method.make_state(*state)
    return method.update(method.layer_params(config, None, layer), out, value_q, state, None, head_dim)


class _Kind(NamedTuple):  # what _apply reads of a method's class, decided once per class: it overrides...
    once: bool  # ...neither prepare nor attend
    checks: bool  # ...check
    makes_state: bool  # ...make_state


@functools.lru_cache(maxsize=None)
def _kind(kind: type) -> _Kind:
    return _Kind(kind.prepare is AttentionMethod.prepare and kind.attend is AttentionMethod.attend,
                 kind.check is not AttentionMethod.check, kind.make_state is not AttentionMethod.make_state)


def _kind_of(method: AttentionMethod) -> _Kind:  # (uncached under torch.compile)
    cls = type(method)
    return _kind.__wrapped__(cls) if torch.compiler.is_compiling() else _kind(cls)


def calls_once(method: AttentionMethod) -> bool:
    """Whether :meth:`AttentionMethod.apply` (fixed parameters, no warm-up) is the zoo's attention once, then
    :meth:`~AttentionMethod.update`: an adapter's hot path may make the two calls itself."""
    kind = _kind_of(method)
    return kind.once and not kind.checks


def makes_state(method: AttentionMethod) -> bool:
    """Whether the method overrides :meth:`~AttentionMethod.make_state` (state handed over as plain tensors)."""
    return _kind_of(method).makes_state


_METHODS: Dict[str, AttentionMethod] = {}
_LISTENERS: List[Callable[[AttentionMethod], None]] = []
_LOCK = threading.RLock()
#: per zoo, the names it holds for something that is not ours, each with what it is
_RESERVED: Dict[str, Callable[[], Mapping[str, str]]] = {
    "pid_plugins": lambda: {SOFTMAX: "the stock attention of every zoo (attention='softmax')"},
}


def reserve_names(zoo: str, reserved: Callable[[], Mapping[str, str]]) -> None:
    """Declare the names ``zoo`` holds (``reserved()`` maps each to what it is); :func:`register_method` refuses
    them."""
    with _LOCK:
        names = reserved()
        clash = sorted(name for name in _METHODS if name in names)
        if clash:
            raise ValueError(_reserved_message(clash[0], zoo, names[clash[0]]))
        _RESERVED[zoo] = reserved


def _reserved_message(name: str, zoo: str, what: str) -> str:
    return f"attention method name {name!r} is taken by {zoo}: {what}. Give the method another name (e.g. 'my_{name}')"


def register_method(method: AttentionMethod, *, replace: bool = False) -> AttentionMethod:
    """Register ``method`` under ``method.name`` (adapters learn of it at once); returns ``method``."""
    if not isinstance(method, AttentionMethod):
        raise TypeError(f"register_method takes an AttentionMethod instance, got {type(method).__name__}")
    name = getattr(method, "name", None)
    if not isinstance(name, str) or not name.isidentifier() or keyword.iskeyword(name):
        raise ValueError(f"attention method name must be a Python identifier, got {name!r}")
    for attr in ("config_type", "state_fields"):
        if not hasattr(method, attr):
            raise TypeError(f"attention method {name!r} sets no {attr}")
    if not callable(getattr(method.config_type, "coerce", None)):
        raise TypeError(f"attention method {name!r}: config_type {method.config_type!r} has no coerce(value, default)")
    with _LOCK:
        for zoo, reserved in _RESERVED.items():
            if (what := reserved().get(name)) is not None:
                raise ValueError(_reserved_message(name, zoo, what))
        if name in _METHODS and _METHODS[name] is not method and not replace:
            raise ValueError(f"attention method {name!r} is already registered; pass replace=True to replace it")
        _METHODS[name] = method
        listeners = list(_LISTENERS)
    for listener in listeners:
        listener(method)
    return method


def get_method(name: str) -> AttentionMethod:
    """The method registered as ``name``."""
    method = find_method(name)
    if method is None:
        raise ValueError(f"unknown attention method {name!r}: choose {SOFTMAX!r} or one of {list_methods()} "
                         "(pid_plugins.register_method adds one)")
    return method


def find_method(name: Any) -> Optional[AttentionMethod]:
    """The method registered as ``name``, or None (not registered, or not a string)."""
    return _METHODS.get(name) if isinstance(name, str) else None


def list_methods() -> List[str]:
    """The registered method names, sorted."""
    return sorted(_METHODS)


def on_register(listener: Callable[[AttentionMethod], None]) -> None:
    """Call ``listener(method)`` for every method registered so far and later."""
    with _LOCK:
        _LISTENERS.append(listener)
        current = list(_METHODS.values())
    for method in current:
        listener(method)


class MethodChoice(NamedTuple):
    """A resolved attention choice: the method and its validated parameters."""

    method: AttentionMethod
    config: Any


def resolve_attention(
    attention: Optional[str],
    params: Any = None,
    *,
    zoo: str,
    default: Any = None,
    learnable: bool = True,
    where: str = "this model",
    params_name: str = "attention_cfg",
) -> Optional[MethodChoice]:
    """The policy every adapter applies: ``None`` for ``"softmax"`` (parameters given: one warning), else the
    method (None: ``"pid"``) and its parameters over ``default`` or ``zoo``'s preset."""
    if attention == SOFTMAX:
        if params is not None:
            logger.warning("%s: attention='softmax', the stock attention: the method parameters also given (%s) are "
                           "not used", where, _describe_params(params_name, params))
        return None
    if attention is None:
        attention = "pid"
    if not isinstance(attention, str) or attention not in _METHODS:
        raise ValueError(f"{where}: unknown attention method {attention!r}: choose {SOFTMAX!r} or one of "
                         f"{list_methods()} (pid_plugins.register_method adds one)")
    method = _METHODS[attention]
    presets = getattr(method.config_type, "preset_names", None)
    if isinstance(params, str) and (params in _METHODS or params == SOFTMAX) and \
            params not in (presets() if callable(presets) else ()):
        raise ValueError(f"{where}: {params_name}={params!r} names an attention method, not parameters of "
                         f"{attention!r}: pass the method as attention={params!r} (and its parameters, if any, as "
                         f"{params_name})")
    config = method.configure(params, zoo, default)
    if getattr(config, "learnable", False) and not learnable:
        raise ValueError(f"{where}: learnable gains are not supported here ({method.name}, learnable=True); use "
                         "fixed ones")
    return MethodChoice(method, config)


def _describe_params(keyword: str, params: Any) -> str:
    """``params`` for a log line: a dict's keys, a preset's name, or the config's type."""
    if isinstance(params, Mapping):
        return f"{keyword}={{{', '.join(map(repr, params))}}}"
    if isinstance(params, str):
        return f"{keyword}={params!r} (a preset)"
    return f"{keyword}={type(params).__name__}(...)"


def method_warmup(choice: Optional["MethodChoice"], like: Optional[Tensor] = None,
                  current: Optional[GainWarmup] = None, *, stock_plus_term: bool = False,
                  where: str = "this model") -> Optional[GainWarmup]:
    """The gain warm-up counter a model built with ``choice`` carries (None: none); ``stock_plus_term`` refuses a
    method that is not additive."""
    config = choice.config if choice is not None else None
    steps = getattr(config, "warmup_steps", 0) or 0
    if steps and stock_plus_term and not choice.method.additive:
        raise ValueError(f"{where}: warmup_steps={steps} runs the zoo's own attention plus attention method "
                         f"{choice.method.name!r}'s term, but that method is not additive (it has no separate term): "
                         "set warmup_steps=0")
    return make_warmup(steps, current, like=like)
