"""vLLM: serve a method checkpoint (PID, NeuTRENO, value residual, Twicing, Elliptical) with vLLM's own attention.

``pip install pid-plugins`` beside vLLM registers the entry point ``pid_plugins.vllm:register`` in vLLM's
``vllm.general_plugins`` group; vLLM calls it in each of its processes. It

* checks every model config where vLLM resolves the class that serves it (:mod:`pid_plugins.vllm.routing`, in the
  process the user launched): a checkpoint whose ``config.json`` names a method (``"attn_implementation": "pid"``,
  parameters as ``"pid": {...}``) is served by one of the plugin's classes below, or refused there with one
  ``ValueError`` naming the method, the architecture and the class vLLM would have served it with;
* registers, under architecture names of its own (``PidPlugins<Architecture>``), a class for each architecture in
  :data:`~pid_plugins.vllm.config.ARCHITECTURES` (Llama, Mistral, Qwen2, Qwen3: :mod:`pid_plugins.vllm.models`) and
  for vLLM's Transformers backend, which serves other families (:mod:`pid_plugins.vllm.transformers_backend`): each
  runs the method's one core step around vLLM's paged attention. vLLM's own classes are not touched: a checkpoint
  that names no method is served by vLLM's class, as without the plugin;
* refuses, by what the method declares, what it cannot serve exactly (Elliptical's sequence mean, learnable gains, an
  unfinished warm-up, parallelism it does not cover, a vLLM outside the supported releases: :mod:`.config`).

Nothing runs from a checkpoint: the method is looked up by name in pid-plugins' registry, which holds the built-in
methods and those of installed packages (entry-point group ``pid_plugins.methods``, loaded by :func:`register`).
This module imports no vLLM code until vLLM calls :func:`register`.
"""
from __future__ import annotations

from .config import ARCHITECTURES, method_architecture

__all__ = ["ARCHITECTURES", "register"]


def register() -> None:
    """The ``vllm.general_plugins`` entry point: register the method-serving class of every architecture in
    :data:`ARCHITECTURES` and of vLLM's Transformers backend with vLLM's model registry under its own name
    (``PidPlugins<Architecture>``; lazily, by ``module:class``: vLLM imports it where it builds a model), and the
    check every model config passes there (:func:`pid_plugins.vllm.routing.install`), which sends a method
    checkpoint to them; first, the methods other installed packages declare (``pid_plugins.methods``). Safe to call
    more than once (vLLM loads plugins in each process)."""
    from vllm import ModelRegistry

    from ..catalogue import load_installed_methods
    from . import routing

    load_installed_methods()

    routing.install(ModelRegistry)
    for module, architectures in (("models", ARCHITECTURES), ("transformers_backend", routing.TRANSFORMERS_CLASSES)):
        for architecture in architectures:
            name = method_architecture(architecture)
            ModelRegistry.register_model(name, f"pid_plugins.vllm.{module}:{name}")
