"""Discovering a transformers model with a method: :func:`discover` numbers its self-attention modules and makes its
:class:`~pid_plugins.hf.forward.Plan`; a forward that finds the plan stale calls :func:`renew`."""
from __future__ import annotations

import functools
import inspect
import sys
import warnings
from typing import Any, Dict, Optional

from torch import nn
from transformers import PreTrainedModel

from . import gains as learned_gains
from .attention import EARLIER, ROLE, STAGE_PLACEHOLDER
from .checkpointing import cache_message, registry_key, torch_checkpointing, wrapper_message
from .config import (
    ANY_COUNTER, BASE_ATTR, WARMUP_ATTR, WARMUP_MISSING_KEY, WARMUP_SOURCE, attach_warmup, base_attention, counter_of,
    give_counter, method_of, model_method_config, persist, read_config,
)
from .forward import (
    FORWARD, GAINS_SOURCE, LAYERDROP_KEYS, PLAN, MethodForward, Plan, _number, checkpointing_layout, hooked, layout,
    unhook,
)
from .record import refresh as refresh_record, sync_record
from .internals import (
    CACHE_KEYWORD, CACHE_LAYERS, CHECKPOINTING, CONTINUOUS_BATCHING, INTERFACE_SOURCE, STATIC_LAYER, TP_PLAN,
    cache_keywords, calls_interface,
)
from ..core import GainWarmup, MethodChoice
from ..core.layer import warn_switch_of_trained_weights
from ..versions import InternalChanged, require

__all__ = ["check_family", "check_model", "discover", "discovered", "hook", "hooked", "is_cross", "learnable_config",
           "post_init", "rediscover", "relayout", "renew", "undiscover", "walk"]

#: in a model's __dict__ until its first forward (which warns if its weights are trained): loaded from a folder saved
#: without its method
SWITCH_CHECK = "_pid_plugins_switch_check"
_CROSS_NAMES = frozenset({"encoder_attn", "crossattention", "cross_attention", "cross_attn", "EncDecAttention",
                          "encoder_decoder_attention"})


def _chosen(model: nn.Module) -> str:
    return str(getattr(getattr(model, "config", None), "_attn_implementation", "<method>"))


def is_cross(parts: list, module: nn.Module) -> bool:
    """Whether the attention module at path ``parts`` is cross-attention (no method term, no gains)."""
    return bool(getattr(module, "is_cross_attention", False)) or any(p in _CROSS_NAMES for p in parts)


def learnable_config(config: Any) -> Any:
    """``config.<method>`` if the model runs a method with learnable parameters, else None."""
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


def _check_inside(name: str, model: nn.Module, path: str, module: nn.Module) -> None:
    """Refuse ``module`` if it looks like attention but does not call transformers' attention interface."""
    if "Attention" in type(module).__name__ and not calls_interface(type(module)) and not any(
            "Attention" in type(m).__name__ or calls_interface(type(m)) for m in module.modules() if m is not module):
        raise ValueError(f"attn_implementation={name!r}: {type(model).__name__}.{path} ({type(module).__name__}) "
                         "computes attention without transformers' attention interface (custom or remote code?), so "
                         f"attention method {name!r} cannot reach it")


def _check_kwargs(name: str, model: nn.Module) -> None:
    """Refuse a model whose forward takes no ``**kwargs`` (the method's state could not reach its layers)."""
    if not any(p.kind is p.VAR_KEYWORD for p in inspect.signature(type(model).forward).parameters.values()):
        raise ValueError(f"attn_implementation={name!r}: {type(model).__name__}.forward takes no **kwargs, so the "
                         "per-forward state of the attention method cannot reach its attention layers")


def check_model(model: PreTrainedModel, name: str) -> None:
    """Refuse, changing nothing, a model whose attention method ``name`` could not reach its attention."""
    INTERFACE_SOURCE.require()
    for owner in model.modules():
        if isinstance(owner, PreTrainedModel):
            check_family(type(owner), owner.config, name)
            if list(_attention(owner, name)):
                _check_kwargs(name, owner)


def _attention(model: nn.Module, name: Optional[str] = None):
    """(path, module) of the attention modules ``model`` owns; with ``name``, refuses attention outside them."""
    for path, sub in walk(model):
        if isinstance(sub, PreTrainedModel):
            continue
        if calls_interface(type(sub)):
            yield path, sub
        elif name is not None:
            _check_inside(name, model, path, sub)


def check_family(cls: type, config: object, name: str) -> None:
    """Refuse method ``name`` for a model class whose family picks its attention from its own table."""
    CONTINUOUS_BATCHING.require()  # the refusal the model's own init_continuous_batching makes
    for table_name, table in vars(sys.modules.get(cls.__module__) or object).items():
        keys = tuple(table) if table_name.endswith("_ATTENTION_CLASSES") and isinstance(table, dict) else (name,)
        if name not in keys:
            raise ValueError(
                f"attn_implementation={name!r}: {cls.__name__} ({getattr(config, 'model_type', '?')}) "
                f"picks its attention class from its own table {table_name} ({', '.join(map(repr, keys))}) instead of "
                f"transformers' attention interface, so attention method {name!r} cannot reach its attention. "
                f"Use one of {list(keys)} for this family, or a family on the attention interface (Llama, Mistral, "
                "Qwen2, GPT-NeoX, ...)"
            )


def _read(config: Any, source: Any) -> Any:
    """:func:`read_config`, None where it refuses (refused again at the first forward)."""
    try:
        return read_config(config, source)
    except ValueError:
        return None


def discover(model: PreTrainedModel, at_forward: bool = False) -> Plan:
    """Mark ``model``'s attention modules with role and order, give learnable gains; returns its new Plan."""
    INTERFACE_SOURCE.require()
    gains_source = model.__dict__.get(GAINS_SOURCE, model.config)
    warmup = counter_of(model)
    base = base_attention(gains_source)
    method = method_of(gains_source) or method_of(model.config)
    learnable: Any = model_method_config(gains_source, method)
    learnable = learnable if getattr(learnable, "learnable", False) else None
    added, paths = [], []
    order = 0
    causal = False
    stacks: Dict[str, tuple[int, ...]] = {}  # self-attention indices seen in each stack
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
        if isinstance(sub, PreTrainedModel):  # it reads the outermost model's parameters, counter and base
            sub.__dict__[GAINS_SOURCE] = gains_source
            if warmup is not None:
                sub.__dict__[WARMUP_SOURCE] = warmup
            else:
                sub.__dict__.pop(WARMUP_SOURCE, None)
            if getattr(sub, "config", None) is not None:
                setattr(sub.config, BASE_ATTR, base)
            nested = sub.__dict__.get(PLAN)
            if nested is not None:  # read now, not in a (compiled) forward
                nested.reading = _read(sub.config, gains_source)
            continue
        if calls_interface(type(sub)):
            paths.append(path)
            parts = path.split(".")
            cross = is_cross(parts, sub)
            setattr(sub, ROLE, -1 if cross else order)
            if cross:
                learned_gains.detach(sub)
                continue
            if learnable is not None and learned_gains.attach(sub, learnable, method):
                added.append(path)
            causal = causal or bool(getattr(sub, "is_causal", False))
            # its stack: the path up to its first encoder/decoder part ("" for a decoder-only model)
            cut = next((i for i, p in enumerate(parts) if "encoder" in p.lower() or "decoder" in p.lower()), -1)
            stack = ".".join(parts[: cut + 1])
            earlier = stacks.get(stack, ())
            setattr(sub, EARLIER, earlier)
            stacks[stack] = (order, *earlier)
            order += 1
        else:
            _check_inside(_chosen(model), model, path, sub)
    names = [n for n in inspect.signature(type(model).forward).parameters if n != "self"]
    keywords = cache_keywords(type(model).forward)
    if causal:
        require(CACHE_KEYWORD, CACHE_LAYERS, STATIC_LAYER)
    CHECKPOINTING.require()
    if order:
        _check_kwargs(_chosen(model), model)
    persist(model.config)
    sync_record(model)
    reading = _read(model.config, gains_source)  # now, so that a first compiled forward only looks it up
    if reading is not None and reading.refusal is not None:  # transformers' PP
        raise ValueError(reading.refusal)
    if added:
        learned_gains.ignore_missing(model)
        learned_gains.extend_tp_plan(model)
        if at_forward:
            name = _chosen(model)
            warnings.warn(
                f"attn_implementation={name!r}: learnable parameters were added to {type(model).__name__} at its "
                f"first forward ({len(added)} layers, from config.{name}): an optimizer built before now does "
                f"not train them. Call pid_plugins.hf.convert(model, {name!r}) before building the optimizer",
                stacklevel=5,
            )
    plan = Plan(renew=renew, read=read, name=_chosen(model), owns_layers=order > 0,
                cache_position=names.index(keywords[0]) if keywords else None, cache_keywords=keywords,
                learnable=learnable is not None, causal=causal, counter=model._modules.get(WARMUP_ATTR),
                layerdrop=tuple(droppers), layerdrop_keys=tuple(k for k in LAYERDROP_KEYS if _number(getattr(
                    model.config, k, None))), first=SWITCH_CHECK in model.__dict__ or learnable is not None,
                reading=reading)
    _fill_layout(model, plan, paths)
    model.__dict__[PLAN] = plan
    return plan


def _fill_layout(model: nn.Module, plan: Plan, paths: list) -> None:
    """The plan's modules: every step from ``model`` to the attention modules at ``paths``, and their checkpointing."""
    edges: Dict[tuple, tuple] = {}
    nodes: Dict[int, tuple] = {id(model): ("", model)}
    for path in paths:
        parent, walked = model, []
        for name in path.split("."):
            child = parent._modules[name]
            walked.append(name)
            edges.setdefault((id(parent), name), (parent._modules, name))
            nodes.setdefault(id(child), (".".join(walked), child))
            parent = child
    name, where = plan.name, type(model).__name__
    plan.reentrant = plan.wrapper = plan.wrapped = None
    plan.checkpointed = False
    flagged = []
    for path, m in nodes.values():
        if hasattr(m, "gradient_checkpointing"):
            flagged.append(m.__dict__)
            if getattr(m, "gradient_checkpointing", False) and hasattr(m, "_gradient_checkpointing_func"):
                plan.checkpointed = True
                keywords = getattr(m._gradient_checkpointing_func, "keywords", None)
                if keywords is None or keywords.get("use_reentrant", True) is not False:
                    plan.reentrant = (
                        f"attention method {name!r} needs non-reentrant gradient checkpointing (reentrant "
                        "checkpointing cuts the method state's gradient between layers): use "
                        "model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': False})")
        found = torch_checkpointing(m)
        if found is not None:
            at = f"{where}.{path}" if path else where
            if found[1]:
                plan.wrapper = plan.wrapper or wrapper_message(name, at)
            plan.wrapped = plan.wrapped or cache_message(name, f"torch's {found[0]} at {at}")
    plan.parents = tuple(parent for parent, _ in edges.values())
    plan.steps = tuple(step for _, step in edges.values())
    plan.nodes = tuple(m.__dict__ for _, m in nodes.values())
    plan.flagged = tuple(flagged)
    plan.registry = registry_key()
    plan.hooks_mark = -1
    plan.signature = layout(plan)
    plan.checkpointing = checkpointing_layout(plan)


def relayout(model: nn.Module) -> None:
    """Make the plans of the transformers models in ``model`` read its modules as they are now."""
    for m in model.modules():
        if isinstance(m.__dict__.get(PLAN), Plan):
            _relaid(m, m.__dict__[PLAN])


def _relaid(model: PreTrainedModel, plan: Plan) -> bool:
    """Re-read ``model``'s modules into ``plan`` when only the way to its attention changed; False otherwise."""
    if plan.name != _chosen(model) or plan.counter is not model._modules.get(WARMUP_ATTR) or (
            not plan.learnable and learnable_config(model.__dict__.get(GAINS_SOURCE, model.config)) is not None):
        return False
    paths = []
    for path, sub in _attention(model):
        if not isinstance(sub.__dict__.get(ROLE), int):
            return False
        paths.append(path)
    _fill_layout(model, plan, paths)
    return True


def read(model: PreTrainedModel) -> Any:
    """:func:`~pid_plugins.hf.config.read_config` of ``model``, its parameters from the outermost model's config."""
    return read_config(model.config, model.__dict__.get(GAINS_SOURCE, model.config))


def renew(model: PreTrainedModel, plan: Plan, changed: bool, renamed: Optional[str] = None) -> Plan:
    """A forward's plan: discovered again if ``changed``, its config read again if it changed; the first checks."""
    if renamed is not None:
        raise InternalChanged(CACHE_KEYWORD.message(f"{type(model).__name__}.forward got the cache as {renamed}="))
    if changed and not _relaid(model, plan):
        plan = discover(model, at_forward=True)
    if plan.reading is None or not plan.reading.holds(model.config, model.__dict__.get(GAINS_SOURCE, model.config)):
        plan.reading = None
        plan.reading = read(model)
    if not plan.first or plan.reading.method is None:
        return plan
    plan.first = False
    switched = model.__dict__.pop(SWITCH_CHECK, None)
    if switched is not None:  # one warning if the weights are trained
        for nested in model.modules():
            nested.__dict__.pop(SWITCH_CHECK, None)
        method = method_of(model.config)
        warn_switch_of_trained_weights(model, MethodChoice(method, model_method_config(model.config, method)),
                                       switched)
    if plan.learnable and not TP_PLAN.holds() and _tensor_parallel(model):
        raise InternalChanged(TP_PLAN.message(f"{type(model).__name__} runs tensor parallelism with learnable "
                                              "parameters, which this release cannot synchronise"))
    return plan


def _tensor_parallel(model: nn.Module) -> bool:
    """Whether transformers' tensor parallelism sharded ``model`` (a parameter is a DTensor on a mesh named "tp")."""
    return any("tp" in (getattr(getattr(p, "device_mesh", 0), "mesh_dim_names", 0) or ()) for p in model.parameters())


def hook(model: PreTrainedModel) -> None:
    """Give ``model`` its forward and its own ``_initialize_weights`` and ``init_continuous_batching``, once."""
    own = model.__dict__
    if FORWARD not in own:
        own[FORWARD] = own["forward"] = MethodForward(model, own.get("forward"))
    if "_initialize_weights" not in own:
        own["_initialize_weights"] = functools.partial(_initialize_weights, model)
    if "init_continuous_batching" not in own and hasattr(type(model), "init_continuous_batching"):
        own["init_continuous_batching"] = functools.partial(_init_continuous_batching, model)


def undiscover(model: nn.Module) -> None:
    """Take from ``model``'s modules everything discovery and :func:`hook` gave them."""
    for m in model.modules():
        learned_gains.detach(m)
        for attr in (ROLE, EARLIER):
            m.__dict__.pop(attr, None)
        if not isinstance(m, PreTrainedModel):
            continue
        m._modules.pop(WARMUP_ATTR, None)
        unhook(m)
        for name, ours in (("_initialize_weights", _initialize_weights),
                           ("init_continuous_batching", _init_continuous_batching)):
            given = m.__dict__.get(name)
            if isinstance(given, functools.partial) and given.func is ours:
                del m.__dict__[name]
        for attr in (PLAN, GAINS_SOURCE, WARMUP_SOURCE, SWITCH_CHECK):
            m.__dict__.pop(attr, None)
        ignore = m.__dict__.get("_keys_to_ignore_on_load_missing")
        if isinstance(ignore, set):
            ignore -= {learned_gains.MISSING_PATTERN, WARMUP_MISSING_KEY}


def discovered(model: nn.Module) -> bool:
    """Whether ``model`` has a plan (it was built with a method, or converted to one)."""
    return PLAN in model.__dict__


def rediscover(model: PreTrainedModel) -> PreTrainedModel:
    """Hook every PreTrainedModel in ``model`` and discover each afresh, outermost first."""
    for m in model.modules():
        if isinstance(m, PreTrainedModel):
            hook(m)
            for attr in (PLAN, GAINS_SOURCE, WARMUP_SOURCE):
                m.__dict__.pop(attr, None)
    for m in model.modules():  # outermost first: it hands its config (gains, base) to the nested models
        if isinstance(m, PreTrainedModel) and PLAN not in m.__dict__:
            discover(m)
    persist(model.config)
    return model


def post_init(model: PreTrainedModel) -> None:
    """The model's ``post_init``, once: discover a method model before any forward; extend its tensor-parallel plan."""
    model.__dict__.pop("post_init", None)
    # the layers exist, not initialised yet: what is made now is loaded by from_pretrained, or initialised
    attach_warmup(model)
    if ANY_COUNTER[0]:  # the counters of the nested models move to the outermost
        for m in model.modules():
            if m is not model and isinstance(m, PreTrainedModel) and m._modules.get(WARMUP_ATTR) is not None:
                counter = m._modules.pop(WARMUP_ATTR)
                plan = m.__dict__.get(PLAN)
                if plan is not None:  # it reads the outermost model's counter
                    plan.counter = None
                if model._modules.get(WARMUP_ATTR) is None:
                    give_counter(model, counter)
    cfg = learnable_config(model.__dict__.get("config"))
    if cfg is not None:  # the self-attention modules' learnable parameters
        method = method_of(model.config)
        if any([learned_gains.attach(sub, cfg, method) for path, sub in _attention(model)
                if not is_cross(path.split("."), sub)]):
            learned_gains.ignore_missing(model)
    sync_record(model)
    type(model).post_init(model)
    if method_of(model.config) is not None and PLAN not in model.__dict__:
        discover(model)
    if learnable_config(model.config) is not None:  # after post_init's init_parallel_plans
        learned_gains.extend_tp_plan(model)


def _init_continuous_batching(model: PreTrainedModel, *args: Any, **kwargs: Any):
    """``model.init_continuous_batching``: refused while the config names a method; else the class's own."""
    method = method_of(getattr(model, "config", None))
    if method is not None:
        name = method.name
        raise ValueError(
            f"attention method {name!r} cannot run under continuous batching (generate_batch, "
            "init_continuous_batching, continuous_batching_context_manager, generate(cache_implementation='paged')): "
            "it runs transformers' paged attention ('paged|eager', 'sdpa' or a flash kernel) over packed sequences, "
            "not the model's attention implementation, and would switch this model's attention to flash attention "
            f"where flash-attn is installed (with only a log warning), dropping {name!r}. Generate with "
            "model.generate() (dynamic or static cache), or switch the model back to its stock attention first "
            "(model.set_attn_implementation('sdpa'))")
    return type(model).init_continuous_batching(model, *args, **kwargs)


def _initialize_weights(model: PreTrainedModel, module: nn.Module, *args: Any, **kwargs: Any):
    """``model._initialize_weights``: initial values for learnable parameters and the warm-up counter."""
    refresh_record(model, module)  # one transformers made with torch.empty
    if learned_gains.reset(module):
        module._is_hf_initialized = True
        return None
    if isinstance(module, GainWarmup):
        from transformers import initialization as init

        init.zeros_(module.step)
        module._is_hf_initialized = True
        return None
    return type(model)._initialize_weights(model, module, *args, **kwargs)
