"""What a transformers model config says about its attention method, and how that choice is saved (:func:`persist`)."""
from __future__ import annotations

import weakref
from typing import Any, Dict, Optional

import torch

from torch import nn

from ..core import AttentionMethod, GainWarmup, get_method, list_methods, make_warmup
from ..core.methods import find_method

__all__ = [
    "ATTN_IMPLEMENTATION", "BASE_ATTR", "BASES", "STOCK_ATTR", "WARMUP_ATTR", "WARMUP_SOURCE", "attach_warmup",
    "base_attention", "ConfigReading", "check_learnable", "counter_of", "give_counter", "is_persisted", "method_named",
    "method_of", "model_method_config", "persist", "pipeline_refusal", "read_config",
]

ATTN_IMPLEMENTATION = "pid"
"""PID's ``attn_implementation`` name (every other registered method is registered under its own name)."""
BASE_ATTR = "attention_base"
BASES = ("sdpa", "eager", "flex_attention")
"""The base attentions a method runs on (``convert(model, ..., base=...)``, saved as ``config.attention_base``)."""
WARMUP_ATTR = "attention_warmup"  # the outermost model's gain warm-up counter (a submodule)
WARMUP_SOURCE = "_pid_plugins_warmup"  # on nested models: the outermost model's counter (not a submodule)
WARMUP_MISSING_KEY = rf"(^|\.){WARMUP_ATTR}\.step$"  # for transformers' _keys_to_ignore_on_load_missing
ANY_COUNTER = [False]  # whether a counter was ever made (else a model's construction scans for none to adopt)
STOCK_ATTR = "stock_attention"  # the stock ``attn_implementation`` a model had before ``convert`` gave it a method

_PARSED: Dict[Any, Any] = {}
method_named = find_method  # the registered method called ``name``, or None


def method_of(config: Any) -> Optional[AttentionMethod]:
    """The attention method a model config runs, or None (a stock implementation)."""
    return find_method(getattr(config, "_attn_implementation", None))


def model_method_config(config: Any, method: Optional[AttentionMethod] = None) -> Any:
    """The parameters a model runs its method with: ``config.<method name>`` over the method's transformers preset."""
    method = method or method_of(config)
    if method is None:
        raise ValueError(
            f"model_method_config: this config runs no attention method of pid-plugins (attn_implementation="
            f"{getattr(config, '_attn_implementation', None)!r}); name the method: model_method_config(config, "
            f"get_method(<name>)) with one of {list_methods()}"
        )
    raw = getattr(config, method.name, None)
    key: Any = (method.name, tuple(sorted(raw.items())) if isinstance(raw, dict) else raw)
    try:
        cfg = _PARSED.get(key)
    except TypeError:  # unhashable values: let the method's config report them
        key, cfg = None, None
    if cfg is None:
        if torch.compiler.is_compiling():
            raise RuntimeError(
                f"config.{method.name} = {raw!r} was set after the model was built and first read under "
                f"torch.compile: call pid_plugins.hf.convert(model, {method.name!r}) (or run one eager forward) before "
                "compiling"
            )
        cfg = check_learnable(method, method.configure(dict(raw) if isinstance(raw, dict) else raw, "hf"))
        if key is not None:
            if len(_PARSED) > 256:
                _PARSED.clear()
            _PARSED[key] = cfg
    return cfg


def check_learnable(method: AttentionMethod, cfg: Any) -> Any:
    """``cfg``, refused if it asks for learnable parameters the method does not make (``method.make_learned``)."""
    if getattr(cfg, "learnable", False) and method.make_learned(cfg) is None:
        raise ValueError(f"config.{method.name}: attention method {method.name!r} makes no learnable parameters for "
                         f"{cfg!r}: set learnable=False")
    return cfg


def base_attention(config: Any) -> str:
    """The attention a method is added to: ``config.attention_base``, else ``"eager"`` (softcapping) or ``"sdpa"``."""
    base = getattr(config, BASE_ATTR, None)
    softcapping = getattr(config, "attn_logit_softcapping", None) is not None
    if base is None:
        return "eager" if softcapping else "sdpa"
    if base not in BASES:
        raise ValueError(f"config.{BASE_ATTR}={base!r} is not one of {BASES}")
    if base != "eager" and softcapping:
        name = getattr(method_of(config), "name", ATTN_IMPLEMENTATION)
        raise ValueError(
            f"{getattr(config, 'model_type', 'this model')} uses attention logit softcapping, which {base} cannot "
            f"compute: use base 'eager' (pid_plugins.hf.convert(model, {name!r}, base='eager'))"
        )
    return base


def counter_of(model: nn.Module) -> Optional[GainWarmup]:
    """The warm-up counter a model's layers read: its own, or the outermost model's (set at discovery)."""
    counter = model._modules.get(WARMUP_ATTR)
    return counter if counter is not None else model.__dict__.get(WARMUP_SOURCE)


def give_counter(model: nn.Module, counter: GainWarmup) -> None:
    """Make ``counter`` ``model``'s ``attention_warmup``."""
    ignore = getattr(model, "_keys_to_ignore_on_load_missing", None)
    model._keys_to_ignore_on_load_missing = {*(ignore or ()), WARMUP_MISSING_KEY}
    setattr(model, WARMUP_ATTR, counter)


def attach_warmup(model: nn.Module, config: Any = None) -> None:
    """Give ``model`` the counter its method's parameters ask for (keeping an existing ``t``), or remove it."""
    current = model._modules.get(WARMUP_ATTR)
    if config is None:
        method = method_of(model.config)
        if method is not None and getattr(model.config, method.name, None) is not None:
            config = model_method_config(model.config, method)
    steps = getattr(config, "warmup_steps", 0)
    if not steps and current is None:
        return
    counter = make_warmup(steps, current, like=next(model.parameters(), None))
    if counter is None:
        del model._modules[WARMUP_ATTR]
        return
    ANY_COUNTER[0] = True
    if counter is not current:
        counter.train(model.training)  # a counter made in training mode would count the forwards of an eval model
        give_counter(model, counter)


def pipeline_refusal(config: Any, method: Any, params: Any) -> Optional[str]:
    """The message refusing transformers' own pipeline parallelism for a method with cross-layer state, else None."""
    distributed = getattr(config, "distributed_config", None)
    pp_size = distributed.get("pp_size") if isinstance(distributed, dict) else getattr(distributed, "pp_size", None)
    numeric = isinstance(pp_size, (int, float)) and not isinstance(pp_size, bool)
    if not numeric or pp_size <= 1 or not method.state_fields or method.is_identity(params):
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


def _plain(value: Optional[str]) -> Optional[str]:
    return value


class _SavedImplementation:
    """``config.attn_implementation``: serialises as the method's name when the model runs a method, else null."""

    def __init__(self, config: Any):
        self._config = weakref.ref(config)

    def _current(self) -> Optional[str]:
        config = self._config()
        return None if config is None else config._attn_implementation

    def __deepcopy__(self, memo: dict) -> Any:
        config = self._config()
        copied = memo.get(id(config)) if config is not None else None
        if copied is not None:  # a deep copy of the model: stay live
            return _SavedImplementation(copied)
        current = self._current()  # to_dict: the value to save
        return current if find_method(current) is not None else None

    def __reduce__(self):  # pickling (torch.save of a whole model) stores the value, like deepcopy
        return _plain, (self.__deepcopy__({}),)

    def __eq__(self, other: object) -> bool:
        return self._current() == other

    def __hash__(self) -> int:
        return hash(self._current())

    def __repr__(self) -> str:
        return repr(self._current())


def is_persisted(config: Any) -> bool:
    """Whether :func:`persist` made ``config`` save the method it runs."""
    return isinstance(config.__dict__.get("attn_implementation"), _SavedImplementation)


def persist(config: Any) -> None:
    """Make ``config`` save the method it runs as ``attn_implementation`` in config.json."""
    if not is_persisted(config):
        config.attn_implementation = _SavedImplementation(config)


#: the entries of a config's ``__dict__`` a forward reads (besides ``config.<method>``)
_WATCHED = ("_attn_implementation_internal", BASE_ATTR, "attn_logit_softcapping", "distributed_config",
            "_output_attentions", "use_cache")
_GENERIC_GETATTR = object.__getattribute__


class ConfigReading:
    """What a model's config says for its forwards, read again when a watched entry of its ``__dict__`` changes."""

    __slots__ = ("config", "source", "keys", "source_keys", "seen", "copies", "contents", "method", "gains", "base",
                 "refusal", "output_attentions", "use_cache", "gains_learnable", "warmup", "zero", "chosen")

    def __getstate__(self) -> dict:  # ``chosen`` holds functions of this process: made again
        return {key: getattr(self, key) for key in self.__slots__ if key != "chosen" and hasattr(self, key)}

    def __setstate__(self, state: dict) -> None:
        for key, value in state.items():
            setattr(self, key, value)
        self.chosen = None

    def holds(self, config: Any, source: Any, compiling: Optional[bool] = None) -> bool:
        """Whether ``config`` and ``source`` are the ones read and their watched entries unchanged."""
        if config is not self.config or source is not self.source:
            return False
        if compiling is None:
            compiling = torch.compiler.is_compiling()
        if not compiling:  # one C-level pass, past PretrainedConfig's own __getattribute__: identical or equal
            entries = list(map(_GENERIC_GETATTR(config, "__dict__").get, self.keys))
            if self.source_keys:
                entries += map(_GENERIC_GETATTR(source, "__dict__").get, self.source_keys)
            return entries == self.copies
        seen, first = self.seen, len(self.keys)
        for i, key in enumerate(self.keys + self.source_keys):  # loops dynamo traces
            if (config if i < first else source).__dict__.get(key) is not seen[i]:
                return False
        for i, contents in self.contents:
            if _contents(seen[i]) != contents:
                return False
        return True


def _contents(value: Any) -> Any:
    return tuple(sorted(value.items(), key=repr)) if isinstance(value, dict) else tuple(value)


def read_config(config: Any, source: Any) -> ConfigReading:
    """Read ``config`` and ``source`` (the outermost model's, whose method parameters it runs) for its forwards."""
    reading = ConfigReading()
    reading.config, reading.source = config, source
    reading.method = method = method_of(config)
    reading.gains = reading.base = reading.refusal = reading.chosen = None  # chosen: the first eager forward's path
    reading.gains_learnable = reading.warmup = False
    reading.zero = True  # the parameters compute the stock attention
    reading.output_attentions = bool(getattr(config, "output_attentions", False))
    reading.use_cache = getattr(config, "use_cache", False)
    keys, source_keys = _WATCHED, ()
    if method is not None:
        keys += (method.name,)
        if source is not config:
            source_keys = ("_attn_implementation_internal", method.name)
        gains = reading.gains = model_method_config(source, method)
        reading.base = base_attention(config)
        reading.gains_learnable = bool(getattr(gains, "learnable", False))
        reading.warmup = bool(getattr(gains, "warmup_steps", 0))
        reading.zero = method.is_identity(gains)
        if getattr(config, "distributed_config", None) is not None:
            reading.refusal = pipeline_refusal(config, method, gains)
    reading.keys, reading.source_keys = keys, source_keys
    reading.seen = [config.__dict__.get(key) for key in keys] + [source.__dict__.get(key) for key in source_keys]
    reading.contents = tuple((i, _contents(value)) for i, value in enumerate(reading.seen)
                             if isinstance(value, (dict, list)))
    reading.copies = [dict(v) if isinstance(v, dict) else list(v) if isinstance(v, list) else v for v in reading.seen]
    return reading
