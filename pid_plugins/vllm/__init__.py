"""vLLM: serve a method checkpoint (PID, NeuTRENO, value residual) with vLLM's own attention backend.

``pip install pid-plugins`` beside vLLM registers the entry point ``pid_plugins.vllm:register`` in vLLM's
``vllm.general_plugins`` group; vLLM calls it in each of its processes. It replaces vLLM's model class for the
architectures in :data:`~pid_plugins.vllm.config.ARCHITECTURES` (Llama, Mistral, Qwen2, Qwen3) by a subclass that

* builds vLLM's own model, unchanged, for every checkpoint whose config names no method (a stock checkpoint, or a
  method with zero gains);
* for a checkpoint saved by the transformers adapter (``config.json``: ``"attn_implementation": "pid"`` and the
  parameters as ``"pid": {...}``), runs the method's one core step (:meth:`~pid_plugins.core.AttentionMethod.apply`)
  around vLLM's paged attention in every layer, with the parameters read as the transformers adapter reads them;
* refuses, before anything is built and with one ``ValueError`` naming the method or setting and why, what it cannot
  serve exactly: Twicing and Elliptical, learnable parameters, an unfinished gain warm-up, pipeline and tensor
  parallelism, speculative decoding (:mod:`pid_plugins.vllm.config`).

Nothing else in vLLM changes, and nothing runs from a checkpoint: the method is looked up by name in pid-plugins'
registry. This module imports no vLLM code until vLLM asks for a model class (``pid_plugins.vllm.models``).
"""
from __future__ import annotations

from .config import ARCHITECTURES

__all__ = ["ARCHITECTURES", "register"]


def register() -> None:
    """The ``vllm.general_plugins`` entry point: register the method-serving class of every architecture in
    :data:`ARCHITECTURES` with vLLM's model registry (lazily, by name: vLLM imports it where it builds a model), and
    the check every model config passes there (:func:`pid_plugins.vllm.routing.install`). Safe to call more than
    once (vLLM loads plugins in each process)."""
    from vllm import ModelRegistry

    from . import routing

    routing.install(ModelRegistry)
    for architecture in ARCHITECTURES:
        ModelRegistry.register_model(architecture, f"pid_plugins.vllm.models:{architecture}")
    for architecture in routing.TRANSFORMERS_CLASSES:
        ModelRegistry.register_model(architecture, f"pid_plugins.vllm.transformers_backend:{architecture}")
