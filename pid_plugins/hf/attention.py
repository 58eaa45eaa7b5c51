"""The ``"pid"`` attention implementation for transformers' attention interface.

How it fits transformers (no frame inspection, one path for every way a model becomes PID):

* ``import pid_plugins.hf`` registers ``"pid"`` with ``AttentionInterface`` (the attention function) and
  ``AttentionMaskInterface`` (the base attention's mask function), and a torch module-registration hook that
  gives every :class:`~transformers.PreTrainedModel` built afterwards a forward pre-hook (with kwargs).
  ``to_pid`` gives the hook to models built before the import. The hook does nothing unless the model's
  ``config._attn_implementation`` is ``"pid"``, so ``from_pretrained(..., attn_implementation="pid")``,
  ``from_config``, ``Model(config)``, ``set_attn_implementation("pid")`` and ``to_pid`` all run the same code.
* On a PID model's first forward the hook discovers the model once: every module whose class calls the
  attention interface is an attention module; its role (self- or cross-attention) comes from where it sits
  (``encoder_attn``, ``crossattention``, ``EncDecAttention``, ... or ``is_cross_attention``), its position in
  the layer order from the module tree (no ``layer_idx`` needed). A module named ``*Attention*`` that computes
  attention without the interface (custom code) is refused, naming it.
* Each forward of a module that owns attention layers (a decoder, an encoder, a base model) gets a fresh
  :class:`PIDForwardState` in its keyword arguments; transformers passes them down to every attention call
  and gradient checkpointing captures them with each layer. Gains come from the outermost model's
  ``config.pid`` (T5's stacks keep deep copies of the config).
* The PID term needs the values of the query positions: the last ``q_len`` rows of the value tensor for no
  cache and dynamic caches (sliding-window ones included), ``[past, past + q_len)`` of a static cache, where
  ``past`` is the cache's own length tensor (no ``int()``: compiled decoding does not recompile per step).
* Cross-attention runs the base attention unchanged.
* Learnable gains (``config.pid = {"learnable": True, ...}``): a ``pid_gains`` submodule on every self-attention
  module, made when the model is built (see :mod:`pid_plugins.hf.gains`).
* Refused before anything is computed, with a message: reentrant gradient checkpointing (it cuts the PID
  state's gradient between layers), a static sliding-window cache, ``output_attentions`` without the eager
  base; at the first layer that meets it: one attention module run twice in a forward
  (ALBERT's shared layers).
"""
from __future__ import annotations

import functools
import inspect
import sys
import threading
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional

import torch
from torch import Tensor, nn
from transformers import AttentionInterface, AttentionMaskInterface, PreTrainedModel
from transformers.integrations.flex_attention import flex_attention_forward
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import eager_mask, flex_attention_mask, sdpa_mask

from ..core import (
    AttentionContext, AttentionMethod, CacheSlot, GainWarmup, PIDConfig, PIDMethod, PIDState, LayerCall, expand_heads,
    get_method, make_warmup, on_register, reserve_names,
)
from . import gains as learned_gains

__all__ = [
    "ATTN_IMPLEMENTATION", "BASES", "PIDForwardState", "base_attention", "pid_attention_forward", "pid_mask",
    "install_pid_hooks", "model_method_config", "model_pid_config", "method_of", "to_pid",
]

ATTN_IMPLEMENTATION = "pid"
"""PID's ``attn_implementation`` name (every other registered method is registered under its own name)."""
BASE_ATTR = "pid_attention_base"
BASES = ("sdpa", "eager", "flex_attention")
"""The base attentions a method runs on (``to_pid(model, base=...)``, saved as ``config.pid_attention_base``)."""
_HOOKED = "_pid_plugins_hooked"
_PLAN = "_pid_plugins_plan"
_GAINS_SOURCE = "_pid_plugins_gains_config"
WARMUP_ATTR = "pid_warmup"  # the outermost model's gain warm-up counter (a submodule: `pid_warmup.step`)
_WARMUP_SOURCE = "_pid_plugins_warmup"  # on nested models: the outermost model's counter (not a submodule)
_WARMUP_MISSING_KEY = r"(^|\.)pid_warmup\.step$"
_ROLE = "_pid_plugins_index"  # on attention modules: order among the owner's self-attention, or -1 (cross)
_EARLIER = "_pid_plugins_earlier"  # on self-attention modules: the indices of the earlier layers of its stack, nearest first
_LOCK = threading.Lock()
_CROSS_NAMES = frozenset({"encoder_attn", "crossattention", "cross_attention", "cross_attn", "EncDecAttention",
                          "encoder_decoder_attention"})


class PIDForwardState:
    """The PID state of one forward pass of one layer stack: gains, base attention, static-cache offset
    (None for no cache / dynamic caches), and each self-attention layer's outgoing state by layer order.

    It travels to every attention call in the forward's keyword arguments and is filled in as the layers run,
    so it must reach each layer as the same object. It is therefore deliberately opaque: not a dataclass, a
    NamedTuple or a container, which wrappers rebuild when they walk a forward's arguments (FSDP2's per-layer
    hooks rebuild dataclasses and dicts holding tensors that require grad; DDP and FSDP move and cast tensors
    inside them). A rebuilt copy would take each layer's state away from the layers after it. An opaque
    object is passed by reference by all of them (torch's pytree treats it as a leaf).
    """

    __slots__ = ("method", "config", "base", "past_length", "layers", "finished", "rows", "scale", "params", "zero",
                 "function", "start", "plain", "learnable", "cached", "checks", "cache", "layer_count")

    def __init__(self, config: Any, base: str = "sdpa", past_length: Optional[Tensor] = None,
                 scale: Optional[Tensor] = None, method: Optional[AttentionMethod] = None,
                 cached: bool = False, cache: Any = None, layer_count: int = 0) -> None:
        self.method = method if method is not None else _PID
        self.config = config  # the method's parameters (PID: a PIDConfig)
        self.base = base
        self.scale = scale  # the gain warm-up scale of this forward (None: no warm-up)
        # decided once per forward, not per layer call: the stock attention (zero gains), the base function (None
        # for eager: each model family has its own eager_attention_forward)
        self.zero = self.method.is_identity(config)
        self.learnable = bool(getattr(config, "learnable", False))
        self.cached = cached or past_length is not None  # a cache object was passed to the forward
        self.function = _BASE_FUNCTIONS.get(base)
        self.past_length = past_length
        self.layers: Dict[int, PIDState] = {}
        self.cache = cache  # for methods with a cache slot: the (self-attention) cache the layers update, or None
        self.layer_count = layer_count  # the owner's layer count (1 + the largest layer_idx): where cache slots start
        self.finished = False  # set when the forward returns: later calls are checkpointing's recomputation
        self.rows: Optional[Tensor] = None  # static cache: the query rows of the value buffer (once per pass)
        # static cache, eager, on the CPU: the first query row as a number (a view of the rows, no gather per
        # layer); under torch.compile the length stays a tensor, so decoding steps do not recompile
        self.start: Optional[int] = None
        if past_length is not None and past_length.device.type == "cpu" and not torch.compiler.is_compiling():
            self.start = int(past_length)

    def previous(self, earlier: tuple[int, ...]) -> Optional[PIDState]:
        """The state of the nearest earlier layer of the stack that ran in this forward (``earlier``: the
        stack's earlier layers, nearest first). A layer skipped by layer dropout (BART's ``layerdrop``,
        Whisper's, ...) leaves the hidden states unchanged, and so the PID state too."""
        for index in earlier:
            state = self.layers.get(index)
            if state is not None:
                return state
        return None

    def __repr__(self) -> str:
        return f"PIDForwardState(base={self.base!r}, layers={sorted(self.layers)}, finished={self.finished})"


# ------------------------------------------------------------------------------------------- methods, parameters
_PID = get_method(ATTN_IMPLEMENTATION)
#: the attention methods registered with transformers' interfaces, by implementation name
_METHODS: Dict[str, AttentionMethod] = {}
_PARSED: Dict[Any, Any] = {}


def method_of(config: Any) -> Optional[AttentionMethod]:
    """The attention method a model config runs (``config._attn_implementation`` names a registered method), or None
    (a stock implementation)."""
    return _METHODS.get(getattr(config, "_attn_implementation", None))


def model_method_config(config: Any, method: Optional[AttentionMethod] = None) -> Any:
    """The parameters a model runs its method with: ``config.<method name>`` (``config.pid`` for PID: a dict, a
    PIDConfig or a preset name) over the method's transformers preset (PID: ``lm``; with ``learnable``, the initial
    values of every self-attention layer's own gains). ``method``: default, the one ``config`` runs, else PID."""
    method = method or method_of(config) or _PID
    raw = getattr(config, method.name, None)
    if raw is None or isinstance(raw, str):  # a preset: plain data (no file read, so it traces under compile)
        key: Any = (method.name, raw)
    elif isinstance(raw, dict):
        key = (method.name, tuple(sorted(raw.items())))
    else:
        key = (method.name, raw)
    try:
        cfg = _PARSED.get(key)
    except TypeError:  # unhashable values: let the method's config report them
        key, cfg = None, None
    if cfg is None:
        if torch.compiler.is_compiling():  # building a config is not traceable: parse it eagerly
            raise RuntimeError(
                f"config.{method.name} = {raw!r} was set after the model was built and first read under "
                "torch.compile: call pid_plugins.hf.to_pid(model) (or run one eager forward) before compiling"
            )
        cfg = method.configure(dict(raw) if isinstance(raw, dict) else raw, "hf")
        if getattr(cfg, "learnable", False) and not isinstance(method, PIDMethod):
            raise ValueError(
                f"config.{method.name}: learnable parameters are supported for 'pid' only under transformers; "
                "set learnable=False"
            )
        if key is not None:
            if len(_PARSED) > 256:  # a sweep over many gains: keep the cache small
                _PARSED.clear()
            _PARSED[key] = cfg
    return cfg


def model_pid_config(config: Any) -> PIDConfig:
    """PID's gains of a model config: ``config.pid`` over the ``lm`` preset (:func:`model_method_config` for PID)."""
    return model_method_config(config, _PID)


# --------------------------------------------------------------------------------------- the base attention
def base_attention(config: Any) -> str:
    """The attention PID is added to: ``config.pid_attention_base`` if set, else ``"eager"`` for models with
    attention logit softcapping (Gemma 2; SDPA cannot softcap) and ``"sdpa"`` otherwise."""
    base = getattr(config, BASE_ATTR, None)
    if base is None:
        return "eager" if getattr(config, "attn_logit_softcapping", None) is not None else "sdpa"
    if base not in BASES:
        raise ValueError(f"config.{BASE_ATTR}={base!r} is not one of {BASES}")
    if base != "eager" and getattr(config, "attn_logit_softcapping", None) is not None:
        raise ValueError(
            f"{getattr(config, 'model_type', 'this model')} uses attention logit softcapping, which {base} cannot "
            "compute: use pid_plugins.hf.to_pid(model, base='eager')"
        )
    return base


_BASE_FUNCTIONS = {"sdpa": sdpa_attention_forward, "flex_attention": flex_attention_forward}


def _base_function(module: nn.Module, base: str) -> Callable:
    function = _BASE_FUNCTIONS.get(base)
    return _eager_function(type(module)) if function is None else function


@functools.lru_cache(maxsize=None)
def _eager_function(cls: type) -> Callable:
    fn = getattr(sys.modules.get(cls.__module__), "eager_attention_forward", None)
    if fn is None:
        raise ValueError(f"{cls.__name__}'s module has no eager_attention_forward: use base 'sdpa'")
    return fn


def pid_attention_forward(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Optional[Tensor],
    **kwargs: Any,
) -> tuple[Tensor, Optional[Tensor]]:
    """The base attention (SDPA, eager or flex) with the model's attention method (PID: followed by the PID update);
    ``(B, q, H, D)`` output. Registered under every method's name."""
    run: Optional[PIDForwardState] = kwargs.pop("pid_state", None)
    index = getattr(module, _ROLE, None)
    if index == -1:  # cross-attention: base attention only (its values come from another sequence)
        base = run.base if run is not None else base_attention(getattr(module, "config", None))
        return _base_function(module, base)(module, query, key, value, attention_mask, **kwargs)
    if run is None or index is None:
        chosen = getattr(getattr(module, "config", None), "_attn_implementation", "pid")
        raise RuntimeError(
            f"attn_implementation={chosen!r}: {type(module).__name__} got no per-forward state of attention method "
            f"{chosen!r}. Call pid_plugins.hf.to_pid(model, method={chosen!r}) once (needed for models built before "
            "`import pid_plugins.hf`); a model whose forward does not pass its keyword arguments down to the "
            f"attention layers cannot run {chosen!r}"
        )
    base = run.function or _base_function(module, run.base)
    if run.zero:
        return base(module, query, key, value, attention_mask, **kwargs)
    method = run.method
    learned = None
    if run.learnable:  # this layer's own parameters (PID: lambda_p, lambda_i, lambda_d), else the config's
        learned = getattr(module, learned_gains.GAINS_ATTR, None)
        if learned is None:
            raise RuntimeError(
                f"attn_implementation={method.name!r}: config.{method.name} is learnable but {type(module).__name__} "
                f"has no {learned_gains.GAINS_ATTR}: call pid_plugins.hf.to_pid(model) to add them"
            )
    q_len, length = query.shape[-2], value.shape[-2]
    if run.past_length is None:  # no cache, or a dynamic cache: the query rows end the value tensor
        v_q = value if length == q_len else value.narrow(2, length - q_len, q_len)
    elif run.start is not None and value.device.type == "cpu":  # a static cache, eager: rows [past, past + q_len)
        v_q = value.narrow(2, run.start, q_len)
    else:  # a static cache: rows [past, past + q_len) of the buffer
        if run.rows is None:
            run.rows = run.past_length.to(value.device) + torch.arange(q_len, device=value.device)
        v_q = value.index_select(2, run.rows)
    layers = run.layers
    if index in layers and not run.finished:
        raise RuntimeError(
            f"attn_implementation={method.name!r}: {type(module).__name__} ran twice in one forward (one attention "
            f"module shared by several layers, as in ALBERT): {method.name!r} needs one attention module per layer"
        )
    earlier = getattr(module, _EARLIER, None)  # set by discovery; else the layers before it in index order
    previous = run.previous(tuple(range(index - 1, -1, -1)) if earlier is None else earlier) if layers else None
    weights: Optional[Tensor] = None

    def attend(q: Tensor, v: Tensor) -> Tensor:
        """The base attention with this call's keys, mask and arguments: ``(B, H, q, D)`` in, ``(B, q, H, D)`` out;
        values per query head (Twicing's ``v - A v``) get the keys expanded to match."""
        nonlocal weights
        if v.shape[1] != key.shape[1]:
            return base(_ExpandedHeads(module), q, expand_heads(key, v.shape[1], 1), v, attention_mask, **kwargs)[0]
        out, probabilities = base(module, q, key, v, attention_mask, **kwargs)
        if weights is None:  # the first call's attention weights (eager with output_attentions)
            weights = probabilities
        return out

    call = LayerCall(
        attend, query, value, v_q.transpose(1, 2), head_dim=-2,  # the output's (B, q, heads, D), contiguous for o_proj
        context=AttentionContext(causal=bool(getattr(module, "is_causal", False)),
                                 cached=run.cached or key.shape[-2] != query.shape[-2],
                                 dropout=bool(kwargs.get("dropout", 0.0)), grouped=key.shape[1] != query.shape[1]),
        scale=run.scale,
        visible=lambda: _visible(module, attention_mask, query, key, kwargs),
        slot=lambda: _slot(run, module, q_len, length),
    )
    u, layers[index] = method.apply(run.config, learned, call, previous)
    return u, weights


class _ExpandedHeads:
    """An attention module as a base attention function sees it for a call whose keys were expanded to the query
    heads: ``num_key_value_groups`` is 1 (no second expansion); every other attribute is the module's."""

    num_key_value_groups = 1

    def __init__(self, module: nn.Module) -> None:
        self._module = module

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


def _visible(module: nn.Module, mask: Any, query: Tensor, key: Tensor, kwargs: dict) -> Optional[Tensor]:
    """Which keys each query attends to, boolean ``(B or 1, 1 or H, q, K)``, from the mask the base attention gets
    (boolean: SDPA's; float: eager's, where masked positions hold the dtype's minimum or -inf), or None when every
    query sees every key. Without a mask a causal layer sees keys ``<= past + i`` (dynamic cache)."""
    q_len, k_len = query.shape[-2], key.shape[-2]
    if mask is None:
        causal = kwargs.get("is_causal")
        causal = getattr(module, "is_causal", False) if causal is None else causal
        if not causal or q_len == 1:
            return None
        rows = torch.arange(q_len, device=query.device)[:, None] + (k_len - q_len)
        return (torch.arange(k_len, device=query.device)[None, :] <= rows)[None, None]
    if not isinstance(mask, Tensor):
        raise ValueError(
            f"attention method reads which keys each query attends to, but the base attention's mask is a "
            f"{type(mask).__name__} (flex attention's BlockMask?): use base 'sdpa' or 'eager' "
            "(pid_plugins.hf.to_pid(model, base='sdpa', method=...))"
        )
    mask = mask[..., :k_len]
    if mask.dtype == torch.bool:
        return mask
    return mask > torch.finfo(mask.dtype).min / 2


def _slot(run: PIDForwardState, module: nn.Module, q_len: int, k_len: int) -> Optional[CacheSlot]:
    """Where this layer keeps its method's per-position tensor beside its cached keys/values (None: no cache, the
    keys are the query positions)."""
    cache = run.cache
    if cache is None:
        if k_len != q_len:
            raise ValueError(
                f"attention method {run.method.name!r} keeps a tensor per past position beside the KV cache, but this "
                "forward got the cached keys without the cache object (a cache the model made inside a forward the "
                "method did not see): pass past_key_values=DynamicCache(config=model.config) to the first forward, as "
                "generate() does"
            )
        return None
    layer_idx = getattr(module, "layer_idx", None)
    if not isinstance(layer_idx, int):
        raise ValueError(
            f"attention method {run.method.name!r} keeps a tensor per past position beside the KV cache, which needs "
            f"the attention module's layer_idx; {type(module).__name__} has none: decode with use_cache=False"
        )
    return _LayerSlot(cache, layer_idx, run.layer_count)


class _LayerSlot(CacheSlot):
    """A method's per-position tensor kept in the model's own cache, as an extra cache layer of the same kind as
    layer ``layer_idx``'s (dynamic, sliding-window dynamic or static), at index ``base + layer_idx`` (``base``: the
    model's layer count). Being a layer of the cache, it is reordered by beam search, cropped, reset and kept in a
    static buffer by the cache's own methods, in step with the layer's keys and values."""

    def __init__(self, cache: Any, layer_idx: int, layer_count: int) -> None:
        self.cache, self.layer_idx, self.layer_count = cache, layer_idx, layer_count

    def __call__(self, rows: Tensor) -> Tensor:
        index = _slot_index(self.cache, self.layer_idx, self.layer_count)
        # a cache layer stores a pair: the tensor rides in the values' place, the keys' place holds one column of it
        # (not zero width: cache layers treat an empty key tensor as an empty layer, e.g. when reordering beams)
        _, stored = self.cache.layers[index].update(rows[..., :1], rows)
        return stored


_SLOT_BASE = "_pid_plugins_slot_base"


def _slot_index(cache: Any, layer_idx: int, layer_count: int) -> int:
    """The cache layer that holds layer ``layer_idx``'s slot; the slots of every layer are made on first use."""
    base = cache.__dict__.get(_SLOT_BASE)
    if base is None:
        layers = cache.layers
        base = max(len(layers), layer_count, layer_idx + 1)
        replicate = getattr(cache, "layer_class_to_replicate", None)
        while len(layers) < base:  # a lazily grown cache: the model's layers not reached yet
            if replicate is None:
                raise ValueError(f"{type(cache).__name__} has {len(layers)} layers for a model of {base}")
            layers.append(replicate())
        for i in range(base):
            layers.append(_layer_like(layers[i]))
        cache.__dict__[_SLOT_BASE] = base
    return base + layer_idx


def _layer_like(layer: Any) -> Any:
    """An empty cache layer of ``layer``'s kind and size."""
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer, StaticLayer, StaticSlidingWindowLayer

    kind = type(layer)
    if kind is DynamicLayer:
        return DynamicLayer()
    if kind is DynamicSlidingWindowLayer:
        fresh = DynamicSlidingWindowLayer(sliding_window=layer.sliding_window)
        if getattr(layer, "record_past", False):
            fresh.activate_past_recording()
        return fresh
    if kind is StaticLayer:
        return StaticLayer(max_cache_len=layer.max_cache_len)
    names = (DynamicLayer.__name__, DynamicSlidingWindowLayer.__name__, StaticLayer.__name__)
    raise ValueError(
        f"the attention method keeps a tensor per past position beside the KV cache, in a cache layer of the same kind; "
        f"{kind.__name__} is not one it can make (supported: {', '.join(names)}; not {StaticSlidingWindowLayer.__name__}, "
        "quantized or offloaded layers): use the default dynamic cache or cache_implementation='static'"
    )


def pid_mask(*args: Any, **kwargs: Any):
    """The mask function of the base attention (``config.pid_attention_base``)."""
    base = base_attention(kwargs.get("config"))
    if base == "eager":
        return eager_mask(*args, **kwargs)
    if base == "flex_attention":
        return flex_attention_mask(*args, **kwargs)
    return sdpa_mask(*args, **kwargs)


# ------------------------------------------------------------------------------------ discovery (once per model)
@functools.lru_cache(maxsize=None)
def _calls_interface(cls: type) -> bool:
    """Whether ``cls.forward`` dispatches through transformers' attention interface (transformers' own heuristic)."""
    try:
        return "ALL_ATTENTION_FUNCTIONS" in inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return False


@dataclass
class _Plan:
    owns_layers: bool
    cache_position: Optional[int]  # index of `past_key_values` among the positional arguments, if any
    learnable: bool = False  # whether discovery gave the self-attention modules their gains
    causal: bool = False  # whether a self-attention module it owns is causal (a decoder)
    layer_count: int = 0  # 1 + the largest layer_idx of its self-attention modules (where method cache slots start)
    counter: Optional[nn.Module] = None  # the model's own warm-up counter at discovery (handed to nested models)


def _chosen(model: nn.Module) -> str:
    """The attention implementation a model's config names (for messages)."""
    return str(getattr(getattr(model, "config", None), "_attn_implementation", "pid"))


def _is_cross(parts: list, module: nn.Module) -> bool:
    """Whether an attention module at module path ``parts`` is cross-attention (its values come from another
    sequence: no PID term, no gains)."""
    return bool(getattr(module, "is_cross_attention", False)) or any(p in _CROSS_NAMES for p in parts)


def _learnable_config(config: Any) -> Optional[PIDConfig]:
    """``config.pid`` if the model runs PID with learnable gains, else None (also when config.pid is invalid:
    the first forward reports that)."""
    method = method_of(config)
    if method is None or getattr(config, method.name, None) is None:
        return None
    try:
        cfg = model_method_config(config, method)
    except ValueError:
        return None
    return cfg if getattr(cfg, "learnable", False) else None


def _walk(module: nn.Module, prefix: str = ""):
    """(path, module) below ``module``, not descending into nested PreTrainedModels (they are their own owners)."""
    for name, child in module.named_children():
        path = f"{prefix}.{name}" if prefix else name
        yield path, child
        if not isinstance(child, PreTrainedModel):
            yield from _walk(child, path)


def _discover(model: PreTrainedModel, at_forward: bool = False) -> _Plan:
    """Mark the attention modules ``model`` owns with their role and order; refuse attention outside the interface.
    With learnable gains, give every self-attention module its gains if it has none (and cross-attention none)."""
    gains_source = model.__dict__.get(_GAINS_SOURCE, model.config)
    warmup = _counter(model)
    base = base_attention(gains_source)
    learnable: Optional[PIDConfig] = model_method_config(gains_source)
    learnable = learnable if getattr(learnable, "learnable", False) else None
    added = []
    order = 0
    causal = False
    layer_count = 0
    stacks: Dict[str, tuple[int, ...]] = {}  # self-attention indices seen in each stack (encoder / decoder / model)
    for path, sub in _walk(model):
        if isinstance(sub, PreTrainedModel):
            sub.__dict__[_GAINS_SOURCE] = gains_source
            if warmup is not None:
                sub.__dict__[_WARMUP_SOURCE] = warmup
            else:
                sub.__dict__.pop(_WARMUP_SOURCE, None)
            if getattr(sub, "config", None) is not None:
                setattr(sub.config, BASE_ATTR, base)
            continue
        cls = type(sub)
        if _calls_interface(cls):
            parts = path.split(".")
            cross = _is_cross(parts, sub)
            setattr(sub, _ROLE, -1 if cross else order)
            if cross:
                learned_gains.detach(sub)
            elif learnable is not None and learned_gains.attach(sub, learnable):
                added.append(path)
            if not cross:  # an encoder and a decoder under one owner are separate PID groups
                causal = causal or bool(getattr(sub, "is_causal", False))
                if isinstance(getattr(sub, "layer_idx", None), int):
                    layer_count = max(layer_count, sub.layer_idx + 1)
                stack = next((p for p in parts if "encoder" in p.lower() or "decoder" in p.lower()), "")
                earlier = stacks.get(stack, ())
                setattr(sub, _EARLIER, earlier)
                stacks[stack] = (order, *earlier)
                order += 1
        elif "Attention" in cls.__name__ and not any(
            "Attention" in type(m).__name__ or _calls_interface(type(m)) for m in sub.modules() if m is not sub
        ):
            chosen = _chosen(model)
            raise ValueError(
                f"attn_implementation={chosen!r}: {type(model).__name__}.{path} ({cls.__name__}) computes attention "
                f"without transformers' attention interface (custom or remote code?), so attention method {chosen!r} "
                "cannot reach it"
            )
    params = inspect.signature(type(model).forward).parameters
    names = [n for n in params if n != "self"]
    if order and not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        raise ValueError(
            f"attn_implementation={_chosen(model)!r}: {type(model).__name__}.forward takes no **kwargs, so the "
            "per-forward state of the attention method cannot reach its attention layers"
        )
    _persist(model.config)
    try:  # parse the gains now (cached), so a first forward under torch.compile only looks them up
        model_method_config(gains_source)
    except ValueError:
        pass  # refused with its message at the first forward
    if added:
        learned_gains.ignore_missing(model)
        if at_forward:
            warnings.warn(
                f"attn_implementation='pid': learnable PID gains were added to {type(model).__name__} at its first "
                f"forward ({len(added)} layers, from config.pid): an optimizer built before now does not train "
                "them. Call pid_plugins.hf.to_pid(model) before building the optimizer",
                stacklevel=4,
            )
    plan = _Plan(owns_layers=order > 0,
                 cache_position=names.index("past_key_values") if "past_key_values" in names else None,
                 learnable=learnable is not None, causal=causal, layer_count=layer_count,
                 counter=model._modules.get(WARMUP_ATTR))
    model.__dict__[_PLAN] = plan
    return plan


# ------------------------------------------------------------------------------------------ per-forward checks
def _checkpointing(model: nn.Module) -> bool:
    """Whether a layer of ``model`` has gradient checkpointing on."""
    return any(getattr(m, "gradient_checkpointing", False) for m in model.modules())


def _check_checkpointing(model: nn.Module, name: str = "pid") -> None:
    """Refuse reentrant checkpointing (it cuts the method state's graph between layers) before any gradient."""
    for m in model.modules():
        if getattr(m, "gradient_checkpointing", False) and hasattr(m, "_gradient_checkpointing_func"):
            func = m._gradient_checkpointing_func
            keywords = getattr(func, "keywords", None)
            # torch.utils.checkpoint's default (use_reentrant not given) is reentrant
            if keywords is None or keywords.get("use_reentrant", True) is not False:
                raise ValueError(
                    f"attention method {name!r} needs non-reentrant gradient checkpointing (reentrant checkpointing "
                    "cuts the method state's gradient between layers): use model.gradient_checkpointing_enable("
                    "gradient_checkpointing_kwargs={'use_reentrant': False})"
                )
            return


def _static_past(cache: Any, name: str = "pid") -> Optional[Tensor]:
    """The static cache's length before this forward (a tensor, never synced), None for dynamic caches."""
    layers = getattr(cache, "layers", None)
    if not layers:
        return None
    first = layers[0]
    kind = type(first).__name__
    if any("Static" in type(x).__name__ and "Sliding" in type(x).__name__ for x in layers):
        raise NotImplementedError(
            f"attention method {name!r} cannot use a static sliding-window cache (a rolling buffer does not keep the query "
            "positions' values where they can be located): use the dynamic cache (the default) for this model"
        )
    if "Static" not in kind:
        return None
    length = first.cumulative_length if getattr(first, "is_initialized", False) else None
    return torch.zeros((), dtype=torch.long) if length is None else length.clone()


def _pre_hook(module: nn.Module, args: tuple, kwargs: dict) -> Optional[tuple[tuple, dict]]:
    config = module.config
    method = method_of(config)
    if method is None:
        return None
    plan = module.__dict__.get(_PLAN)
    if plan is None:
        if torch.compiler.is_compiling():  # discovery reads source code and the module tree: not traceable
            raise RuntimeError(
                f"attn_implementation={method.name!r}: {type(module).__name__} was switched to it after it was built, and "
                "torch.compile reached its first forward: call pid_plugins.hf.to_pid(model) (or run one eager "
                "forward) before compiling"
            )
        with _LOCK:
            plan = _discover(module, at_forward=True)
    if plan.counter is not module._modules.get(WARMUP_ATTR):
        # the counter module was replaced after discovery (peft's modules_to_save=["pid_warmup"] wraps it, its
        # merge_and_unload unwraps it): the nested models' layers must read the counter this forward advances
        with _LOCK:
            plan = _discover(module)
    if not plan.owns_layers:
        return None
    gains_config = module.__dict__.get(_GAINS_SOURCE, config)
    gains = model_method_config(gains_config, method)
    if getattr(gains, "learnable", False) and not plan.learnable:  # config.pid became learnable after discovery
        with _LOCK:
            plan = _discover(module, at_forward=True)
    scale = _warmup_scale(module, gains)
    base = base_attention(config)
    if module.training and torch.is_grad_enabled():
        _check_checkpointing(module, method.name)
    if base != "eager" and (kwargs.get("output_attentions") or getattr(config, "output_attentions", False)):
        raise ValueError(
            f"output_attentions needs the eager base attention under attention method {method.name!r}: "
            f"pid_plugins.hf.to_pid(model, base='eager', method={method.name!r})"
        )
    cache = kwargs.get("past_key_values")
    if cache is None and plan.cache_position is not None and len(args) > plan.cache_position:
        cache = args[plan.cache_position]
    active = not method.is_identity(gains)
    # transformers' checkpointed layers drop the cache in training (GradientCheckpointingLayer): so does the slot
    layers_cache = not (method.cache_slot and module.training and _checkpointing(module))
    if cache is None and method.cache_slot and active and layers_cache and plan.causal and \
            plan.cache_position is not None and len(args) <= plan.cache_position and \
            kwargs.get("use_cache", getattr(config, "use_cache", False)):
        # the model would make its cache inside the forward, where the method cannot reach it to keep its
        # per-position slot (Twicing's A v) next to the keys: make the same cache here and hand it down
        cache = _new_cache(config)
        kwargs["past_key_values"] = cache
    own = getattr(cache, "self_attention_cache", cache)  # encoder-decoder: the decoder's own
    if method.keys_state and own is not None and active:
        sliding = getattr(own, "is_sliding", None)
        if sliding and any(sliding) and not all(sliding):
            raise ValueError(
                f"attention method {method.name!r} reads earlier layers' values at every key position, but this "
                f"{type(module).__name__}'s cache mixes sliding-window and full-attention layers, which keep different "
                "key positions: decode with use_cache=False, or use a model whose layers all attend alike"
            )
    slot_cache = own if method.cache_slot and layers_cache else None
    state = PIDForwardState(gains, base, _static_past(cache, method.name), scale, method, cached=cache is not None,
                            cache=slot_cache, layer_count=plan.layer_count)
    kwargs["pid_state"] = state
    return args, kwargs


def _new_cache(config: Any) -> Any:
    """The cache a transformers model makes when ``use_cache`` and no cache is passed: ``DynamicCache(config=...)``,
    in an ``EncoderDecoderCache`` for encoder-decoder models."""
    from transformers import DynamicCache, EncoderDecoderCache

    if getattr(config, "is_encoder_decoder", False):
        return EncoderDecoderCache(DynamicCache(config=config), DynamicCache(config=config))
    return DynamicCache(config=config)


def _post_hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
    run = kwargs.get("pid_state")
    if run is not None:
        run.finished = True
    # the gain warm-up advances once per training forward of the model that owns the counter (the outermost),
    # after the forward: checkpointed layers recompute with the scale their PIDForwardState holds
    counter = module._modules.get(WARMUP_ATTR)
    if counter is not None and module.training and method_of(module.config) is not None:
        counter.advance()


# ------------------------------------------------------------------------------------------------ gain warm-up
def _counter(model: nn.Module) -> Optional[GainWarmup]:
    """The warm-up counter a model's layers read: its own, or the outermost model's (set at discovery)."""
    counter = model._modules.get(WARMUP_ATTR)
    return counter if counter is not None else model.__dict__.get(_WARMUP_SOURCE)


def _warmup_scale(module: nn.Module, gains: Any) -> Optional[Tensor]:
    steps = getattr(gains, "warmup_steps", 0)
    if not steps:
        return None
    counter = _counter(module)
    if counter is None:
        raise ValueError(
            f"the model's attention parameters set warmup_steps={steps} but {type(module).__name__} has no warm-up counter "
            "(it was built before config.pid asked for warm-up): call pid_plugins.hf.to_pid(model) once to add it"
        )
    if counter.warmup_steps != steps:  # config.pid changed after the model was built
        counter.warmup_steps = steps
    return counter.scale()


def _warmup_steps(config: Any) -> int:
    method = method_of(config) or _PID
    if getattr(config, method.name, None) is None:
        return 0
    return getattr(model_method_config(config, method), "warmup_steps", 0)


def _give_counter(model: PreTrainedModel, counter: GainWarmup) -> None:
    # from_pretrained without the counter in the checkpoint: learned_gains.install()'s _initialize_weights zeroes it
    ignore = getattr(model, "_keys_to_ignore_on_load_missing", None)
    model._keys_to_ignore_on_load_missing = {*(ignore or ()), _WARMUP_MISSING_KEY}
    setattr(model, WARMUP_ATTR, counter)


_ANY_COUNTER = [False]  # whether a warm-up counter was ever made (else registrations need no scan)


def _attach_warmup(model: PreTrainedModel, config: Any = None) -> None:
    """Give ``model`` the counter its ``config.pid`` asks for (keeping an existing one's t), or remove it."""
    current = model._modules.get(WARMUP_ATTR)
    steps = getattr(config, "warmup_steps", 0) if config is not None else _warmup_steps(model.config)
    if not steps and current is None:
        return
    param = next(model.parameters(), None)
    counter = make_warmup(PIDConfig(warmup_steps=steps), current, like=param)
    if counter is None:
        del model._modules[WARMUP_ATTR]
        return
    _ANY_COUNTER[0] = True
    if counter is not current:
        _give_counter(model, counter)


def _adopt_counters(model: PreTrainedModel, submodule: nn.Module) -> None:
    """Move the warm-up counters of models nested in ``submodule`` to ``model``: one counter, on the outermost
    model, advanced once per forward of the whole model."""
    for m in submodule.modules():
        if isinstance(m, PreTrainedModel) and m._modules.get(WARMUP_ATTR) is not None:
            counter = m._modules.pop(WARMUP_ATTR)
            plan = m.__dict__.get(_PLAN)
            if plan is not None:  # it reads the outermost model's counter now (set by that model's discovery)
                plan.counter = None
            if model._modules.get(WARMUP_ATTR) is None:
                _give_counter(model, counter)


def _hook(model: PreTrainedModel) -> None:
    if not model.__dict__.get(_HOOKED, False):
        model.register_forward_pre_hook(_pre_hook, with_kwargs=True)
        model.register_forward_hook(_post_hook, with_kwargs=True)
        model.__dict__[_HOOKED] = True


def _on_registration(module: nn.Module, name: str, submodule: Optional[nn.Module]) -> None:
    # PreTrainedModel.__init__ runs nn.Module.__init__ first, so the model's own first child registration
    # reaches here before any forward: every model built after the import carries the (inert) hook
    if not isinstance(module, PreTrainedModel):
        return
    if not module.__dict__.get(_HOOKED, False):
        _check_family(module)
        _hook(module)
        _persist(module.config)  # saved as "pid" whenever the model runs PID at save time, null otherwise
        # the counter exists from construction on, so from_pretrained loads t (config.pid has warmup_steps > 0)
        _attach_warmup(module)
        module.__dict__["post_init"] = functools.partial(_post_init, module)
    if _ANY_COUNTER[0] and submodule is not None and not isinstance(submodule, GainWarmup):
        _adopt_counters(module, submodule)
    if submodule is not None and not isinstance(submodule, PreTrainedModel):
        _attach_gains_at_construction(module, name, submodule)


def _check_family(model: PreTrainedModel) -> None:
    """Refuse, while the model is being built (before its layers exist), a family that picks its attention classes
    from its own table by ``config._attn_implementation`` (GPT-J's ``GPTJ_ATTENTION_CLASSES``, Falcon's, ...) instead
    of calling transformers' attention interface: a method's name is not in that table (transformers itself would
    fail with a bare ``KeyError``), and the family's attention code never calls the method."""
    config = getattr(model, "config", None)
    method = method_of(config)
    if method is None:
        return
    for table_name, keys in _attention_tables(type(model)):
        if method.name not in keys:
            raise ValueError(
                f"attn_implementation={method.name!r}: {type(model).__name__} ({getattr(config, 'model_type', '?')}) "
                f"picks its attention class from its own table {table_name} ({', '.join(map(repr, keys))}) instead of "
                f"transformers' attention interface, so attention method {method.name!r} cannot reach its attention. "
                f"Use one of {list(keys)} for this family, or a family on the attention interface (Llama, Mistral, "
                "Qwen2, GPT-NeoX, ...)"
            )


@functools.lru_cache(maxsize=None)
def _attention_tables(cls: type) -> tuple:
    """``(name, keys)`` of the ``*_ATTENTION_CLASSES`` dicts in the module that defines ``cls``."""
    module = sys.modules.get(cls.__module__)
    return tuple((name, tuple(value)) for name, value in vars(module).items()
                 if name.endswith("_ATTENTION_CLASSES") and isinstance(value, dict)) if module else ()


def _attach_gains_at_construction(model: PreTrainedModel, name: str, child: nn.Module) -> None:
    """A PID model with learnable gains registers ``child`` (its layers are built by then): give each self-attention
    module below it its gains now, so that ``from_pretrained`` loads the saved values into them."""
    cfg = _learnable_config(model.__dict__.get("config"))
    if cfg is None:
        return
    added = False
    for path, sub in [(name, child), *((f"{name}.{p}", m) for p, m in _walk(child))]:
        if not isinstance(sub, PreTrainedModel) and _calls_interface(type(sub)) and not _is_cross(path.split("."), sub):
            added = learned_gains.attach(sub, cfg) or added
    if added:
        learned_gains.ignore_missing(model)


def _post_init(model: PreTrainedModel) -> None:
    """Runs once, as the model's ``post_init`` (the last step of every transformers model's ``__init__``): a model
    built as PID is discovered now, before any forward, so that a first forward under ``torch.compile`` traces no
    discovery. The instance attribute removes itself: later calls reach the class's ``post_init``."""
    model.__dict__.pop("post_init", None)
    type(model).post_init(model)
    if method_of(model.config) is not None and _PLAN not in model.__dict__:
        with _LOCK:
            _discover(model)


torch.nn.modules.module.register_module_module_registration_hook(_on_registration)


# ---------------------------------------------------------------------------------------------- public API
def _plain(value: Optional[str]) -> Optional[str]:
    return value


class _SavedImplementation:
    """``config.attn_implementation``: serialises (``to_dict`` deep-copies the config's attributes) as
    ``"pid"`` when the model runs PID at save time and as null otherwise, so a model switched back with
    ``set_attn_implementation("sdpa")`` reloads with the stock default."""

    def __init__(self, config: Any):
        self._config = weakref.ref(config)

    def _current(self) -> Optional[str]:
        config = self._config()
        return None if config is None else config._attn_implementation

    def __deepcopy__(self, memo: dict) -> Any:
        config = self._config()
        copied = memo.get(id(config)) if config is not None else None
        if copied is not None:  # the config itself is being copied (a deep copy of the model): stay live
            return _SavedImplementation(copied)
        current = self._current()  # to_dict copies the attributes only: the value to save
        return current if current in _METHODS else None

    def __reduce__(self):  # pickling (torch.save of a whole model) stores the value, like deepcopy
        return _plain, (self.__deepcopy__({}),)

    def __eq__(self, other: object) -> bool:
        return self._current() == other

    def __hash__(self) -> int:
        return hash(self._current())

    def __repr__(self) -> str:
        return repr(self._current())


def _persist(config: Any) -> None:
    # transformers does not save `_attn_implementation`; an `attn_implementation` entry in config.json is read
    # back by the config's __init__. It reports the implementation at save time ("pid" or null).
    if not isinstance(config.__dict__.get("attn_implementation"), _SavedImplementation):
        config.attn_implementation = _SavedImplementation(config)


def install_pid_hooks(model: PreTrainedModel) -> PreTrainedModel:
    """Hook every PreTrainedModel in ``model`` (models built before the import) and check it now."""
    with _LOCK:
        for m in model.modules():
            if isinstance(m, PreTrainedModel):
                _hook(m)
                m.__dict__.pop(_PLAN, None)
                m.__dict__.pop(_GAINS_SOURCE, None)
                m.__dict__.pop(_WARMUP_SOURCE, None)
        for m in model.modules():  # outermost first: it hands its config (gains, base) to the nested models
            if isinstance(m, PreTrainedModel) and _PLAN not in m.__dict__:
                _discover(m)
    _persist(model.config)
    return model


def to_pid(model: PreTrainedModel, config: Any = None, base: Optional[str] = None, *,
           method: str = ATTN_IMPLEMENTATION) -> PreTrainedModel:
    """Switch a transformers model to PID attention (or another registered ``method``) in place, weights untouched,
    and return it.

    ``config``: the method's parameters: for PID a :class:`PIDConfig`, a dict of overrides of the ``lm`` preset, a
    preset name, or None (keep ``model.config.pid`` if set, else the ``lm`` preset); saved as ``config.<method>``.
    ``base``: the attention the method is added to, ``"sdpa"`` (default; ``"eager"`` for models with logit
    softcapping), ``"eager"`` (attention weights) or ``"flex_attention"``; saved in ``config.pid_attention_base``.
    """
    chosen = get_method(method)
    if config is not None or not hasattr(model.config, chosen.name):
        cfg = chosen.configure(config, "hf", default=model_method_config(model.config, chosen))
        setattr(model.config, chosen.name, cfg.to_dict())
    cfg = model_method_config(model.config, chosen)
    if not getattr(cfg, "learnable", False):  # fixed parameters: learned ones would be left unused
        for m in model.modules():
            learned_gains.detach(m)
    _attach_warmup(model, cfg)
    if base is not None and base not in BASES:
        raise ValueError(f"base attention {base!r} is not one of {BASES}")
    previous = getattr(model.config, BASE_ATTR, None)
    setattr(model.config, BASE_ATTR, base or previous)
    try:
        base = base_attention(model.config)
    except ValueError:
        setattr(model.config, BASE_ATTR, previous)
        raise
    if base == "flex_attention" and not getattr(model, "_supports_flex_attn", False):
        raise ValueError(f"{type(model).__name__} does not support flex attention: use base 'sdpa' or 'eager'")
    setattr(model.config, BASE_ATTR, base)
    model.set_attn_implementation(chosen.name)
    return install_pid_hooks(model)


def _register(method: AttentionMethod) -> None:
    """Every registered attention method is an ``attn_implementation`` of transformers, under its name: the same
    attention function (it reads the method from the forward's state) and the base attention's mask function."""
    AttentionInterface.register(method.name, pid_attention_forward)
    AttentionMaskInterface.register(method.name, pid_mask)
    _METHODS[method.name] = method


def _transformers_names() -> Dict[str, str]:
    """The names transformers holds, for :func:`~pid_plugins.core.reserve_names`: its attention and mask
    implementations (read live: kernels registered later count), ``"eager"`` (built in), and the attributes of
    ``PretrainedConfig`` and ours (a method's parameters are saved as ``config.<name>``)."""
    from transformers import PretrainedConfig

    names = {name: f"PretrainedConfig.{name}, which a method's parameters (saved as config.<method name>) would overwrite"
             for name in {*dir(PretrainedConfig), *vars(PretrainedConfig())} if not name.startswith("_")}
    names.update({name: f"pid_plugins' configuration attribute config.{name}" for name in (BASE_ATTR, WARMUP_ATTR)})
    replaced = "which a method of that name would replace for every model that uses it, also models without a method"
    names["eager"] = f'its built-in attn_implementation="eager", {replaced}'
    for interface, ours in ((AttentionMaskInterface, pid_mask), (AttentionInterface, pid_attention_forward)):
        for name, function in interface._global_mapping.items():
            if function is not ours:
                names[name] = f'its attn_implementation="{name}" ({interface.__name__}), {replaced}'
    return names


learned_gains.install()
reserve_names("transformers", _transformers_names)
on_register(_register)
