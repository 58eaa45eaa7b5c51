"""What ``import pid_plugins.hf`` changes in transformers, once, and what runs while a model is being built.

All through transformers' and torch's extension points except one class-level hook:

* every registered method (now and later, :func:`pid_plugins.register_method`) is registered with
  ``AttentionInterface`` (:func:`~pid_plugins.hf.attention.method_attention_forward`) and ``AttentionMaskInterface``
  (the base attention's mask function) under its name, and the names transformers holds are reserved
  (:func:`~pid_plugins.core.reserve_names`: a method cannot take ``"sdpa"`` or a ``PretrainedConfig`` attribute);
* ``PreTrainedModel.__init__`` (the one class-level hook; it runs at the start of every transformers model's
  ``__init__``, once its config is final and before its layers are built). Before transformers' own part,
  ``attn_implementation=None`` (TRL's CLI passes it when the user gives none) builds a folder saved with a method as
  saved (:func:`_as_saved`). After it, the model gets its inert forward hooks; a family that picks its attention
  classes from its own table is refused (it would fail with a bare ``KeyError`` while building its layers); a folder
  saved with a method built with the stock attention logs one warning, and one saved without the method the model
  runs is checked at its first forward (:func:`_check_loaded`); and the model's own ``post_init`` is replaced (an
  instance attribute, removed when it runs) so that, once the layers exist and before transformers initialises them,
  the warm-up counter and learnable parameters are made (``from_pretrained`` then loads them) and the model is
  discovered before its first forward. No torch-global hook, and no wrapper around the loaders: a method's
  parameters are ``config.<method>``, set on the config ``from_pretrained(..., config=config)`` takes;
* :func:`pid_plugins.finish_warmup` learns transformers models (:func:`pid_plugins.hf.conversion.finish`).

And per model, never on a class: every model the construction hook sees (and every model ``convert`` switches) gets
its own ``_initialize_weights`` and ``init_continuous_batching`` as instance attributes
(:func:`~pid_plugins.hf.instance.give_instance_methods`; transformers reads both on the instance). The first makes transformers' initialisation
of missing weights give learnable parameters their initial values and the warm-up counter ``t = 0`` (transformers
has no hook for modules it does not know); the second refuses a model running a method before continuous batching
(``generate_batch``, ``continuous_batching_context_manager``, ``generate(cache_implementation="paged")``) switches
its attention (to flash attention where flash-attn is installed, with only a log warning): continuous batching runs
its own paged attention, not the model's method, and has no extension point.
"""
from __future__ import annotations

import functools
import weakref
import logging
from typing import Any, Dict, Optional, Tuple

from transformers import AttentionInterface, AttentionMaskInterface, PreTrainedModel, PretrainedConfig

from ..versions import check_version
from ..core import AttentionMethod, list_methods, on_register, register_warmup_finisher, reserve_names
from . import checkpointing, conversion, discovery, record
from . import gains as learned_gains
from .attention import method_attention_forward, method_mask
from .internals import CONTINUOUS_BATCHING, GLOBAL_MAPPING, INITIALIZE_WEIGHTS
from .config import (
    BASE_ATTR, STOCK_ATTR, method_of, persist,
)
from .warmup import ANY_COUNTER, WARMUP_ATTR, attach_warmup, give_counter

__all__ = ["install", "warn_loaded_as_stock"]

logger = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------- while a model is built
_ORIGINAL_MODEL_INIT = None


def _model_init(self, *args: Any, **kwargs: Any) -> None:
    """``PreTrainedModel.__init__``, then what a model needs before its layers are built."""
    _as_saved(args[0] if args else kwargs.get("config"))
    _ORIGINAL_MODEL_INIT(self, *args, **kwargs)
    if self.__dict__.get(discovery.HOOKED, False):
        return
    _check_loaded(self)
    _check_family(self)
    discovery.hook(self)  # (with the model's own _initialize_weights and init_continuous_batching)
    persist(self.config)  # saved as the method's name whenever the model runs one at save time, else null
    self.__dict__["post_init"] = functools.partial(_post_init, self)


def _wrap_model_init() -> None:
    global _ORIGINAL_MODEL_INIT
    if _ORIGINAL_MODEL_INIT is None:
        _ORIGINAL_MODEL_INIT = PreTrainedModel.__init__
        PreTrainedModel.__init__ = functools.wraps(_ORIGINAL_MODEL_INIT)(_model_init)


def _check_family(model: PreTrainedModel) -> None:
    """Refuse, while the model is being built (before its layers exist), a family that picks its attention classes
    from its own table by ``config._attn_implementation`` (GPT-J's ``GPTJ_ATTENTION_CLASSES``, Falcon's, ...) instead
    of calling transformers' attention interface: a method's name is not in that table (transformers itself would
    fail with a bare ``KeyError``), and the family's attention code never calls the method."""
    config = getattr(model, "config", None)
    method = method_of(config)
    if method is not None:
        CONTINUOUS_BATCHING.require()  # the refusal the model's own init_continuous_batching makes
        discovery.check_family(type(model), config, method.name)


def _adopt_counters(model: PreTrainedModel) -> None:
    """Move the warm-up counters of the models nested in ``model`` to ``model``: one counter, on the outermost
    model, advanced once per forward of the whole model."""
    for m in model.modules():
        if m is not model and isinstance(m, PreTrainedModel) and m._modules.get(WARMUP_ATTR) is not None:
            counter = m._modules.pop(WARMUP_ATTR)
            plan = m.__dict__.get(discovery.PLAN)
            if plan is not None:  # it reads the outermost model's counter now (set by that model's discovery)
                plan.counter = None
            if model._modules.get(WARMUP_ATTR) is None:
                give_counter(model, counter)


def _attach_gains_at_construction(model: PreTrainedModel) -> None:
    """A model with learnable parameters, its layers just built: give each self-attention module its parameters
    now, so that ``from_pretrained`` loads the saved values into them."""
    cfg = discovery.learnable_config(model.__dict__.get("config"))
    if cfg is None:
        return
    added = False
    for name, child in model.named_children():
        if isinstance(child, PreTrainedModel):  # a nested model gave its own layers theirs in its post_init
            continue
        for path, sub in [(name, child), *((f"{name}.{p}", m) for p, m in discovery.walk(child))]:
            if not isinstance(sub, PreTrainedModel) and discovery.calls_interface(type(sub)) and \
                    not discovery.is_cross(path.split("."), sub):
                added = learned_gains.attach(sub, cfg, method_of(model.config)) or added
    if added:
        learned_gains.ignore_missing(model)


def _post_init(model: PreTrainedModel) -> None:
    """Runs once, as the model's ``post_init`` (the last step of every transformers model's ``__init__``): a model
    built with a method is discovered now, before any forward, so that a first forward under ``torch.compile`` traces
    no discovery. The instance attribute removes itself: later calls reach the class's ``post_init``. A model with
    learnable parameters gets their tensor-parallel plan entries here (:func:`~pid_plugins.hf.gains.extend_tp_plan`):
    ``post_init`` has just built the model's plan from its class, config and children, and an outer model builds
    its own from this one's when its ``post_init`` runs."""
    model.__dict__.pop("post_init", None)
    # the layers exist now, and transformers has not initialised them yet (the class's post_init does): the counter
    # (config.<method> has warmup_steps > 0) and learnable parameters are made here, so that from_pretrained loads
    # them and transformers' initialisation of what a checkpoint lacks reaches them
    attach_warmup(model)
    if ANY_COUNTER[0]:
        _adopt_counters(model)
    _attach_gains_at_construction(model)
    record.sync_record(model)  # the method record in its weights (on the outermost model)
    type(model).post_init(model)
    if method_of(model.config) is not None and discovery.PLAN not in model.__dict__:
        with discovery._LOCK:
            discovery.discover(model)
    if discovery.learnable_config(model.config) is not None:  # after post_init's init_parallel_plans
        learned_gains.extend_tp_plan(model)


# ------------------------------------------------------------------------------ what a saved folder records
def warn_loaded_as_stock(config: Any, saved: str, path: Any, where: str) -> None:
    """One warning: the checkpoint at ``path`` was saved from a model running attention method ``saved``, and is
    loaded with the stock attention ``config._attn_implementation`` (a different function than it was trained as)."""
    requested = getattr(config, "_attn_implementation", None)
    params = vars(config).get(saved) or "its transformers preset"
    logger.warning(
        "%s: %s was saved from a model running attention method %r (config.%s = %s); attn_implementation=%r loads "
        "its weights into the stock attention, a different function than the one they were trained with. To run it "
        "as saved: from_pretrained(%r, attn_implementation=%r) after `import pid_plugins.hf` (a tool that loads "
        "models by name: `pid-plugins run -- <command>` with model argument attn_implementation=%s, or none).",
        where, path, saved, saved, params, requested, str(path), saved, saved)


#: what was learnt about a config, by id (a model and the models nested in it share one config, each built through
#: the hook; configs are unhashable): ``{"saved": ..., "warned": True}``, dropped with the config
_SEEN: Dict[int, Tuple["weakref.ref[Any]", Dict[str, Any]]] = {}


def _seen(config: Any) -> Dict[str, Any]:
    entry = _SEEN.get(id(config))
    if entry is None or entry[0]() is not config:
        entry = _SEEN[id(config)] = (weakref.ref(config, lambda _, key=id(config): _SEEN.pop(key, None)), {})
    return entry[1]


def _saved_implementation(config: Any) -> Optional[str]:
    """The ``attn_implementation`` the folder ``config`` was read from records in its ``config.json`` (pid-plugins
    saves the method a model ran at save time, :func:`~pid_plugins.hf.config.persist`), read again locally once per
    config; None when there is no such folder (a config built in code), no entry, or nothing readable."""
    seen = _seen(config)
    if "saved" not in seen:
        seen["saved"] = None
        path = getattr(config, "_name_or_path", None)
        if path:
            try:
                saved, _ = PretrainedConfig.get_config_dict(path, local_files_only=True)
                seen["saved"] = saved.get("attn_implementation")
            except Exception:  # noqa: BLE001 - no config to read: the checkpoint records no method
                pass
    return seen["saved"]


def _records_method(config: Any) -> bool:
    """Whether ``config`` carries what a method model saves (``config.attention_base``, ``config.<method>``): only
    then is its folder's config.json read again."""
    own = vars(config)
    return own.get(BASE_ATTR) is not None or any(isinstance(own.get(name), dict) for name in list_methods())


def _as_saved(config: Any) -> None:
    """Before the model is built: ``attn_implementation=None`` (what TRL's CLI and others pass when the user gave
    none) loads a folder saved with a method as saved. transformers would build its default attention: it sets the
    config's implementation to the None it was given, over the folder's own."""
    if isinstance(config, PretrainedConfig) and config.__dict__.get("_attn_implementation_internal", "") is None \
            and _records_method(config):
        saved = _saved_implementation(config)
        if saved in list_methods():
            config._attn_implementation = saved


def _check_loaded(model: PreTrainedModel) -> None:
    """After ``PreTrainedModel.__init__``: a folder saved with a method built with the stock attention
    (``attn_implementation="sdpa"``/``"eager"``) logs one warning; a folder saved without the method the model now
    runs is marked for a check at the model's first forward, once its weights are loaded (trained weights switched at
    full strength: :func:`~pid_plugins.core.layer.warn_switch_of_trained_weights`, in the discovery pre-hook)."""
    config = model.config
    running = method_of(config)
    if running is None:
        if not _records_method(config):
            return
        saved = _saved_implementation(config)
        if saved in list_methods() and not _seen(config).get("warned"):
            _seen(config)["warned"] = True
            warn_loaded_as_stock(config, saved, config._name_or_path, f"{type(model).__name__}.from_pretrained")
    elif getattr(config, "_name_or_path", None) and _saved_implementation(config) != running.name:
        model.__dict__[discovery.SWITCH_CHECK] = f"{type(model).__name__}.from_pretrained"


# --------------------------------------------------------------------------------------- the registrations
def _register(method: AttentionMethod) -> None:
    """Every registered attention method is an ``attn_implementation`` of transformers, under its name: the same
    attention function (it reads the method from the forward's state) and the base attention's mask function."""
    AttentionInterface.register(method.name, method_attention_forward)
    AttentionMaskInterface.register(method.name, method_mask)


def _transformers_names() -> Dict[str, str]:
    """The names transformers holds, for :func:`~pid_plugins.core.reserve_names`: its attention and mask
    implementations (read live: kernels registered later count), ``"eager"`` (built in), and the attributes of
    ``PretrainedConfig`` and ours (a method's parameters are saved as ``config.<name>``)."""
    names = {name: f"PretrainedConfig.{name}, which a method's parameters (saved as config.<method name>) would overwrite"
             for name in {*dir(PretrainedConfig), *vars(PretrainedConfig())} if not name.startswith("_")}
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
    # what the changes below rely on
    for internal in (INITIALIZE_WEIGHTS, GLOBAL_MAPPING):
        internal.require()
    # torch's checkpointing internals, read by the per-forward check: settled here, once, so that a compiled forward
    # does not guard on (and recompile after) their first read
    checkpointing.require()
    _INSTALLED[0] = True
    _wrap_model_init()
    reserve_names("transformers", _transformers_names)
    on_register(_register)
    register_warmup_finisher(conversion.finish)
