"""What ``import pid_plugins.hf`` changes in transformers, once: every registered method becomes an
``attn_implementation`` and a mask function; ``PreTrainedModel.__init__`` (transformers has no other construction
hook) builds a folder saved with a method as saved, and gives a model built with a method its hooks.
"""
from __future__ import annotations

import functools
import weakref
import logging
from typing import Any, Dict, Optional, Tuple

from transformers import AttentionInterface, AttentionMaskInterface, PreTrainedModel, PretrainedConfig

from ..versions import check_version, require
from ..core import AttentionMethod, list_methods, on_register, register_warmup_finisher, reserve_names
from . import conversion, discovery
from .attention import method_attention_forward, method_mask
from .internals import GLOBAL_MAPPING, INITIALIZE_WEIGHTS
from .config import BASE_ATTR, STOCK_ATTR, WARMUP_ATTR, method_of, persist

__all__ = ["install"]

logger = logging.getLogger(__name__)
_ORIGINAL_MODEL_INIT: Any = None


def _model_init(self, *args: Any, **kwargs: Any) -> None:
    """``PreTrainedModel.__init__``, then what a model needs before its layers are built."""
    _as_saved(args[0] if args else kwargs.get("config"))
    _ORIGINAL_MODEL_INIT(self, *args, **kwargs)
    if discovery.hooked(self):
        return
    _check_loaded(self)
    method = method_of(self.config)
    if method is None:  # a stock model: nothing of ours
        return
    discovery.check_family(type(self), self.config, method.name)  # before its layers exist
    discovery.hook(self)
    persist(self.config)  # saved as the method's name whenever the model runs one at save time, else null
    self.__dict__["post_init"] = functools.partial(discovery.post_init, self)


#: what was learnt about a config (unhashable), by id: ``{"saved": ..., "warned": True}``, dropped with the config
_SEEN: Dict[int, Tuple["weakref.ref[Any]", Dict[str, Any]]] = {}


def _seen(config: Any) -> Dict[str, Any]:
    entry = _SEEN.get(id(config))
    if entry is None or entry[0]() is not config:
        entry = _SEEN[id(config)] = (weakref.ref(config, lambda _, key=id(config): _SEEN.pop(key, None)), {})
    return entry[1]


def _saved_implementation(config: Any) -> Optional[str]:
    """The ``attn_implementation`` recorded in the config.json ``config`` was read from, once per config; else None."""
    seen = _seen(config)
    if "saved" not in seen:
        seen["saved"] = None
        path = getattr(config, "_name_or_path", None)
        try:  # no config to read: the checkpoint records no method
            if path:
                seen["saved"] = PretrainedConfig.get_config_dict(path, local_files_only=True)[0].get(
                    "attn_implementation")
        except Exception:  # noqa: BLE001
            pass
    return seen["saved"]


def _records_method(config: Any) -> bool:
    """Whether ``config`` carries what a method model saves (only then is its config.json read again)."""
    own = vars(config)
    return own.get(BASE_ATTR) is not None or any(isinstance(own.get(name), dict) for name in list_methods())


def _as_saved(config: Any) -> None:
    """Before the model is built: ``attn_implementation=None`` loads a folder saved with a method as saved."""
    if isinstance(config, PretrainedConfig) and config.__dict__.get("_attn_implementation_internal", "") is None \
            and _records_method(config):
        saved = _saved_implementation(config)
        if saved in list_methods():
            config._attn_implementation = saved


def _check_loaded(model: PreTrainedModel) -> None:
    """After ``PreTrainedModel.__init__``: warn about (or check at the first forward) a method the folder lacks."""
    config = model.config
    running = method_of(config)
    if running is None:
        if not _records_method(config):
            return
        saved = _saved_implementation(config)
        if saved in list_methods() and not _seen(config).get("warned"):
            _seen(config)["warned"] = True
            path = config._name_or_path
            logger.warning(
                "%s: %s was saved from a model running attention method %r (config.%s = %s); attn_implementation=%r "
                "loads its weights into the stock attention, a different function than the one they were trained "
                "with. To run it as saved: from_pretrained(%r, attn_implementation=%r) after `import pid_plugins.hf` "
                "(a tool that loads models by name: `pid-plugins run -- <command>` with model argument "
                "attn_implementation=%s, or none).", f"{type(model).__name__}.from_pretrained", path, saved, saved,
                vars(config).get(saved) or "its transformers preset", getattr(config, "_attn_implementation", None),
                str(path), saved, saved)
    elif getattr(config, "_name_or_path", None) and _saved_implementation(config) != running.name:
        model.__dict__[discovery.SWITCH_CHECK] = f"{type(model).__name__}.from_pretrained"


def _register(method: AttentionMethod) -> None:
    """Register every attention method as an ``attn_implementation`` of transformers, with its base's mask function."""
    AttentionInterface.register(method.name, method_attention_forward)
    AttentionMaskInterface.register(method.name, method_mask)


def _transformers_names() -> Dict[str, str]:
    """The names transformers holds (implementations, ``"eager"``, config attributes), for ``reserve_names``."""
    names = {name: f"PretrainedConfig.{name}, which a method's parameters (saved as config.<method name>) would "
                   "overwrite" for name in {*dir(PretrainedConfig), *vars(PretrainedConfig())}
             if not name.startswith("_")}
    names.update({name: f"pid_plugins' configuration attribute config.{name}"
                  for name in (BASE_ATTR, STOCK_ATTR, WARMUP_ATTR)})
    replaced = "which a method of that name would replace for every model that uses it, also models without a method"
    names["eager"] = f'its built-in attn_implementation="eager", {replaced}'
    for interface, ours in ((AttentionMaskInterface, method_mask), (AttentionInterface, method_attention_forward)):
        for name, function in interface._global_mapping.items():
            if function is not ours:
                names[name] = f'its attn_implementation="{name}" ({interface.__name__}), {replaced}'
    return names


_INSTALLED = [False]


def install() -> None:
    """Make the changes above, once (``import pid_plugins.hf`` calls it)."""
    if _INSTALLED[0]:
        return
    check_version("transformers")
    require(INITIALIZE_WEIGHTS, GLOBAL_MAPPING)  # what the changes below rely on
    _INSTALLED[0] = True
    global _ORIGINAL_MODEL_INIT
    if _ORIGINAL_MODEL_INIT is None:
        _ORIGINAL_MODEL_INIT = PreTrainedModel.__init__
        PreTrainedModel.__init__ = functools.wraps(_ORIGINAL_MODEL_INIT)(_model_init)
    reserve_names("transformers", _transformers_names)
    on_register(_register)
    register_warmup_finisher(conversion.finish)
