"""What ``import pid_plugins.hf`` changes in transformers, once, and what runs while a model is being built.

All through transformers' and torch's extension points except the last:

* every registered method (now and later, :func:`pid_plugins.register_method`) is registered with
  ``AttentionInterface`` (:func:`~pid_plugins.hf.attention.method_attention_forward`) and ``AttentionMaskInterface``
  (the base attention's mask function) under its name, and the names transformers holds are reserved
  (:func:`~pid_plugins.core.reserve_names`: a method cannot take ``"sdpa"`` or a ``PretrainedConfig`` attribute);
* ``PreTrainedModel.__init__`` (the one class-level hook; it runs at the start of every transformers model's
  ``__init__``, once its config is final and before its layers are built) gives the model its inert forward hooks,
  refuses a family that picks its attention classes from its own table (it would fail with a bare ``KeyError``
  while building its layers), and replaces the model's own ``post_init`` (an instance attribute, removed when it
  runs) so that, once the layers exist and before transformers initialises them, the warm-up counter and learnable
  parameters are made (``from_pretrained`` then loads them) and the model is discovered before its first forward.
  No torch-global hook: a module that is not a transformers model is never looked at;
* ``PreTrainedModel.from_pretrained`` and ``PreTrainedModel._from_config`` (behind every ``from_config``) are wrapped
  once, so that a method's parameters are a keyword of both (``attn_implementation="pid", pid={...}``): transformers
  hands a keyword that names no attribute of the config to the model's ``__init__``, which takes none, and
  ``from_config`` hands every keyword there, so no config-side extension point reaches them;
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

import contextvars
import functools
import logging
from typing import Any, Dict, Optional

from transformers import AttentionInterface, AttentionMaskInterface, PreTrainedModel, PretrainedConfig

from ..versions import check_version
from ..core import AttentionMethod, MethodChoice, list_methods, on_register, register_warmup_finisher, reserve_names
from . import checkpointing, conversion, discovery
from . import gains as learned_gains
from .attention import method_attention_forward, method_mask
from .internals import CONTINUOUS_BATCHING, GLOBAL_MAPPING, INITIALIZE_WEIGHTS, LOADERS
from .config import (
    BASE_ATTR, STOCK_ATTR, apply_method_kwargs, method_of, model_method_config, persist, take_method_kwargs,
)
from .warmup import ANY_COUNTER, WARMUP_ATTR, attach_warmup, give_counter

__all__ = ["install", "warn_loaded_as_stock"]

logger = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------- while a model is built
_ORIGINAL_MODEL_INIT = None


def _model_init(self, *args: Any, **kwargs: Any) -> None:
    """``PreTrainedModel.__init__``, then what a model needs before its layers are built."""
    _ORIGINAL_MODEL_INIT(self, *args, **kwargs)
    if self.__dict__.get(discovery.HOOKED, False):
        return
    request = _REQUEST.get()
    if request is not None:  # from_pretrained(..., pid={...}): the config is final now, the layers not built yet
        apply_method_kwargs(self.config, *request)
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
    type(model).post_init(model)
    if method_of(model.config) is not None and discovery.PLAN not in model.__dict__:
        with discovery._LOCK:
            discovery.discover(model)
    if discovery.learnable_config(model.config) is not None:  # after post_init's init_parallel_plans
        learned_gains.extend_tp_plan(model)


# --------------------------------------------------------------- a method's parameters as a loader keyword
#: during ``from_pretrained(..., <method>=...)``: (the parameters by method name, the call for messages)
_REQUEST: contextvars.ContextVar[Optional[tuple]] = contextvars.ContextVar("pid_plugins_hf_request", default=None)


def _from_pretrained_with_method_kwargs(original: Any) -> Any:
    """``original`` (a ``from_pretrained`` function) taking a method's parameters as a keyword."""
    @functools.wraps(original)
    def from_pretrained(cls, *args: Any, **kwargs: Any):
        if _REQUEST.get() is not None:  # an outer loader took over (the auto class, then the model class)
            return original(cls, *args, **kwargs)
        where = f"{cls.__name__}.from_pretrained"
        if "attn_implementation" in kwargs and kwargs["attn_implementation"] is None:
            # None is "no choice" (what TRL's CLI and others pass when the user gave none): the checkpoint's own
            # attention, as without the keyword (transformers would build its default attention for a method folder)
            del kwargs["attn_implementation"]
        given = take_method_kwargs(kwargs, where)
        token = _REQUEST.set((given, where))
        try:
            loaded = original(cls, *args, **kwargs)
        finally:
            _REQUEST.reset(token)
        model = loaded[0] if isinstance(loaded, tuple) else loaded
        config = getattr(model, "config", None)
        running = method_of(config)
        # a checkpoint trained without this method switched to it (its config read again, from the files the load
        # just used, only when the model runs a method)
        if running is not None and running.name != _saved_implementation(args, kwargs):
            conversion.warn_trained_switch(model, MethodChoice(running, model_method_config(config, running)),
                                           where)
        # a method checkpoint loaded as the stock attention (attn_implementation="sdpa"/"eager"): read again only when
        # the config carries what a method model saves (config.attention_base, config.<method>)
        elif running is None and config is not None and (
                vars(config).get(BASE_ATTR) is not None
                or any(isinstance(vars(config).get(name), dict) for name in list_methods())):
            saved = _saved_implementation(args, kwargs)
            if saved in list_methods():
                warn_loaded_as_stock(config, saved, args[0] if args else kwargs.get("pretrained_model_name_or_path"),
                                     where)
        return loaded

    return from_pretrained


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


#: the loader keywords that say where a checkpoint's config.json is (read again, locally, for the method it records)
_CONFIG_KEYWORDS = ("subfolder", "revision", "cache_dir", "token", "gguf_file", "local_files_only")


def _saved_implementation(args: tuple, kwargs: Dict[str, Any]) -> Optional[str]:
    """The ``attn_implementation`` a checkpoint's ``config.json`` records (pid-plugins saves the method a model ran
    at save time, :func:`~pid_plugins.hf.config.persist`), or None: the checkpoint was trained with the stock
    attention (or its config cannot be read)."""
    path = args[0] if args else kwargs.get("pretrained_model_name_or_path")
    if path is None:
        return None
    try:
        saved, _ = PretrainedConfig.get_config_dict(path, **{k: kwargs[k] for k in _CONFIG_KEYWORDS if k in kwargs})
    except Exception:  # noqa: BLE001 - no config to read: the checkpoint records no method
        return None
    return saved.get("attn_implementation")


def _wrap_loaders() -> None:
    """``from_pretrained(..., <method>=params)`` (of the model classes and of the auto classes, which would otherwise
    let ``AutoConfig`` replace a saved ``config.<method>`` with them unchecked): the parameters are checked before
    anything is loaded and set on the config when the model is built from it (the first registration of a child,
    before any layer exists, so learnable parameters and the warm-up counter are made and loaded from the
    checkpoint). ``_from_config(config, ..., <method>=params)``: set on ``config`` before the model is built (as
    transformers sets ``attn_implementation``)."""
    from transformers.models.auto.auto_factory import _BaseAutoModelClass

    original_from_config = PreTrainedModel.__dict__["_from_config"].__func__

    @functools.wraps(original_from_config)
    def _from_config(cls, config, **kwargs: Any):
        where = f"{cls.__name__}.from_config"
        given = take_method_kwargs(kwargs, where)
        if given:  # checked against the implementation the model will run
            chosen = kwargs.get("attn_implementation", getattr(config, "_attn_implementation", None))
            apply_method_kwargs(config, given, where, chosen=chosen)
        return original_from_config(cls, config, **kwargs)

    # the auto classes copy _BaseAutoModelClass.from_pretrained when transformers builds them (auto_class_update): those
    # built before this import (another library imported transformers' auto classes first) hold the copy
    import sys

    owners = [PreTrainedModel, _BaseAutoModelClass]
    for module in [m for name, m in list(sys.modules.items()) if name.startswith("transformers.models.auto.")]:
        owners += [c for c in vars(module).values() if isinstance(c, type) and issubclass(c, _BaseAutoModelClass)
                   and c is not _BaseAutoModelClass and "from_pretrained" in c.__dict__]
    for owner in owners:
        original = owner.__dict__["from_pretrained"].__func__
        owner.from_pretrained = classmethod(_from_pretrained_with_method_kwargs(original))
    PreTrainedModel._from_config = classmethod(_from_config)


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
    for internal in (INITIALIZE_WEIGHTS, LOADERS, GLOBAL_MAPPING, CONTINUOUS_BATCHING):
        internal.require()
    # torch's checkpointing internals, read by the per-forward check: settled here, once, so that a compiled forward
    # does not guard on (and recompile after) their first read
    checkpointing.require()
    _INSTALLED[0] = True
    _wrap_model_init()
    _wrap_loaders()
    reserve_names("transformers", _transformers_names)
    on_register(_register)
    register_warmup_finisher(conversion.finish)
