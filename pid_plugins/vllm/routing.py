"""Which class serves a method checkpoint: the check every model config passes in vLLM, before anything is built.

vLLM decides which class serves a checkpoint in its model registry: ``ModelRegistry.inspect_model_cls`` when
``ModelConfig`` is made (in the process the user launched: ``LLM(...)``, the OpenAI server) and
``resolve_model_cls`` where the worker builds the model. vLLM has no extension point for a config check, so
:func:`install` wraps both methods on the registry object. A checkpoint whose config names a method
(:func:`config_choice`) is then, whatever its architecture and ``model_impl``:

* served by the plugin's class registered as ``PidPlugins<Architecture>``
  (:func:`~pid_plugins.vllm.config.method_architecture`), ``<Architecture>`` being what vLLM resolves for the
  checkpoint: a native family of :data:`~pid_plugins.vllm.config.ARCHITECTURES` (``model_impl`` ``auto`` or
  ``vllm``), or vLLM's Transformers backend (:data:`TRANSFORMERS_CLASSES`: ``model_impl="transformers"``, and the
  fallback of ``auto`` for an architecture without a native class of the plugin);
* or refused, with one ``ValueError`` naming the method, the architecture and the class vLLM would serve it with.

A checkpoint's ``architectures`` may name the plugin's class itself (``"PidPluginsLlamaForCausalLM"``): it is
resolved as the architecture it stands for (``LlamaForCausalLM``), and vLLM without the plugin refuses it (an
architecture it does not know). A checkpoint that names no method (or zero gains) is resolved by vLLM alone,
unchanged: vLLM's own class, as without the plugin.
"""
from __future__ import annotations

import functools
import logging
from typing import Any, Callable, List, Optional, Sequence, Tuple

from ..core import MethodChoice, list_methods
from ..versions import InternalChanged
from .config import (ARCHITECTURES, FAMILIES, STOCK_ATTENTIONS, check_options, method_architecture, method_choice,
                     stock_architecture)

__all__ = ["TRANSFORMERS_CLASSES", "config_choice", "install", "plan", "confirm"]

logger = logging.getLogger(__name__)

#: vLLM's Transformers-backend classes the plugin serves methods with (pid_plugins.vllm.transformers_backend)
TRANSFORMERS_CLASSES = ("TransformersForCausalLM", "TransformersMoEForCausalLM")
#: set on a wrapper, so that :func:`install` wraps once per process
_WRAPPED = "_pid_plugins_checked"


def where(model_config: Any, architectures: Sequence[str]) -> str:
    name = architectures[0] if architectures else "no architecture"
    return f"vLLM serving {getattr(model_config, 'model', 'a checkpoint')!s} ({name})"


def _configs(model_config: Any) -> List[Any]:
    found = []
    for name in ("hf_config", "hf_text_config"):
        config = getattr(model_config, name, None)
        if config is not None and all(config is not other for other in found):
            found.append(config)
    return found


def config_choice(model_config: Any, place: str) -> Optional[MethodChoice]:
    """The method and parameters ``model_config``'s checkpoint names (its config, or the text config of a
    multimodal one), or None when it names none (or zero gains). A ``config.<method>`` beside an
    ``attn_implementation`` that is not that method is ambiguous and refused (``convert(model, "softmax")`` removes
    the parameters, so a softmax checkpoint of pid-plugins has none)."""
    for config in _configs(model_config):
        attention = getattr(config, "_attn_implementation", None)
        if attention in list_methods():
            choice = method_choice(config, place)
            if choice is not None and getattr(config, attention, None) is None:
                # the preset, written out where vLLM reads the model's parameters: its compile cache is keyed on the
                # config (hf_config's JSON holds config.<method>, not attn_implementation), so it names the method
                setattr(config, attention, choice.config.to_dict())
            return choice
        named = [name for name in list_methods() if getattr(config, name, None) is not None]
        if named and (attention is None or attention in STOCK_ATTENTIONS):
            raise ValueError(
                f"{place}: config.json holds the parameters of attention method {named[0]!r} (config.{named[0]}) but "
                f"attn_implementation={attention!r}: vLLM would serve softmax attention, not the method the "
                f"parameters belong to. Set \"attn_implementation\": {named[0]!r} in config.json to serve the method, "
                f"or remove \"{named[0]}\" for the stock model (pid_plugins.hf.convert(model, 'softmax') does).")
    return None


def plan(architectures: Sequence[str], model_config: Any) -> Optional[MethodChoice]:
    """Before vLLM resolves the class: the method the checkpoint names (refused here when it cannot be served:
    Elliptical's sequence mean, learnable or warming-up parameters), and for ``model_impl="auto"`` and an architecture
    without a native class of the plugin, ``model_impl`` set to ``"transformers"`` (the method runs in vLLM's
    Transformers backend)."""
    choice = config_choice(model_config, where(model_config, architectures))
    if choice is None:
        return None
    from . import internals

    internals.check_release(where(model_config, architectures))
    native = any(architecture in ARCHITECTURES for architecture in architectures)
    if str(getattr(model_config, "model_impl", "auto")) == "auto" and not native:
        model_config.model_impl = "transformers"
        logger.info("%s: attention method %r, served through vLLM's Transformers backend (model_impl='transformers': "
                    "pid_plugins.vllm has no native class for this architecture)", where(model_config, architectures),
                    choice.method.name)
    return choice


def confirm(choice: MethodChoice, architectures: Sequence[str], model_config: Any, resolved: str) -> None:
    """After vLLM resolved ``resolved`` (the architecture whose class serves the checkpoint): refuse unless that class
    is one of the plugin's (native, or the Transformers backend's) and serves text generation."""
    impl = str(getattr(model_config, "model_impl", "auto"))
    runner, convert = getattr(model_config, "runner_type", "generate"), getattr(model_config, "convert_type", "none")
    if resolved in TRANSFORMERS_CLASSES or (resolved in ARCHITECTURES and impl != "transformers"):
        if runner in ("generate", None) and convert in ("none", None):
            if resolved in ARCHITECTURES:  # the family options the native layer loop does not run: refused here too
                check_options(FAMILIES[resolved], model_config.hf_config, where(model_config, architectures))
            return
        what = f"runner {runner!r} with convert {convert!r}"
    elif resolved.startswith("Transformers"):
        what = f"vLLM's Transformers backend class {resolved}"
    else:
        what = f"vLLM's own {resolved} class"
    name = choice.method.name
    raise ValueError(
        f"{where(model_config, architectures)}: config.json names attention method {name!r}, but vLLM would serve "
        f"this checkpoint with {what} (model_impl={impl!r}), which computes softmax attention without {name!r}. "
        f"pid_plugins.vllm serves {name!r} for text generation with its own classes of {', '.join(ARCHITECTURES)} "
        f"and through vLLM's Transformers backend ({' and '.join(TRANSFORMERS_CLASSES)}: model_impl='transformers', "
        "or 'auto' for other architectures) where vLLM runs the family's transformers code. Serve it that way, or "
        "with transformers and pid_plugins.hf.")


def _checked(original: Callable[..., Tuple[Any, str]], served: Callable[[str], Any]) -> Callable[..., Tuple[Any, str]]:
    """``original`` (the registry's resolution), and for a method checkpoint the plugin's class of what it resolved
    (``served``: the registry's own lookup of a registered architecture)."""

    @functools.wraps(original)
    def resolve(architectures: Any, model_config: Any) -> Tuple[Any, str]:
        names = [architectures] if isinstance(architectures, str) else list(architectures or [])
        stock = [stock_architecture(name) for name in names]
        choice = plan(stock, model_config)
        result = original(architectures if stock == names else stock, model_config)
        if choice is None:
            return result
        confirm(choice, stock, model_config, result[1])
        architecture = method_architecture(result[1])
        found = served(architecture)
        if found is None:
            raise InternalChanged(f"{where(model_config, stock)}: vLLM's model registry has no loadable class "
                                  f"{architecture} (pid_plugins.vllm registers it when vLLM loads its plugins); "
                                  "see vLLM's log above for the import error.")
        return found, architecture

    setattr(resolve, _WRAPPED, True)
    return resolve


#: the registry's resolution methods the plugin wraps, with the registry's own lookup of one registered architecture
_LOOKUPS = {"inspect_model_cls": "_try_inspect_model_cls", "resolve_model_cls": "_try_load_model_cls"}


def install(registry: Any) -> None:
    """Wrap ``registry.inspect_model_cls`` and ``registry.resolve_model_cls`` (vLLM's ``ModelRegistry``) with the
    check, on the object (its class is unchanged); once per process. Both are checked by behaviour first
    (:func:`pid_plugins.vllm.internals.check_registry`)."""
    from . import internals

    internals.check_registry(registry)
    for name, lookup in _LOOKUPS.items():
        bound = getattr(registry, name)
        if not getattr(bound, _WRAPPED, False):
            setattr(registry, name, _checked(bound, getattr(registry, lookup)))
