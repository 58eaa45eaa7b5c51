"""Every transformers internal the adapter reads, checked where it is first read (probes: ``pid-plugins doctor``)."""
from __future__ import annotations

import contextlib
import functools
import inspect
import re
import threading
from typing import Any, Tuple

import torch

from ..versions import Internal, parameters, perturbed

__all__ = ["INTERNALS", "cache_keywords", "calls_interface"]

ZOO = "transformers"
#: the keyword a model's forward takes its KV cache under: ``cache`` from 5.24, ``past_key_values`` before
CACHE_KEYWORDS: Tuple[str, ...] = ("cache", "past_key_values")
#: transformers' tensor-parallel style for a replicated parameter whose gradient each rank computes only in part
TP_STYLE = "replicated_with_grad_allreduce"


@functools.lru_cache(maxsize=None)
def calls_interface(cls: type) -> bool:
    """Whether ``cls.forward`` dispatches through transformers' attention interface (transformers' own heuristic)."""
    try:
        return "ALL_ATTENTION_FUNCTIONS" in inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return False


def cache_keywords(forward: Any) -> Tuple[str, ...]:
    """The cache keywords (:data:`CACHE_KEYWORDS`) ``forward``'s signature names, in the order it names them."""
    names = inspect.signature(forward).parameters
    return tuple(n for n in names if n in CACHE_KEYWORDS)


def _tp_plan() -> bool:
    from transformers import PreTrainedModel

    try:
        from transformers.distributed import tensor_parallel
    except ImportError:
        return False
    prop = inspect.getattr_static(PreTrainedModel, "tp_plan", None)
    style = getattr(tensor_parallel, "ALL_PARALLEL_STYLES", {}).get(TP_STYLE)
    if not (isinstance(prop, property) and prop.fset is not None and style is not None):
        return False
    # source text: the hook acts only with a process group of several ranks (tests/core/test_distributed.py)
    source = inspect.getsource(type(style).install_forward)
    return "register_post_accumulate_grad_hook" in source and "all_reduce" in source and "recurse=False" in source


def _cache_keyword() -> bool:
    from transformers import LlamaModel

    return bool(cache_keywords(LlamaModel.forward))


def _static_layer() -> bool:
    from transformers.cache_utils import StaticLayer

    layer = StaticLayer(max_cache_len=4)
    return isinstance(layer.cumulative_length, torch.Tensor) and layer.is_initialized is False


def _cache_layers() -> bool:
    from transformers.cache_utils import (
        Cache, DynamicCache, DynamicLayer, DynamicSlidingWindowLayer, StaticLayer, StaticSlidingWindowLayer,
    )

    window = DynamicSlidingWindowLayer(sliding_window=4)
    # crop and the batch methods on dynamic layers only (static layers crop from 5.24: the slot layer crops with them)
    methods = {kind: "update reset reorder_cache offload prefetch get_seq_length".split() for kind in
               (DynamicLayer, DynamicSlidingWindowLayer, StaticLayer)}
    for kind in (DynamicLayer, DynamicSlidingWindowLayer):
        methods[kind] += ["crop", "batch_select_indices", "batch_repeat_interleave"]
    return (isinstance(DynamicCache().layers, list) and isinstance(getattr(Cache, "is_sliding", None), property)
            and all(callable(getattr(kind, m, None)) for kind, names in methods.items() for m in names)
            and window.sliding_window == 4 and window.record_past is False
            and callable(getattr(window, "activate_past_recording", None))
            and StaticLayer(max_cache_len=4).max_cache_len == 4 and issubclass(StaticSlidingWindowLayer, StaticLayer)
            and "is_initialized" in vars(DynamicLayer()))


def _torch_checkpoint() -> bool:
    from torch.distributed._composable.contract import _get_registry
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, CheckpointWrapper
    from torch.utils.hooks import RemovableHandle

    return (callable(_get_registry) and hasattr(CheckpointImpl, "REENTRANT")
            and isinstance(RemovableHandle.next_id, int)
            and {"mod", "checkpoint_impl"} <= set(parameters(CheckpointWrapper.__init__)))


def _initialize_weights() -> bool:
    from transformers import PreTrainedModel

    return (parameters(PreTrainedModel._initialize_weights)[:2] == ["self", "module"]
            and parameters(PreTrainedModel.__init__)[:2] == ["self", "config"] and callable(PreTrainedModel.post_init))


def _tiny_llama(attn_implementation: str = "sdpa", **method: Any) -> Any:
    """The probes' two-layer Llama in float32, ``method`` its ``config.<name>``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16,
                         attn_implementation=attn_implementation, **method)
    return LlamaForCausalLM(config).float().eval()


def _squashed(function: Any) -> str:
    """``function``'s source without whitespace (a reformatting is not a change)."""
    return re.sub(r"\s+", "", inspect.getsource(function))


def _checkpointing() -> bool:
    from transformers import PreTrainedModel

    enable = getattr(PreTrainedModel, "activation_checkpointing_enable", None) or \
        PreTrainedModel.gradient_checkpointing_enable
    return callable(enable) and "_gradient_checkpointing_func" in _squashed(PreTrainedModel._set_gradient_checkpointing)


def _checkpointing_probe() -> bool:
    """Checkpointed layers get a ``_gradient_checkpointing_func`` with the ``use_reentrant`` asked for."""
    model = _tiny_llama()
    seen = []
    enable = getattr(model, "activation_checkpointing_enable", None)  # from 5.24; gradient_checkpointing_enable before
    for reentrant in (True, False):
        if enable is not None:
            enable(activation_checkpointing_kwargs={"use_reentrant": reentrant})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        layers = [m for m in model.modules() if getattr(m, "gradient_checkpointing", False)]
        seen.append(bool(layers) and all(
            getattr(getattr(m, "_gradient_checkpointing_func", None), "keywords", {}).get("use_reentrant")
            is reentrant for m in layers))
    return all(seen)


def _continuous_batching() -> bool:
    # source text: each entry hands over to the next, and the last to the model's own init_continuous_batching
    from transformers import GenerationMixin
    from transformers.generation.continuous_batching import ContinuousMixin

    return ("self.generate_batch(" in _squashed(GenerationMixin.generate)
            and "self.continuous_batching_context_manager(" in _squashed(ContinuousMixin.generate_batch)
            and "self.init_continuous_batching(" in _squashed(ContinuousMixin.continuous_batching_context_manager))


def _continuous_batching_probe() -> bool:
    """Every continuous batching entry first reaches the model's own ``init_continuous_batching``."""
    from transformers.generation import utils

    class Entered(Exception):
        """The model's ``init_continuous_batching`` was reached."""

    def enter(*args: Any, **kwargs: Any) -> None:
        raise Entered

    model = _tiny_llama()
    model.__dict__["init_continuous_batching"] = enter
    entries = (lambda: model.generate_batch([[1, 2, 3]]),
               lambda: model.continuous_batching_context_manager().__enter__(),
               lambda: model.generate(torch.tensor([[1, 2, 3]]), cache_implementation="paged", max_new_tokens=1))
    # generate's note that "paged" switches to continuous batching: dropped for this thread
    quiet = functools.partial(lambda thread, record: record.thread != thread, threading.get_ident())
    utils.logger.addFilter(quiet)
    try:
        for entry in entries:
            with contextlib.suppress(Entered):
                entry()
                return False
        return True
    finally:
        utils.logger.removeFilter(quiet)


def _interface_source() -> bool:
    from transformers.models.llama.modeling_llama import LlamaAttention

    return calls_interface(LlamaAttention)


def _interface_source_probe() -> bool:
    """The class :func:`calls_interface` names dispatches through the registered function."""
    from transformers.models.llama.modeling_llama import LlamaAttention

    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        stock = perturbed(_tiny_llama())
        outputs = []
        for params in ({"lambda_p": 0.0, "lambda_i": 0.0, "lambda_d": 0.0}, {"lambda_p": 0.5}):
            model = _tiny_llama("pid", pid=params)
            model.load_state_dict(stock.state_dict())
            outputs.append(model(ids).logits)
        want = stock(ids).logits
    return calls_interface(LlamaAttention) and torch.equal(outputs[0], want) and not torch.equal(outputs[1], want)


def _global_mapping() -> bool:
    from transformers import AttentionInterface, AttentionMaskInterface

    return all(isinstance(getattr(i, "_global_mapping", None), dict) and "sdpa" in i._global_mapping
               for i in (AttentionInterface, AttentionMaskInterface))


CACHE_KEYWORD = Internal(
    ZOO, "the forward keyword carrying the KV cache (`cache` or `past_key_values`)",
    "finding the cache a forward uses (static caches: where the query positions' values are; Twicing: its slot)",
    "5.20 - 5.23 (`past_key_values`), 5.24 (`cache`)", _cache_keyword)
STATIC_LAYER = Internal(
    ZOO, "StaticLayer.cumulative_length (a tensor) and StaticLayer.is_initialized",
    "the static cache's length before a forward (the query positions' rows in the key/value buffer)",
    "5.20 - 5.24", _static_layer)
CACHE_LAYERS = Internal(
    ZOO, "Cache.layers, Cache.is_sliding and the cache layer classes DynamicLayer, DynamicSlidingWindowLayer, "
    "StaticLayer (subclassed)", "keeping a method's per-position tensor (Twicing's A v) in each layer's cache object",
    "5.20 - 5.24", _cache_layers)
TORCH_CHECKPOINT = Internal(
    "torch", "CheckpointWrapper.checkpoint_impl and ._checkpoint_wrapped_module, the composable checkpoint's "
    "registry (_get_registry), and the hooks it registers taking RemovableHandle.next_id",
    "refusing torch's reentrant checkpoint_wrapper, and a KV cache under activation checkpointing, before the forward",
    "2.14 - 2.15", _torch_checkpoint)
INITIALIZE_WEIGHTS = Internal(
    ZOO, "PreTrainedModel.__init__, PreTrainedModel._initialize_weights(self, module) and PreTrainedModel.post_init",
    "the construction hook; initialising learnable gains and the warm-up counter that a checkpoint lacks; discovery "
    "before the first forward", "5.20 - 5.24", _initialize_weights)
CHECKPOINTING = Internal(
    ZOO, "PreTrainedModel._set_gradient_checkpointing gives each checkpointed layer its _gradient_checkpointing_func "
    "with the use_reentrant asked for",
    "refusing reentrant gradient checkpointing before any gradient", "5.20 - 5.24", _checkpointing,
    _checkpointing_probe)
CONTINUOUS_BATCHING = Internal(
    ZOO, "ContinuousMixin.init_continuous_batching, where every continuous batching entry starts (each model's own, an "
    "instance attribute)", "refusing a method model before continuous batching switches its attention",
    "5.20 - 5.24", _continuous_batching, _continuous_batching_probe)
INTERFACE_SOURCE = Internal(
    ZOO, "attention classes name ALL_ATTENTION_FUNCTIONS in their forward (transformers' own heuristic) and dispatch "
    "through it", "finding a model's attention modules and checking that they ran the method", "5.20 - 5.24",
    _interface_source, _interface_source_probe)
GLOBAL_MAPPING = Internal(
    ZOO, "AttentionInterface._global_mapping / AttentionMaskInterface._global_mapping",
    "reserving the attention implementation names transformers holds (a method cannot replace 'sdpa')",
    "5.20 - 5.24", _global_mapping)
TP_PLAN = Internal(
    ZOO, "PreTrainedModel.tp_plan (a settable property) and the 'replicated_with_grad_allreduce' style of "
    "ALL_PARALLEL_STYLES (transformers.distributed.tensor_parallel)",
    "tensor parallelism with learnable parameters (their gradients all-reduced over the group)", "5.24", _tp_plan,
    optional=True)

INTERNALS = (CACHE_KEYWORD, STATIC_LAYER, CACHE_LAYERS, INITIALIZE_WEIGHTS, CHECKPOINTING, TORCH_CHECKPOINT,
             CONTINUOUS_BATCHING, INTERFACE_SOURCE, GLOBAL_MAPPING, TP_PLAN)
