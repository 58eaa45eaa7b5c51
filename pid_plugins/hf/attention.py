"""The attention function every method is registered under in transformers' ``AttentionInterface``
(:func:`method_attention_forward`: the base attention, SDPA, eager or flex, plus the method's rule) and the mask
function (:func:`method_mask`). The method, its parameters and the earlier layers' state come from the
:class:`MethodForwardState` the model's forward (:class:`~pid_plugins.hf.forward.MethodForward`) passes down."""
from __future__ import annotations

import functools
import sys
from typing import Any, Callable, Dict, Optional

import torch
from torch import Tensor, nn
from transformers.integrations.flex_attention import flex_attention_forward
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import eager_mask, flex_attention_mask, sdpa_mask

from ..core import AttentionContext, AttentionMethod, CacheSlot, LayerCall, expand_heads, get_method, list_methods
from ..core.methods import calls_once, makes_state, update_once
from . import checkpointing
from . import gains as learned_gains
from .cache import LayerSlot
from .config import base_attention

__all__ = ["EARLIER", "ROLE", "STAGE_PLACEHOLDER", "STATE_KEYWORD", "MethodForwardState", "method_attention_forward",
           "method_mask"]

ROLE = "_pid_plugins_index"  # on attention modules: order among the owner's self-attention, or -1 (cross)
#: True on the placeholder of a layer another pipeline stage owns (pid_plugins.hf.pipeline_stage)
STAGE_PLACEHOLDER = "_pid_plugins_stage_placeholder"
#: how to run a transformers layer with its state, named in core's MissingLayerState
STATE_ROUTE = (
    "With transformers, run the layers in the model's forward; for pipeline parallelism split the model with "
    "pid_plugins.hf.pipeline_stage(model, stage_index, num_stages) and run the stages with "
    "torch.distributed.pipelining (PipelineStage and a schedule such as ScheduleGPipe): each stage hands the "
    "method's state to the next as tensors beside the hidden states (transformers' own "
    "DistributedConfig(pp_size=...) is refused for such methods)."
)
#: on self-attention modules: the indices of the earlier layers of its stack, nearest first
EARLIER = "_pid_plugins_earlier"
#: the keyword argument that carries a forward's :class:`MethodForwardState` to every attention call
STATE_KEYWORD = "method_state"


class MethodForwardState:
    """The method's state of one forward of one layer stack: its parameters, base attention, static-cache offset and
    each self-attention layer's outgoing state. Opaque (a pytree leaf), so wrappers pass it by reference."""

    __slots__ = ("method", "config", "base", "past_length", "layers", "finished", "rows", "scale", "zero",
                 "function", "start", "learnable", "cached", "cache", "grad", "restart", "call", "update",
                 "makes_state", "calls", "verify")

    def __init__(self, config: Any, base: str = "sdpa", past_length: Optional[Tensor] = None,
                 scale: Optional[Tensor] = None, method: Optional[AttentionMethod] = None,
                 cached: bool = False, cache: Any = None, restart: bool = False, zero: Optional[bool] = None,
                 chosen: Optional[tuple] = None) -> None:
        self.method = method if method is not None else _method_of_config(config)
        self.config = config
        self.base = base
        self.scale = scale  # the gain warm-up's scale (None: no warm-up)
        self.zero = self.method.is_identity(config) if zero is None else zero  # the stock attention
        self.learnable = bool(getattr(config, "learnable", False))
        # per forward or reused (:meth:`chosen`): the call, the direct path's update (or None), makes_state
        self.call, self.update, self.makes_state = chosen if chosen is not None else self._choose(config, scale)
        self.calls = 0  # the calls that reached the method (checked once: _verify)
        self.verify = False
        self.cached = cached or past_length is not None  # a cache object was passed to the forward
        self.function = _BASE_FUNCTIONS.get(base)  # None: eager, the family's own
        self.past_length = past_length
        self.layers: Dict[int, tuple] = {}
        self.cache = cache  # the self-attention cache (methods with a cache slot), or None
        self.restart = restart  # layer dropout: a layer with no earlier layer run starts afresh
        self.finished = False  # later calls: checkpointing's recomputation
        self.grad = False  # autograd was on when the forward began (checkpointing.py)
        self.rows: Optional[Tensor] = None  # static cache: the query rows of the value buffer
        self.start: Optional[int] = None  # the same, eager on the CPU: the first row as a number

    def _choose(self, config: Any, scale: Optional[Tensor]) -> tuple:
        direct = not self.zero and scale is None and not self.learnable and calls_once(self.method)
        update = _bind(self.method, config) if direct else None
        return _stock_call if self.zero else _method_call, update, makes_state(self.method)

    def chosen(self) -> tuple:
        """``(call, update, makes_state)``: what this forward runs, for another forward of the same parameters."""
        return self.call, self.update, self.makes_state

    def previous(self, earlier: tuple[int, ...]) -> Optional[tuple]:
        """The state of the nearest earlier layer that ran (``earlier``: nearest first), or None."""
        for index in earlier:
            state = self.layers.get(index)
            if state is not None:
                return state
        return None

    def carry_in(self, index: int, state: tuple) -> None:
        """The state layer ``index`` computed in another forward (the previous pipeline stage's last layer)."""
        self.layers[index] = state

    def __repr__(self) -> str:
        return f"MethodForwardState(base={self.base!r}, layers={sorted(self.layers)}, finished={self.finished})"


def _method_of_config(config: Any) -> AttentionMethod:
    """The registered method whose parameters ``config`` is (its declared ``config_type``)."""
    for name in list_methods():
        method = get_method(name)
        if type(config) is method.config_type:
            return method
    raise TypeError(f"MethodForwardState: no registered attention method takes a {type(config).__name__} as its "
                    "parameters; pass method=")


_BASE_FUNCTIONS = {"sdpa": sdpa_attention_forward, "flex_attention": flex_attention_forward}


def _base_function(module: nn.Module, base: str) -> Callable:
    function = _BASE_FUNCTIONS.get(base)
    if function is not None:
        return function
    return _eager_function.__wrapped__(type(module)) if torch.compiler.is_compiling() else _eager_function(type(module))


@functools.lru_cache(maxsize=None)
def _eager_function(cls: type) -> Callable:
    fn = getattr(sys.modules.get(cls.__module__), "eager_attention_forward", None)
    if fn is None:
        raise ValueError(f"{cls.__name__}'s module has no eager_attention_forward: use base 'sdpa'")
    return fn



def _bind(method: AttentionMethod, config: Any) -> Optional[Callable[..., tuple]]:
    """The direct path's update: the method's :meth:`~pid_plugins.core.AttentionMethod.bind_update` for a
    ``(B, q, H, D)`` output (heads at -2), or None (its parameters depend on the layer: core's apply)."""
    return method.bind_update(config, -2)


def method_attention_forward(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Optional[Tensor],
    **kwargs: Any,
) -> tuple[Tensor, Optional[Tensor]]:
    """The base attention (SDPA, eager or flex) with the model's attention method (PID: followed by the PID update);
    ``(B, q, H, D)`` output. Registered under every method's name; runs the function the forward's
    :class:`MethodForwardState` chose."""
    run: Optional[MethodForwardState] = kwargs.pop(STATE_KEYWORD, None)
    if run is None:
        return _without_state(module, query, key, value, attention_mask, kwargs)
    run.calls += 1
    update = run.update
    if update is None:  # zero gains (the stock attention), or core's apply
        return run.call(run, module, query, key, value, attention_mask, kwargs)
    # the direct path (PID, NeuTRENO): the base attention, then the bound update; every rare case goes to _method_call
    entries = module.__dict__
    earlier = entries.get(EARLIER)  # the earlier layers of its stack, nearest first
    layers = run.layers
    previous = layers.get(earlier[0]) if earlier else None
    index = entries.get(ROLE)
    if earlier is None or run.finished or index in layers or (earlier and (
            previous is None or (run.makes_state and type(previous) is tuple))) or isinstance(value, _PROXY) or (
            run.grad and not torch.is_grad_enabled()):
        return _method_call(run, module, query, key, value, attention_mask, kwargs)
    out, weights = (run.function or _base_function(module, run.base))(module, query, key, value, attention_mask,
                                                                      **kwargs)
    if not run.method.keys_state:  # the query positions' values
        q_len, length = query.shape[-2], value.shape[-2]
        if run.past_length is not None:
            value = _query_values(run, value, q_len)
        elif length != q_len:
            value = value.narrow(2, length - q_len, q_len)
    u, layers[index] = update(out, value.transpose(1, 2), previous)
    return u, weights


def _without_state(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Optional[Tensor],
                   kwargs: dict) -> tuple[Tensor, Optional[Tensor]]:
    """A call without a forward's state: a cross-attention of a model whose forward the hooks did not see (base
    attention only), else refused."""
    if module.__dict__.get(ROLE) == -1:
        base = base_attention(getattr(module, "config", None))
        return _base_function(module, base)(module, query, key, value, attention_mask, **kwargs)
    chosen = getattr(getattr(module, "config", None), "_attn_implementation", None)
    raise RuntimeError(
        f"attn_implementation={chosen!r}: {type(module).__name__} got no per-forward state of attention method "
        f"{chosen!r}: the model was built without it (or before `import pid_plugins.hf`) and switched later. Call "
        f"pid_plugins.hf.convert(model, {chosen!r}) once; a model whose forward does not pass its keyword "
        f"arguments down to the attention layers cannot run {chosen!r}"
    )


def _stock_call(run: MethodForwardState, module: nn.Module, query: Tensor, key: Tensor, value: Tensor,
                attention_mask: Optional[Tensor], kwargs: dict) -> tuple[Tensor, Optional[Tensor]]:
    """Zero gains: the base attention, the stock model bit for bit."""
    if module.__dict__.get(ROLE) is None:
        return _without_state(module, query, key, value, attention_mask, kwargs)
    return (run.function or _base_function(module, run.base))(module, query, key, value, attention_mask, **kwargs)


_PROXY = torch.fx.Proxy  # torch.fx's traced values (symbolic tracing of a model: the checked path)


def _query_values(run: MethodForwardState, value: Tensor, q_len: int) -> Tensor:
    """The values of the query positions, ``(B, H_kv, q, D)``: the last ``q_len`` rows without a cache or with a
    dynamic one, rows ``[past, past + q_len)`` of a static cache's buffer."""
    length = value.shape[-2]
    if run.past_length is None:  # no cache, or a dynamic cache: the query rows end the value tensor
        return value if length == q_len else value.narrow(2, length - q_len, q_len)
    start = _start(run, value)
    if start is not None:  # a static cache, eager, on the CPU: rows [past, past + q_len), a view
        return value.narrow(2, start, q_len)
    if run.rows is None:  # a static cache: rows [past, past + q_len) of the buffer
        run.rows = run.past_length.to(value.device) + torch.arange(q_len, device=value.device)
    return value.index_select(2, run.rows)


def _start(run: MethodForwardState, like: Tensor) -> Optional[int]:
    """A static cache's length as a number, for an eager forward on the CPU (read once per forward, no sync); None
    elsewhere: on an accelerator (a sync) and under torch.compile, where a number would be specialised on and each
    decoding step recompile (decided in the attention call, not before the forward)."""
    if like.device.type != "cpu" or torch.compiler.is_compiling():
        return None
    start = run.start
    if start is None and run.past_length.device.type == "cpu":
        start = run.start = int(run.past_length)
    return start


def _method_call(run: MethodForwardState, module: nn.Module, query: Tensor, key: Tensor, value: Tensor,
                 attention_mask: Optional[Tensor], kwargs: dict) -> tuple[Tensor, Optional[Tensor]]:
    """Every other call: core's :meth:`~pid_plugins.core.AttentionMethod.apply` with a :class:`LayerCall`, and the
    checks of cross-attention, checkpointing's recomputation and a layer shared by several layers."""
    index = module.__dict__.get(ROLE)
    if index == -1:  # cross-attention: base attention only (its values come from another sequence)
        return _base_function(module, run.base)(module, query, key, value, attention_mask, **kwargs)
    if index is None:
        return _without_state(module, query, key, value, attention_mask, kwargs)
    base = run.function or _base_function(module, run.base)
    if run.zero:
        return base(module, query, key, value, attention_mask, **kwargs)
    method = run.method
    if run.finished:  # activation checkpointing's recomputation, in the backward
        if key.shape[-2] != query.shape[-2]:  # the layer used a KV cache
            raise ValueError(checkpointing.cache_message(method.name))
    elif run.grad and not torch.is_grad_enabled():  # reentrant checkpointing's first forward
        raise ValueError(checkpointing.reentrant_message(method.name, module))
    learned = None
    if run.learnable:  # this layer's own parameters, else the config's
        learned = getattr(module, learned_gains.GAINS_ATTR, None)
        if learned is None:
            raise RuntimeError(
                f"attn_implementation={method.name!r}: config.{method.name} is learnable but {type(module).__name__} "
                f"has no {learned_gains.GAINS_ATTR}: call pid_plugins.hf.convert(model, {method.name!r}) to add them"
            )
    q_len, length = query.shape[-2], value.shape[-2]
    v_q = _query_values(run, value, q_len)
    layers = run.layers
    if index in layers and not run.finished:
        raise RuntimeError(
            f"attn_implementation={method.name!r}: {type(module).__name__} ran twice in one forward (one attention "
            f"module shared by several layers, as in ALBERT): {method.name!r} needs one attention module per layer"
        )
    earlier = module.__dict__.get(EARLIER)  # else the layers before it in index order
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

    if calls_once(method) and run.scale is None and learned is None and not isinstance(value, _PROXY):
        out = attend(query, value)
        u, layers[index] = update_once(method, run.config, out, (value if method.keys_state else v_q).transpose(1, 2),
                                       previous, -2, index if earlier is None else len(earlier), run.restart,
                                       STATE_ROUTE)
        return u, weights
    context = (_context.__wrapped__ if torch.compiler.is_compiling() else _context)(
        bool(getattr(module, "is_causal", False)), bool(run.cached or key.shape[-2] != query.shape[-2]),
        bool(kwargs.get("dropout", 0.0)), bool(key.shape[1] != query.shape[1]))
    # (the output's (B, q, heads, D) layout, contiguous for o_proj: head_dim -2)
    call = LayerCall(attend, query, value, v_q.transpose(1, 2), -2, context, run.scale,
                     (lambda: _visible(module, attention_mask, query, key, kwargs, run))
                     if method.reads_visible else None,
                     (lambda: _slot(run, module, q_len, length)) if method.cache_slot else None,
                     None, None, index if earlier is None else len(earlier), run.restart, STATE_ROUTE)
    u, layers[index] = method.apply(run.config, learned, call, previous)
    return u, weights


@functools.lru_cache(maxsize=None)
def _context(causal: bool, cached: bool, dropout: bool, grouped: bool) -> AttentionContext:
    return AttentionContext(causal, cached, dropout, grouped)


class _ExpandedHeads:
    """An attention module as a base attention function sees it for a call whose keys were expanded to the query
    heads: ``num_key_value_groups`` is 1 (no second expansion); every other attribute is the module's."""

    num_key_value_groups = 1

    def __init__(self, module: nn.Module) -> None:
        self._module = module

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


def _visible(module: nn.Module, mask: Any, query: Tensor, key: Tensor, kwargs: dict,
             run: Optional[MethodForwardState] = None) -> Optional[Tensor]:
    """Which keys each query attends to, boolean ``(B or 1, 1 or H, q, K)``, from the base attention's mask, or
    None when every query sees every key; without a mask a causal query ``i`` sees keys ``<= past + i``."""
    q_len, k_len = query.shape[-2], key.shape[-2]
    static = run is not None and run.past_length is not None
    if mask is None:
        causal = kwargs.get("is_causal")
        causal = getattr(module, "is_causal", False) if causal is None else causal
        if not causal or (q_len == 1 and not static):
            return None
        if not static:
            past: Any = k_len - q_len
        else:
            past = _start(run, query)
            if past is None:
                past = run.past_length.to(query.device)
        rows = torch.arange(q_len, device=query.device)[:, None] + past
        return (torch.arange(k_len, device=query.device)[None, :] <= rows)[None, None]
    if not isinstance(mask, Tensor):
        raise ValueError(
            f"attention method reads which keys each query attends to, but the base attention's mask is a "
            f"{type(mask).__name__} (flex attention's BlockMask?): use base 'sdpa' or 'eager' "
            "(pid_plugins.hf.convert(model, <method>, base='sdpa'))"
        )
    mask = mask[..., :k_len]
    if mask.dtype == torch.bool:
        return mask
    return mask > torch.finfo(mask.dtype).min / 2


def _slot(run: MethodForwardState, module: nn.Module, q_len: int, k_len: int) -> Optional[CacheSlot]:
    """Where this layer keeps its method's per-position tensor beside its cached keys/values (None: no cache)."""
    cache = run.cache
    if cache is None:
        if k_len != q_len:
            raise ValueError(
                f"attention method {run.method.name!r} keeps a tensor per past position beside the KV cache, but this "
                "forward got the cached keys without the cache object (a cache the model made inside a forward the "
                "method did not see): pass DynamicCache(config=model.config) to the first forward (cache= from "
                "transformers 5.24, past_key_values= before), as generate() does"
            )
        return None
    layer_idx = getattr(module, "layer_idx", None)
    if not isinstance(layer_idx, int):
        raise ValueError(
            f"attention method {run.method.name!r} keeps a tensor per past position beside the KV cache, which needs "
            f"the attention module's layer_idx; {type(module).__name__} has none: decode with use_cache=False"
        )
    return LayerSlot(cache, layer_idx, run.method.name, run.base != "flex_attention")



def method_mask(*args: Any, **kwargs: Any):
    """The mask function of the base attention (``config.attention_base``)."""
    base = base_attention(kwargs.get("config"))
    if base == "eager":
        return eager_mask(*args, **kwargs)
    if base == "flex_attention":
        return flex_attention_mask(*args, **kwargs)
    return sdpa_mask(*args, **kwargs)
