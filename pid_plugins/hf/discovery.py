"""Finding a model's attention modules, and the forward hooks that hand each forward its method state.

How it fits transformers (no frame inspection, one path for every way a model gets a method):

* every :class:`~transformers.PreTrainedModel` built after ``import pid_plugins.hf`` carries a forward pre-hook (with
  kwargs) and a forward hook (:mod:`pid_plugins.hf.install` adds them when the model registers its first child;
  :func:`rediscover` adds them to models built before the import). They do nothing unless the model's
  ``config._attn_implementation`` names a registered method, so ``from_pretrained(..., attn_implementation="pid")``,
  ``from_config``, ``Model(config)``, ``set_attn_implementation("pid")`` and ``convert`` all run the same code.
* Discovery (:func:`discover`, once per model: after ``post_init``, or at the first forward of a model switched
  later): every module whose class calls the attention interface is an attention module; its role (self- or
  cross-attention) comes from where it sits (``encoder_attn``, ``crossattention``, ``EncDecAttention``, ... or
  ``is_cross_attention``), its position in the layer order from the module tree (no ``layer_idx`` needed). A module
  named ``*Attention*`` that computes attention without the interface (custom code) is refused, naming it. With
  learnable parameters, every self-attention module gets its ``attention_params`` (:mod:`pid_plugins.hf.gains`).
* Each forward of a module that owns attention layers (a decoder, an encoder, a base model) gets a fresh
  :class:`~pid_plugins.hf.attention.MethodForwardState` in its keyword arguments; transformers passes them down to
  every attention call and gradient checkpointing captures them with each layer. The parameters come from the
  outermost model's ``config.<method>`` (T5's stacks keep deep copies of the config).
* Refused before anything is computed, with a message: reentrant gradient checkpointing (it cuts the method state's
  gradient between layers), transformers' own and torch's ``checkpoint_wrapper`` (:mod:`pid_plugins.hf.checkpointing`),
  a KV cache in a training forward under torch's activation checkpointing (the recomputation would append the keys a
  second time: ``use_cache=False``), a static sliding-window cache, ``output_attentions`` without the eager base, and
  transformers' own pipeline parallelism (``DistributedConfig(pp_size > 1)``) for a method that carries state across
  layers (:func:`pipeline_refusal`; the supported route is :func:`pid_plugins.hf.pipeline_stage`).
* ``use_cache`` not passed (or passed on as None by an outer model) is the config's, as transformers resolves it: a
  method with a cache slot (Twicing) gets the cache made here, so a plain ``model(prompt)`` returns a cache decoding
  can continue from.
* Layer dropout (BART's, Whisper's ``layerdrop`` in training) skips layers on purpose: the forward's state says so
  (:func:`drops_layers`), and a layer whose earlier layers were all skipped starts the method's state afresh
  (core's state rule otherwise refuses a later layer without state).
"""
from __future__ import annotations

import functools
import inspect
import sys
import threading
import warnings
from dataclasses import dataclass
from typing import Any, Dict, Optional

import torch
from torch import nn
from transformers import PreTrainedModel

from . import gains as learned_gains
from .attention import EARLIER, ROLE, STAGE_PLACEHOLDER, STATE_KEYWORD, MethodForwardState
from .cache import new_cache, static_past
from .checkpointing import cache_message, torch_checkpointing, wrapper_message
from .checkpointing import require as require_torch_checkpointing
from .config import BASE_ATTR, base_attention, method_of, model_method_config, persist
from .instance import give_instance_methods
from .record import sync_record
from .internals import (
    CACHE_KEYWORD, CACHE_LAYERS, CHECKPOINTING, CONTINUOUS_BATCHING, INTERFACE_SOURCE, STATIC_LAYER, TP_PLAN,
    cache_keywords, calls_interface, unknown_cache,
)
from .warmup import WARMUP_ATTR, WARMUP_SOURCE, counter_of, warmup_scale
from ..core import MethodChoice, get_method, list_methods
from ..core.layer import warn_switch_of_trained_weights
from ..versions import InternalChanged

__all__ = ["PLAN", "Plan", "calls_interface", "check_family", "check_model", "discover", "drops_layers", "hook",
           "is_cross", "learnable_config", "pipeline_refusal", "rediscover", "walk"]

HOOKED = "_pid_plugins_hooked"  # in a model's __dict__: it carries the forward hooks
#: in a model's __dict__ until its first forward: built from a folder saved without the method it runs (the loader, for
#: the message); the first forward, its weights loaded, warns if they are trained (warn_switch_of_trained_weights)
SWITCH_CHECK = "_pid_plugins_switch_check"
PLAN = "_pid_plugins_plan"  # in a model's __dict__: its Plan (discovered)
GAINS_SOURCE = "_pid_plugins_gains_config"  # in a nested model's __dict__: the outermost model's config
_LOCK = threading.RLock()  # re-entered by the interface probe (a method model built inside discovery)
_CROSS_NAMES = frozenset({"encoder_attn", "crossattention", "cross_attention", "cross_attn", "EncDecAttention",
                          "encoder_decoder_attention"})


# ------------------------------------------------------------------------------------ discovery (once per model)
@dataclass
class Plan:
    owns_layers: bool
    cache_position: Optional[int]  # index of the cache keyword among the positional arguments, if any
    learnable: bool = False  # whether discovery gave the self-attention modules their gains
    causal: bool = False  # whether a self-attention module it owns is causal (a decoder)
    counter: Optional[nn.Module] = None  # the model's own warm-up counter at discovery (handed to nested models)
    #: the keywords its forward takes the KV cache under (``cache``, ``past_key_values``: internals.CACHE_KEYWORD)
    cache_keywords: tuple = ()
    tp_checked: bool = False  # learnable parameters: whether the first forward checked for tensor parallelism
    #: the owner and the modules below it with a ``layerdrop`` attribute (BART's encoder/decoder, Whisper's, ...):
    #: where transformers' layer dropout reads its probability (besides the config's ``*layerdrop`` keys)
    layerdrop: tuple = ()


def _chosen(model: nn.Module) -> str:
    """The attention implementation a model's config names (for messages)."""
    return str(getattr(getattr(model, "config", None), "_attn_implementation", "pid"))


def is_cross(parts: list, module: nn.Module) -> bool:
    """Whether an attention module at module path ``parts`` is cross-attention (its values come from another
    sequence: no PID term, no gains)."""
    return bool(getattr(module, "is_cross_attention", False)) or any(p in _CROSS_NAMES for p in parts)


def learnable_config(config: Any) -> Any:
    """``config.<method>`` if the model runs a method with learnable parameters, else None (also when they are invalid:
    the first forward reports that)."""
    method = method_of(config)
    if method is None or getattr(config, method.name, None) is None:
        return None
    try:
        cfg = model_method_config(config, method)
    except ValueError:
        return None
    return cfg if getattr(cfg, "learnable", False) else None


def walk(module: nn.Module, prefix: str = ""):
    """(path, module) below ``module``, not descending into nested PreTrainedModels (they are their own owners)."""
    for name, child in module.named_children():
        path = f"{prefix}.{name}" if prefix else name
        yield path, child
        if not isinstance(child, PreTrainedModel):
            yield from walk(child, path)


def _outside_interface(module: nn.Module) -> bool:
    """Whether ``module`` looks like attention (``*Attention*``, no attention module inside it) but does not call
    transformers' attention interface."""
    return "Attention" in type(module).__name__ and not calls_interface(type(module)) and not any(
        "Attention" in type(m).__name__ or calls_interface(type(m)) for m in module.modules() if m is not module
    )


def _outside_message(name: str, model: nn.Module, path: str, module: nn.Module) -> str:
    return (f"attn_implementation={name!r}: {type(model).__name__}.{path} ({type(module).__name__}) computes attention "
            f"without transformers' attention interface (custom or remote code?), so attention method {name!r} "
            "cannot reach it")


def _takes_kwargs(cls: type) -> bool:
    return any(p.kind is p.VAR_KEYWORD for p in inspect.signature(cls.forward).parameters.values())


def _no_kwargs_message(name: str, model: nn.Module) -> str:
    return (f"attn_implementation={name!r}: {type(model).__name__}.forward takes no **kwargs, so the "
            "per-forward state of the attention method cannot reach its attention layers")


def check_model(model: PreTrainedModel, name: str) -> None:
    """Refuse, changing nothing, a model whose attention method ``name`` could not reach its attention: a family that
    picks its attention classes from its own table, an attention module outside the attention interface, a model
    owning attention layers whose forward takes no ``**kwargs`` (what discovery refuses)."""
    INTERFACE_SOURCE.require()
    CONTINUOUS_BATCHING.require()  # the refusal the model's own init_continuous_batching makes
    for owner in model.modules():
        if not isinstance(owner, PreTrainedModel):
            continue
        check_family(type(owner), owner.config, name)
        owns = False
        for path, sub in walk(owner):
            if isinstance(sub, PreTrainedModel):
                continue
            if calls_interface(type(sub)):
                owns = True
            elif _outside_interface(sub):
                raise ValueError(_outside_message(name, owner, path, sub))
        if owns and not _takes_kwargs(type(owner)):
            raise ValueError(_no_kwargs_message(name, owner))


def discover(model: PreTrainedModel, at_forward: bool = False) -> Plan:
    """Mark the attention modules ``model`` owns with their role and order; refuse attention outside the interface.
    With learnable gains, give every self-attention module its gains if it has none (and cross-attention none)."""
    INTERFACE_SOURCE.require()
    gains_source = model.__dict__.get(GAINS_SOURCE, model.config)
    warmup = counter_of(model)
    base = base_attention(gains_source)
    method = method_of(gains_source) or method_of(model.config)
    learnable: Any = model_method_config(gains_source, method)
    learnable = learnable if getattr(learnable, "learnable", False) else None
    added = []
    order = 0
    causal = False
    stacks: Dict[str, tuple[int, ...]] = {}  # self-attention indices seen in each stack (encoder / decoder / model)
    droppers = [model] if _number(getattr(model, "layerdrop", None)) else []
    for path, sub in walk(model):
        if getattr(sub, STAGE_PLACEHOLDER, False):
            raise ValueError(
                f"attn_implementation={_chosen(model)!r}: {type(model).__name__}.{path} belongs to another pipeline "
                "stage (pid_plugins.hf.pipeline_stage put a placeholder in its place), so the model's layers cannot be "
                "numbered again: choose the method, its parameters and learnable parameters before splitting the model "
                "into stages"
            )
        if _number(getattr(sub, "layerdrop", None)):
            droppers.append(sub)
        if isinstance(sub, PreTrainedModel):
            sub.__dict__[GAINS_SOURCE] = gains_source
            if warmup is not None:
                sub.__dict__[WARMUP_SOURCE] = warmup
            else:
                sub.__dict__.pop(WARMUP_SOURCE, None)
            if getattr(sub, "config", None) is not None:
                setattr(sub.config, BASE_ATTR, base)
            continue
        cls = type(sub)
        if calls_interface(cls):
            parts = path.split(".")
            cross = is_cross(parts, sub)
            setattr(sub, ROLE, -1 if cross else order)
            if cross:
                learned_gains.detach(sub)
            elif learnable is not None and learned_gains.attach(sub, learnable, method):
                added.append(path)
            if not cross:  # an encoder and a decoder under one owner are separate PID groups
                causal = causal or bool(getattr(sub, "is_causal", False))
                # the stack: the path up to its first encoder/decoder part ("encoder", "model.decoder"; "" for a
                # decoder-only model), so two encoders under one owner (text_model.encoder, vision_model.encoder)
                # are two groups
                cut = next((i for i, p in enumerate(parts) if "encoder" in p.lower() or "decoder" in p.lower()), -1)
                stack = ".".join(parts[: cut + 1])
                earlier = stacks.get(stack, ())
                setattr(sub, EARLIER, earlier)
                stacks[stack] = (order, *earlier)
                order += 1
        elif _outside_interface(sub):
            raise ValueError(_outside_message(_chosen(model), model, path, sub))
    params = inspect.signature(type(model).forward).parameters
    names = [n for n in params if n != "self"]
    keywords = cache_keywords(type(model).forward)
    if causal:  # a decoder reads its cache: the keyword it comes under, and the cache layers, as the adapter knows them
        for internal in (CACHE_KEYWORD, CACHE_LAYERS, STATIC_LAYER):
            internal.require()
    CHECKPOINTING.require()
    if order and not _takes_kwargs(type(model)):
        raise ValueError(_no_kwargs_message(_chosen(model), model))
    persist(model.config)
    sync_record(model)  # the method record in its weights (a model switched by set_attn_implementation too)
    try:  # parse the gains now (cached), so a first forward under torch.compile only looks them up
        model_method_config(gains_source)
    except ValueError:
        pass  # refused with its message at the first forward
    if added:
        learned_gains.ignore_missing(model)
        learned_gains.extend_tp_plan(model)  # their tensor-parallel entries (applied when transformers builds it)
        if at_forward:
            name = _chosen(model)
            warnings.warn(
                f"attn_implementation={name!r}: learnable parameters were added to {type(model).__name__} at its "
                f"first forward ({len(added)} layers, from config.{name}): an optimizer built before now does "
                f"not train them. Call pid_plugins.hf.convert(model, {name!r}) before building the optimizer",
                stacklevel=4,
            )
    plan = Plan(owns_layers=order > 0, cache_position=names.index(keywords[0]) if keywords else None,
                learnable=learnable is not None, causal=causal,
                counter=model._modules.get(WARMUP_ATTR), cache_keywords=keywords, layerdrop=tuple(droppers))
    model.__dict__[PLAN] = plan
    return plan


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


#: the config keys transformers' layer dropout reads (BART, Whisper, M2M100, ...: ``*_layerdrop``; wav2vec2: ``layerdrop``)
LAYERDROP_KEYS = ("layerdrop", "encoder_layerdrop", "decoder_layerdrop")


def drops_layers(model: nn.Module, plan: Plan) -> bool:
    """Whether this forward of ``model`` may skip layers on purpose: the model's own layer dropout (a ``layerdrop``
    attribute of the owner or a module below it, or a ``*layerdrop`` config key, above 0) in training mode. A layer
    whose earlier layers were all skipped then starts the method's state afresh (:attr:`LayerCall.restart
    <pid_plugins.core.LayerCall>`), as the group's first layer does."""
    if not model.training:
        return False
    if any((getattr(m, "layerdrop", 0) or 0) > 0 for m in plan.layerdrop):
        return True
    config = getattr(model, "config", None)
    return any(_number(value := getattr(config, key, None)) and value > 0 for key in LAYERDROP_KEYS)


def pipeline_refusal(config: Any, method: Any, params: Any) -> Optional[str]:
    """The message refusing transformers' own pipeline parallelism (``DistributedConfig(pp_size > 1)``, which
    ``from_pretrained`` records as ``config.distributed_config``) for a method that carries state across layers;
    None when the model runs no such method or no pipeline parallelism."""
    distributed = getattr(config, "distributed_config", None)
    pp_size = distributed.get("pp_size") if isinstance(distributed, dict) else getattr(distributed, "pp_size", None)
    if not _number(pp_size) or pp_size <= 1 or not method.state_fields or method.is_identity(params):
        return None
    carrying = [n for n in list_methods() if get_method(n).state_fields]
    free = [n for n in list_methods() if not get_method(n).state_fields]
    return (
        f"attn_implementation={method.name!r}: pipeline parallelism (transformers' DistributedConfig(pp_size="
        f"{pp_size})) is refused for the attention methods that carry state across layers ({', '.join(carrying)}): "
        "each stage runs a forward of its own and receives only the previous stage's hidden states, so the first "
        f"layer of a later stage would lose the state of the layers before it ({', '.join(method.state_fields)} for "
        f"{method.name!r}) and silently take itself for the first layer. Methods without cross-layer state "
        f"({', '.join(free) or 'none registered'}) run under it. The supported route: split the model with "
        "pid_plugins.hf.pipeline_stage(model, stage_index, num_stages) and run the stages with "
        "torch.distributed.pipelining (PipelineStage and a schedule such as ScheduleGPipe): they carry the method's "
        "state across the stage boundary as tensors"
    )


def check_family(cls: type, config: object, name: str) -> None:
    """Refuse method ``name`` for a model class whose family picks its attention from its own table."""
    for table_name, keys in _attention_tables(cls):
        if name not in keys:
            raise ValueError(
                f"attn_implementation={name!r}: {cls.__name__} ({getattr(config, 'model_type', '?')}) "
                f"picks its attention class from its own table {table_name} ({', '.join(map(repr, keys))}) instead of "
                f"transformers' attention interface, so attention method {name!r} cannot reach its attention. "
                f"Use one of {list(keys)} for this family, or a family on the attention interface (Llama, Mistral, "
                "Qwen2, GPT-NeoX, ...)"
            )


@functools.lru_cache(maxsize=None)
def _attention_tables(cls: type) -> tuple:
    """``(name, keys)`` of the ``*_ATTENTION_CLASSES`` dicts in the module that defines ``cls``."""
    module = sys.modules.get(cls.__module__)
    return tuple((name, tuple(value)) for name, value in vars(module).items()
                 if name.endswith("_ATTENTION_CLASSES") and isinstance(value, dict)) if module else ()


# ------------------------------------------------------------------------------------------ per-forward checks
def _checkpointing(model: nn.Module) -> bool:
    """Whether a layer of ``model`` has gradient checkpointing on."""
    return any(getattr(m, "gradient_checkpointing", False) for m in model.modules())


def _check_checkpointing(model: nn.Module, name: str = "pid", training: bool = True) -> Optional[str]:
    """Refuse reentrant checkpointing (it cuts the method state's graph between layers) before any gradient:
    transformers' own (in training, where transformers checkpoints) and torch's ``checkpoint_wrapper`` (in any mode:
    it always checkpoints). Returns where torch's activation checkpointing wraps a module of ``model`` (for the KV
    cache check), or None."""
    require_torch_checkpointing()
    found = None
    for path, m in model.named_modules():
        if training and getattr(m, "gradient_checkpointing", False) and hasattr(m, "_gradient_checkpointing_func"):
            CHECKPOINTING.require()
            func = m._gradient_checkpointing_func
            keywords = getattr(func, "keywords", None)
            # torch.utils.checkpoint's default (use_reentrant not given) is reentrant
            if keywords is None or keywords.get("use_reentrant", True) is not False:
                raise ValueError(
                    f"attention method {name!r} needs non-reentrant gradient checkpointing (reentrant checkpointing "
                    "cuts the method state's gradient between layers): use model.gradient_checkpointing_enable("
                    "gradient_checkpointing_kwargs={'use_reentrant': False})"
                )
        wrapped = torch_checkpointing(m)
        if wrapped is not None:
            what, reentrant = wrapped
            where = f"{type(model).__name__}.{path}" if path else type(model).__name__
            if reentrant:
                raise ValueError(wrapper_message(name, where))
            found = found or f"torch's {what} at {where}"
    return found


def _tensor_parallel(model: nn.Module) -> bool:
    """Whether transformers' tensor parallelism sharded ``model`` (a parameter is a DTensor on a mesh named "tp")."""
    for p in model.parameters():
        mesh = getattr(p, "device_mesh", None)
        if mesh is not None and "tp" in (getattr(mesh, "mesh_dim_names", None) or ()):
            return True
    return False


# ---------------------------------------------------------------------------------------------- the hooks
def _pre_hook(module: nn.Module, args: tuple, kwargs: dict) -> Optional[tuple[tuple, dict]]:
    config = module.config
    method = method_of(config)
    if method is None:
        return None
    plan = module.__dict__.get(PLAN)
    if plan is None:
        if torch.compiler.is_compiling():  # discovery reads source code and the module tree: not traceable
            raise RuntimeError(
                f"attn_implementation={method.name!r}: {type(module).__name__} was switched to it after it was built, and "
                f"torch.compile reached its first forward: call pid_plugins.hf.convert(model, {method.name!r}) (or run one eager "
                "forward) before compiling"
            )
        with _LOCK:
            plan = discover(module, at_forward=True)
    switched = module.__dict__.pop(SWITCH_CHECK, None)
    if switched is not None and not torch.compiler.is_compiling():
        # the first forward of a model built from a folder saved without this method: its weights are loaded now
        # (one warning: the models nested in it, built from the same folder, are not asked again)
        for nested in module.modules():
            nested.__dict__.pop(SWITCH_CHECK, None)
        warn_switch_of_trained_weights(module, MethodChoice(method, model_method_config(config, method)), switched)
    if plan.counter is not module._modules.get(WARMUP_ATTR):
        # the counter module was replaced after discovery (peft's modules_to_save=["attention_warmup"] wraps it, its
        # merge_and_unload unwraps it): the nested models' layers must read the counter this forward advances
        with _LOCK:
            plan = discover(module)
    if getattr(config, "distributed_config", None) is not None:  # transformers' PP: refused before anything runs
        refusal = pipeline_refusal(config, method, model_method_config(module.__dict__.get(GAINS_SOURCE, config),
                                                                       method))
        if refusal is not None:
            raise ValueError(refusal)
    if not plan.owns_layers:
        return None
    gains_config = module.__dict__.get(GAINS_SOURCE, config)
    gains = model_method_config(gains_config, method)
    if getattr(gains, "learnable", False) and not plan.learnable:  # config.<method> became learnable after discovery
        with _LOCK:
            plan = discover(module, at_forward=True)
    if plan.learnable and not plan.tp_checked and not torch.compiler.is_compiling():
        plan.tp_checked = True
        if not TP_PLAN.holds() and _tensor_parallel(module):  # the gains' gradients would not be summed over ranks
            raise InternalChanged(TP_PLAN.message(f"{type(module).__name__} runs tensor parallelism with learnable "
                                                  "parameters, which this release cannot synchronise"))
    scale = warmup_scale(module, gains)
    base = base_attention(config)
    grad = torch.is_grad_enabled()
    wrapped = _check_checkpointing(module, method.name, module.training) if grad else None
    if base != "eager" and (kwargs.get("output_attentions") or getattr(config, "output_attentions", False)):
        raise ValueError(
            f"output_attentions needs the eager base attention under attention method {method.name!r}: "
            f"pid_plugins.hf.convert(model, {method.name!r}, base='eager')"
        )
    cache = next((kwargs[k] for k in plan.cache_keywords if kwargs.get(k) is not None), None)
    if cache is None and plan.cache_position is not None and len(args) > plan.cache_position:
        cache = args[plan.cache_position]
    renamed = unknown_cache(args, kwargs, plan.cache_keywords)
    if renamed is not None:  # a release that passes the cache under a name the adapter does not read
        raise InternalChanged(CACHE_KEYWORD.message(f"{type(module).__name__}.forward got the cache as {renamed}="))
    active = not method.is_identity(gains)
    use_cache = kwargs.get("use_cache")
    if use_cache is None:  # not passed, or passed on as None by an outer model: the config's (transformers' default)
        use_cache = getattr(config, "use_cache", False)
    if wrapped is not None and module.training and (cache is not None or use_cache):
        raise ValueError(cache_message(method.name, wrapped))
    # transformers' checkpointed layers drop the cache in training (GradientCheckpointingLayer): so does the slot
    layers_cache = not (method.cache_slot and module.training and _checkpointing(module))
    if cache is None and method.cache_slot and active and layers_cache and plan.causal and \
            plan.cache_position is not None and len(args) <= plan.cache_position and use_cache:
        # the model would make its cache inside the forward, where the method cannot reach it to keep its
        # per-position slot (Twicing's A v) next to the keys: make the same cache here and hand it down
        cache = new_cache(config)
        kwargs[plan.cache_keywords[0]] = cache
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
    state = MethodForwardState(gains, base, static_past(cache, method.name), scale, method, cached=cache is not None,
                            cache=slot_cache,
                            restart=bool(method.state_fields) and drops_layers(module, plan))
    state.grad = grad
    kwargs[STATE_KEYWORD] = state
    return args, kwargs


def _post_hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
    run = kwargs.get(STATE_KEYWORD)
    if run is not None:
        run.finished = True
    # the gain warm-up advances once per training forward of the model that owns the counter (the outermost),
    # after the forward: checkpointed layers recompute with the scale their MethodForwardState holds
    counter = module._modules.get(WARMUP_ATTR)
    if counter is not None and module.training and method_of(module.config) is not None:
        counter.advance()


def hook(model: PreTrainedModel) -> None:
    """Give ``model`` the (inert unless its config names a method) forward pre-hook and hook, and its own
    ``_initialize_weights`` and ``init_continuous_batching`` (:func:`~pid_plugins.hf.instance.give_instance_methods`),
    once."""
    if not model.__dict__.get(HOOKED, False):
        model.register_forward_pre_hook(_pre_hook, with_kwargs=True)
        model.register_forward_hook(_post_hook, with_kwargs=True)
        give_instance_methods(model)
        model.__dict__[HOOKED] = True


def rediscover(model: PreTrainedModel) -> PreTrainedModel:
    """Hook every PreTrainedModel in ``model`` (once: models built before the import have no hooks) and discover each
    afresh, outermost first (after :func:`~pid_plugins.hf.convert` changed what its config says)."""
    with _LOCK:
        for m in model.modules():
            if isinstance(m, PreTrainedModel):
                hook(m)
                m.__dict__.pop(PLAN, None)
                m.__dict__.pop(GAINS_SOURCE, None)
                m.__dict__.pop(WARMUP_SOURCE, None)
        for m in model.modules():  # outermost first: it hands its config (gains, base) to the nested models
            if isinstance(m, PreTrainedModel) and PLAN not in m.__dict__:
                discover(m)
    persist(model.config)
    return model
