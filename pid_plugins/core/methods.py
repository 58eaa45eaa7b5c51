"""Attention methods by name: PID, and any method a user registers beside it.

A method changes what one self-attention layer computes from its queries ``q``, keys ``k`` and values ``v`` (per
head, before the output projection) and from a *state* that the earlier layers of the same forward pass handed on
(PID: the first layer's values, the running error and the last error). Every zoo adapter knows only where q/k/v and
the attention call live and how its layers are looped; everything else is asked of the method, through one call
per layer:

.. code-block:: python

    choice = resolve_attention("pid", {"lambda_p": 0.5}, zoo="timm")   # None for "softmax"
    method, config = choice.method, choice.config                      # frozen, validated parameters
    learned = method.make_learned(config)                              # per-layer parameters, or None
    # per layer, per forward:
    call = LayerCall(attend, q, v, v_q, head_dim=-3, context=AttentionContext(causal=False), scale=scale,
                     layer=index)                                      # the layer's 0-based index in its group
    out, state = method.apply(config, learned, call, state)

``attend(q, v)`` is the zoo's own attention with everything else bound (keys, mask, dropout, scale): it returns
``A v`` per head, in the layout the zoo's output projection reads (``head_dim`` says where the heads are). ``v_q``
are the values of the query positions (the last rows with a KV cache) in that layout, ``state`` is ``None`` at the
group's first layer and afterwards whatever the previous layer returned (a tuple of tensors or ``None``\\ s with the
method's ``state_fields``, so adapters can thread it as flat tensors through checkpointed blocks). ``layer`` is the
layer's 0-based index in that group (a Python int the adapter knows from the model's structure: a constant for
torch.fx and torch.compile); a method reads it in :meth:`~AttentionMethod.layer_params`. ``scale`` is the
gain warm-up factor of this forward (``None``: no warm-up), see :mod:`pid_plugins.core.warmup`. :class:`LayerCall`
also carries what only some methods read (``visible``, a cache ``slot``: built on demand), the layer's output
projection and the zoo's own fused layer (``stock``, the warm-up path of additive methods). :meth:`AttentionMethod.apply`
chooses the path: the refusals of :meth:`~AttentionMethod.check`, then the stock layer plus the method's term, the
zoo's attention once and the update, or the method's own ``prepare``/``attend``.

A method is registered by name with :func:`register_method`; :func:`get_method` and :func:`list_methods` read the
registry. The transformers adapter registers every method with ``AttentionInterface`` under its name
(``attn_implementation="<name>"``), the other adapters accept ``attention="<name>"``. Method parameters are a frozen,
validated config (:class:`MethodConfig` gives presets, dict round trip and validation from a dataclass).
"""
from __future__ import annotations

import functools
import keyword
import logging
import threading
from typing import Any, Callable, ClassVar, Dict, List, Mapping, NamedTuple, Optional, Tuple

import torch
from torch import Tensor, nn

from .config import MethodConfig, fx_constant
from .warmup import GainWarmup, make_warmup

__all__ = [
    "AttentionMethod", "AttentionContext", "CacheSlot", "LayerCall", "StockPath", "MethodConfig", "MethodChoice",
    "MissingLayerState", "missing_state_message",
    "register_method", "get_method", "list_methods",
    "resolve_attention", "on_register", "reserve_names", "method_warmup", "SOFTMAX",
]

logger = logging.getLogger(__name__)

#: the attention choice that means "the zoo's stock attention, no method"
SOFTMAX = "softmax"

Attend = Callable[[Tensor, Tensor], Tensor]


class AttentionContext(NamedTuple):
    """What an adapter knows about one attention call, for :meth:`AttentionMethod.check` (all False: a
    bidirectional, uncached self-attention without dropout and with as many key/value heads as query heads)."""

    causal: bool = False  #: each position attends to itself and earlier positions only
    cached: bool = False  #: the keys/values include positions that are not queries here (a KV cache)
    dropout: bool = False  #: attention dropout is active in this call
    grouped: bool = False  #: fewer key/value heads than query heads (grouped-query attention)


class AttentionMethod:
    """One layer-coupled attention method. The contract, in three parts:

    * **what a method must give:** ``name``, ``config_type``, ``state_fields`` and :meth:`update` (the layer's output
      from ``A v``, the query positions' values and the previous layer's state);
    * **what it may override** (each default is the plain case): :meth:`prepare` / :meth:`attend` (it changes the
      queries or calls attention more than once), :meth:`check` (contexts it refuses), :meth:`make_learned` and
      :meth:`layer_params` (learnable parameters; a rule that depends on the layer's index), :meth:`is_identity`;
    * **what it needs from an adapter, as capabilities** (class attributes, all off by default but ``additive``):
      ``keys_state``, ``reads_visible``, ``cache_slot``, ``mixes_values``, ``additive``; and ``default_presets``.

    Adapters call :meth:`apply` (and :meth:`configure`) only: they never branch on a method's type, and a method
    registered by a user runs in every zoo with no adapter change.

    Class attributes:
        name: the name users pick it by (``attention="<name>"``, ``attn_implementation="<name>"``).
        config_type: the parameters' type; ``config_type.coerce(value, default=preset)`` normalises what users pass
            (an instance, a dict of overrides, a preset name, None). :class:`PIDConfig` and :class:`MethodConfig`
            subclasses qualify. Optional fields it may have: ``learnable`` (bool), ``warmup_steps`` (int), and
            ``is_zero`` (True when the method computes the stock attention exactly).
        state_fields: the names of the tensors one layer hands to the next (a fixed number; entries may be None).
        default_presets: the preset each zoo starts from (``{"timm": "deit", ...}``); a zoo not listed uses
            ``default_presets["*"]``.
        additive: :meth:`update` is ``out + term(value_q, state)`` (the update of zero attention output is the term):
            an adapter whose stock attention is a fused kernel the method path does not reproduce bit for bit may run
            that kernel and add the term under warm-up (:class:`StockPath`).
    """

    name: ClassVar[str]
    config_type: ClassVar[Any]
    state_fields: ClassVar[Tuple[str, ...]]
    default_presets: ClassVar[Mapping[str, str]] = {}
    additive: ClassVar[bool] = True
    #: the state is built from the values of every key position (``value_q`` in :meth:`update` is then all key
    #: positions' values, cached ones included), not only the query rows: value residual's ``v^1``, Elliptical's
    #: previous values. Adapters with a KV cache pass accordingly (without a cache the two are the same).
    keys_state: ClassVar[bool] = False
    #: :meth:`prepare` reads which keys each query attends to (``visible=``): Elliptical's prefix mean
    reads_visible: ClassVar[bool] = False
    #: :meth:`attend` stores a per-position tensor next to the layer's cached keys/values (``slot=``): Twicing's
    #: ``A v`` of past positions
    cache_slot: ClassVar[bool] = False
    #: :meth:`attend` calls the zoo's attention once, on the queries it was given, with each position's values mixed
    #: with the same position's state (value residual): an engine that caches the values its attention is given
    #: (vLLM's paged cache) holds them mixed, and needs the state at its new positions only
    mixes_values: ClassVar[bool] = False

    # --------------------------------------------------------------------------------------- parameters
    def configure(self, value: Any = None, zoo: str = "*", default: Any = None) -> Any:
        """The frozen parameters for ``value`` (instance, dict of overrides, preset name or None) over ``default``
        (a config or preset name; else this zoo's default preset)."""
        if default is None:
            default = self.default_presets.get(zoo, self.default_presets.get("*"))
        return self.config_type.coerce(value, default=default)

    def check(self, config: Any, context: AttentionContext) -> None:
        """Refuse (``ValueError`` saying what to change) an attention call the method cannot compute exactly, before
        anything is computed; adapters call it at every layer call with what they know. Default: every context."""

    def is_identity(self, config: Any) -> bool:
        """Whether the method with ``config`` computes the stock attention exactly (adapters then run the stock
        code path, bit for bit)."""
        return bool(getattr(config, "is_zero", False))

    def make_learned(self, config: Any) -> Optional[nn.Module]:
        """One layer's learnable parameters (a module the adapter registers on the attention layer as
        ``attention_params``), or None for fixed parameters."""
        if getattr(config, "learnable", False):
            raise ValueError(f"attention method {self.name!r} has no learnable parameters: set learnable=False")
        return None

    def layer_params(self, config: Any, learned: Optional[nn.Module], layer: Optional[int] = None) -> Any:
        """What one layer's rule reads (the ``params`` of :meth:`prepare`, :meth:`attend` and :meth:`update`): the
        config, or the learned values when the layer has them (default: the config).

        ``layer`` is the layer's 0-based index within its group (:attr:`LayerCall.layer`: the layers the adapter
        threads the state through, in order), or None when the adapter gave none. A rule that depends on where the
        layer sits (Twicing's and Elliptical's ``from_layer``) reads it here, through :meth:`require_layer`, and
        returns what its layer computes: the index is a Python int, so a branch on it is a constant for torch.fx
        and torch.compile, and the state stays the tensors layers hand on."""
        return config

    def require_layer(self, layer: Optional[int]) -> int:
        """``layer`` (see :meth:`layer_params`), or a ``ValueError`` naming this method when the adapter passed
        none."""
        if layer is None:
            raise ValueError(
                f"attention method {self.name!r} reads the layer's index within its group of layers, but the adapter "
                "passed none: an adapter must call it with LayerCall(..., layer=i), i the 0-based position of the layer "
                "among the layers it threads the method's state through (a layer called outside its model has none)"
            )
        return layer

    # ----------------------------------------------------------------------------------------- the rule
    def make_state(self, *tensors: Optional[Tensor]) -> Tuple[Optional[Tensor], ...]:
        """The state from its flat tensors (as adapters thread it through checkpointed blocks)."""
        return tuple(tensors)

    def prepare(self, params: Any, query: Tensor, value: Tensor, state: Optional[tuple],
                visible: Optional[Tensor] = None) -> Tensor:
        """Before attention: the queries the attention uses (default: unchanged). ``visible`` (adapters pass it
        to methods with ``reads_visible``): a boolean ``(B or 1, 1, q, K)`` tensor, True where query ``i`` attends
        to key ``j`` (causal mask, padding and sliding window applied), or None when every query sees every key."""
        return query

    def attend(self, params: Any, attend: Attend, query: Tensor, value: Tensor, state: Optional[tuple] = None,
               head_dim: int = -3, slot: Optional["CacheSlot"] = None) -> Tensor:
        """How the method calls the zoo's attention (default: once, ``A v``). ``state``: the previous layer's;
        ``head_dim``: where ``attend``'s output has its heads (the values have them at -3). ``attend`` also takes
        values with as many heads as the queries when the keys have fewer (grouped-query attention: the keys are
        expanded for that call). ``slot`` (adapters pass it to methods with ``cache_slot``): see
        :class:`CacheSlot`."""
        return attend(query, value)

    def update(self, params: Any, out: Tensor, value_q: Tensor, state: Optional[tuple], scale: Optional[Tensor],
               head_dim: int) -> Tuple[Tensor, tuple]:
        """After attention: the layer's output from the attention output and the state for the next layer."""
        raise NotImplementedError

    def apply(self, config: Any, learned: Optional[nn.Module], call: "LayerCall",
              state: Optional[tuple]) -> Tuple[Tensor, tuple]:
        """One layer: the one call every adapter makes. ``config`` and ``learned`` are the layer's parameters (its
        :meth:`make_learned` module or None), ``call`` what the adapter knows (:class:`LayerCall`), ``state`` the
        previous layer's (flat tensors or this method's state; None at the group's first layer). Returns the layer's
        attention output (projected when the call has ``project``) and the state for the next layer.

        Order: :meth:`check` (refusals before anything is computed), :meth:`layer_params` (with ``call.layer``); then
        the zoo's stock layer plus the method's term (the update of zeros) when the call has a stock path under warm-up (additive methods), else
        :meth:`prepare`, :meth:`attend` (the zoo's attention once when the method keeps both defaults) and
        :meth:`update`."""
        return _apply(self, config, learned, call, state)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"

    def __fx_create_arg__(self, tracer: Any) -> Any:  # a constant of a torch.fx graph (the leaves take the method)
        return fx_constant(self, tracer)


class CacheSlot:
    """A per-layer store next to a layer's cached keys/values, for a method that needs a tensor of its own at every
    past key position (Twicing: ``A v``). ``slot(rows)`` takes the method's tensor for the query rows,
    ``(B, H, q, D)``, stores it where the cache keeps this layer's keys (so the zoo's own cache machinery reorders
    it for beam search, crops it, keeps it in static buffers and sliding windows) and returns it for every key
    position, ``(B, H, K, D)``, aligned with the values ``attend`` reads. Without a cache it returns ``rows``."""

    def __call__(self, rows: Tensor) -> Tensor:  # pragma: no cover - the interface
        raise NotImplementedError


class StockPath(NamedTuple):
    """The zoo's own attention layer (a fused kernel the method path does not reproduce bit for bit), for the
    warm-up of additive methods: the layer output is ``output() + project_term(term)``, so a zero warm-up scale gives
    the stock layer exactly."""

    #: the stock layer's output, after its output projection (computed only when this path is taken)
    output: Callable[[], Tensor]
    #: a per-head tensor (heads at the call's ``head_dim``) through the output projection's weight, without bias
    project_term: Callable[[Tensor], Tensor]


class LayerCall(NamedTuple):
    """One attention call of one layer, as its adapter knows it: what :meth:`AttentionMethod.apply` reads.

    Layouts: ``query`` ``(B, H, q, D)`` and ``value`` ``(B, H_kv, K, D)`` as ``attend`` takes them; ``attend``'s output
    and ``value_q`` (the query positions' values) have their heads at ``head_dim`` (-3: ``(B, H, q, D)``, -2:
    ``(B, q, H, D)``). ``visible`` and ``slot`` are built only for the methods that read them (``reads_visible``,
    ``cache_slot``). ``project``: the layer's output projection (head layout in, layer output out), for adapters
    that own it; ``apply`` then returns the projected output. ``stock``: the zoo's own fused layer, for adapters
    that have one; under warm-up (``scale`` given) additive methods add their term to it. A call with ``stock`` and
    ``scale`` needs only ``value_q`` (``attend``, ``query`` and ``value`` may be None). ``layer``: the layer's
    0-based index within its group (the layers the adapter threads the method's state through, in order; separate
    groups such as an encoder and a decoder count from 0 each), a Python int fixed when the model is built or
    converted; :meth:`AttentionMethod.layer_params` receives it. None: the adapter does not know it (a method that
    needs it refuses the call, :meth:`AttentionMethod.require_layer`).

    The state rule (one place for every adapter, in :meth:`AttentionMethod.apply`): a layer with ``layer > 0`` of a
    method with cross-layer state (non-empty ``state_fields``) never starts a new state silently. It gets the previous
    layer's state, or ``restart`` is True (the adapter knows every earlier layer of the group was skipped on purpose
    in this forward: the model's own layer dropout in training; the layer then starts the state afresh, as the
    group's first layer does), or the call raises :class:`MissingLayerState`, whose message ends with
    ``state_route``: the adapter's words for the supported way to run the layer with its state (None: a generic
    sentence). Methods without cross-layer state (Twicing) and calls without an index are not affected."""

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
    """A layer that is not its group's first (:attr:`LayerCall.layer` > 0) got no state from the layers before it,
    under a method that hands state from layer to layer: it would silently take itself for the group's first layer.
    What cuts the state: pipeline parallelism (a stage whose forward starts in the middle of the group), a loop that
    calls the layers one by one. The message names the layer, the method, and the supported way."""


#: what :class:`MissingLayerState` says when the adapter gave no ``state_route``
DEFAULT_STATE_ROUTE = ("Run the group's layers in one forward of the model, which threads the state from layer to "
                       "layer, or hand the previous layer's state to this one.")


def missing_state_message(method: "AttentionMethod", layer: int, route: Optional[str] = None) -> str:
    """The message of :class:`MissingLayerState` for ``method`` at ``layer`` (0-based index in its group) with the
    adapter's ``route`` (the supported way)."""
    fields = ", ".join(method.state_fields)
    return (
        f"attention method {method.name!r}: layer {layer} of its group got no state from the layers before it. The "
        f"method hands ({fields}) from layer to layer within one forward, so layer {layer} would silently take itself "
        f"for the group's first layer. Its forward started in the middle of the group: pipeline parallelism (a stage "
        f"that starts at layer {layer}), or a loop that calls the layers one by one. {route or DEFAULT_STATE_ROUTE}"
    )


def _fx_check(method: AttentionMethod, config: Any, context: AttentionContext, query: Tensor) -> Tensor:
    """``method.check(config, context)``, returning ``query`` unchanged: a leaf for torch.fx (a traced model knows
    the context only when the graph runs; the query passing through keeps the call in the graph)."""
    method.check(config, AttentionContext(*(bool(flag) for flag in context)))
    return query


def _fx_update(method: AttentionMethod, params: Any, out: Tensor, value_q: Tensor, state: Optional[tuple],
                  scale: Optional[Tensor], head_dim: int) -> Tuple[Tensor, tuple]:
    """``method.update(...)``: a leaf for torch.fx (timm's and torchvision's feature extraction), whose tracer cannot
    follow the Python shape checks of an update. Its result is a tuple: index it or unpack a fixed number."""
    return method.update(params, out, value_q, state, scale, head_dim)


torch.fx.wrap("_fx_check")
torch.fx.wrap("_fx_update")


def _apply(method: AttentionMethod, config: Any, learned: Optional[nn.Module], call: LayerCall,
           state: Optional[tuple]) -> Tuple[Tensor, tuple]:
    kind = _kind(type(method))
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
    state_values = call.value.movedim(-3, call.head_dim) if method.keys_state else value_q
    if traced:
        out, new_state = _fx_update(method, params, out, state_values, previous, call.scale, call.head_dim)
    else:
        out, new_state = method.update(params, out, state_values, previous, call.scale, call.head_dim)
    return (call.project(out) if call.project is not None else out), new_state


class _Kind(NamedTuple):
    """What :func:`_apply` reads of a method's class, decided once per class (not per layer call)."""

    once: bool  #: the default prepare and attend: the zoo's attention once, then the update
    checks: bool  #: overrides check (the default refuses nothing)
    makes_state: bool  #: overrides make_state


@functools.lru_cache(maxsize=None)
def _kind(kind: type) -> _Kind:
    return _Kind(kind.prepare is AttentionMethod.prepare and kind.attend is AttentionMethod.attend,
                 kind.check is not AttentionMethod.check, kind.make_state is not AttentionMethod.make_state)


def _calls_once(kind: type) -> bool:
    return _kind(kind).once


# ------------------------------------------------------------------------------------------------ registry
_METHODS: Dict[str, AttentionMethod] = {}
_LISTENERS: List[Callable[[AttentionMethod], None]] = []
_LOCK = threading.RLock()
#: per zoo, a function returning the names that zoo holds for something that is not ours, each with what it is
_RESERVED: Dict[str, Callable[[], Mapping[str, str]]] = {
    "pid_plugins": lambda: {SOFTMAX: "the stock attention of every zoo (attention='softmax')"},
}


def reserve_names(zoo: str, reserved: Callable[[], Mapping[str, str]]) -> None:
    """Declare the names ``zoo`` holds for something that is not ours: ``reserved()`` maps each to what it is there,
    and is read at every later registration (names the zoo adds later count too). :func:`register_method` refuses
    them from now on. An adapter calls this on import, before it exposes any method: a method registered earlier
    under one of these names is refused here, so the adapter's import fails with the same message instead of
    rewiring the zoo."""
    with _LOCK:
        names = reserved()
        clash = sorted(name for name in _METHODS if name in names)
        if clash:
            raise ValueError(_reserved_message(clash[0], zoo, names[clash[0]]))
        _RESERVED[zoo] = reserved


def _check_unreserved(name: str) -> None:
    for zoo, reserved in _RESERVED.items():
        what = reserved().get(name)
        if what is not None:
            raise ValueError(_reserved_message(name, zoo, what))


def _reserved_message(name: str, zoo: str, what: str) -> str:
    return f"attention method name {name!r} is taken by {zoo}: {what}. Give the method another name (e.g. 'my_{name}')"


def register_method(method: AttentionMethod, *, replace: bool = False) -> AttentionMethod:
    """Register ``method`` under ``method.name``, an identifier that no zoo holds for something that is not ours
    (``"softmax"``; transformers' ``"sdpa"``, ``"eager"``, ``"flash_attention_2"``, ...: see :func:`reserve_names`).
    Adapters that have been imported learn of it at once (transformers: ``attn_implementation="<name>"`` works from
    now on). ``replace=True`` replaces a method registered here under that name, never a zoo's own. Returns
    ``method``."""
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
        _check_unreserved(name)
        if name in _METHODS and _METHODS[name] is not method and not replace:
            raise ValueError(f"attention method {name!r} is already registered; pass replace=True to replace it")
        _METHODS[name] = method
        listeners = list(_LISTENERS)
    for listener in listeners:
        listener(method)
    return method


def get_method(name: str) -> AttentionMethod:
    """The method registered as ``name``."""
    method = _METHODS.get(name) if isinstance(name, str) else None
    if method is None:
        raise ValueError(
            f"unknown attention method {name!r}: choose {SOFTMAX!r} or one of {list_methods()} "
            "(pid_plugins.register_method adds one)"
        )
    return method


def list_methods() -> List[str]:
    """The registered method names, sorted."""
    return sorted(_METHODS)


def on_register(listener: Callable[[AttentionMethod], None]) -> None:
    """Call ``listener(method)`` for every method registered so far and every one registered later (adapters use
    it to expose methods through their zoo's own registry)."""
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
    """The one policy every adapter applies to what a user asks for: ``None`` for ``"softmax"`` (the stock
    attention), else the registered method and its parameters.

    Args:
        attention: ``"softmax"`` or a registered method's name (None: ``"pid"``). ``"softmax"`` is the stock
            attention whatever parameters the recipe also carries (the A/B flip of one flag): they are not used,
            named in one warning.
        params: the method's parameters (instance, dict of overrides, preset name, None: the zoo's default preset).
        zoo: which adapter asks (``"timm"``, ``"hf"``, ``"mmseg"``, ``"fairseq"``): picks the default preset.
        default: the preset (or config) to start from instead of the zoo's default (e.g. a catalogue entry's).
        learnable: whether this adapter supports learnable parameters (refused with a message otherwise).
        where: names the model or layer in messages.
        params_name: how the user spells the parameters in this zoo (``attention_cfg``, ``--attention-cfg``), for
            messages.
    """
    if attention == SOFTMAX:  # the A/B flip: the recipe keeps the method's parameters, the stock attention ignores them
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
    if isinstance(params, str) and (params in _METHODS or params == SOFTMAX) and params not in _presets(method):
        raise ValueError(
            f"{where}: {params_name}={params!r} names an attention method, not parameters of {attention!r}: pass the "
            f"method as attention={params!r} (and its parameters, if any, as {params_name})"
        )
    config = method.configure(params, zoo, default)
    if getattr(config, "learnable", False) and not learnable:
        raise ValueError(
            f"{where}: learnable gains are not supported here ({method.name}, learnable=True); use fixed ones"
        )
    return MethodChoice(method, config)


def _presets(method: AttentionMethod) -> List[str]:
    """The preset names ``method``'s parameters accept (none when its config type declares none)."""
    names = getattr(method.config_type, "preset_names", None)
    return list(names()) if callable(names) else []


def _describe_params(keyword: str, params: Any) -> str:
    """``params`` for a log line: the keys of a dict, a preset's name, a config's fields that differ from defaults."""
    if isinstance(params, Mapping):
        return f"{keyword}={{{', '.join(map(repr, params))}}}" if params else f"{keyword}={{}}"
    if isinstance(params, str):
        return f"{keyword}={params!r} (a preset)"
    return f"{keyword}={type(params).__name__}(...)"


def method_warmup(choice: Optional["MethodChoice"], like: Optional[Tensor] = None,
                  current: Optional[GainWarmup] = None, *, stock_plus_term: bool = False,
                  where: str = "this model") -> Optional[GainWarmup]:
    """The gain warm-up counter a model built with ``choice`` carries (None: softmax, or no ``warmup_steps`` in the
    method's parameters), see :func:`~pid_plugins.core.warmup.make_warmup`. ``stock_plus_term``: the adapter runs
    warm-up as the zoo's own fused attention plus the method's separate term (``additive``; mmseg,
    fairseq), which only additive methods have: refused otherwise, before anything runs."""
    config = choice.config if choice is not None else None
    steps = getattr(config, "warmup_steps", 0) or 0
    if steps and stock_plus_term and not choice.method.additive:
        raise ValueError(
            f"{where}: warmup_steps={steps} runs the zoo's own attention plus attention method "
            f"{choice.method.name!r}'s term, but that method is not additive (it has no separate term): "
            "set warmup_steps=0"
        )
    return make_warmup(steps, current, like=like)
