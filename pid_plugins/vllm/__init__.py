"""vLLM: serve a method checkpoint (PID, NeuTRENO, value residual, Twicing, Elliptical) with vLLM's own attention.

The entry point ``pid_plugins.vllm:register`` (group ``vllm.general_plugins``) registers the plugin's classes
(``PidPlugins<Architecture>``: :mod:`~pid_plugins.vllm.models`, :mod:`~pid_plugins.vllm.transformers_backend`) and
the check that sends a method checkpoint to them or refuses it (:mod:`~pid_plugins.vllm.routing`,
:mod:`~pid_plugins.vllm.config`); vLLM's own classes are untouched. No vLLM code is imported until vLLM calls it."""
from __future__ import annotations

from .config import ARCHITECTURES, method_architecture

__all__ = ["ARCHITECTURES", "register"]


def register() -> None:
    """The ``vllm.general_plugins`` entry point (called in each vLLM process): the installed packages' methods, the
    plugin's classes (lazily, by ``module:class``) and the check of every model config (:func:`routing.install`)."""
    from vllm import ModelRegistry

    from ..catalogue import load_installed_methods
    from . import routing

    load_installed_methods()

    routing.install(ModelRegistry)
    for module, architectures in (("models", ARCHITECTURES), ("transformers_backend", routing.TRANSFORMERS_CLASSES)):
        for architecture in architectures:
            name = method_architecture(architecture)
            ModelRegistry.register_model(name, f"pid_plugins.vllm.{module}:{name}")
