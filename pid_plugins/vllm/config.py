"""What a checkpoint asks vLLM to serve, and what the vLLM plugin refuses (no vLLM import: testable anywhere).

vLLM reads ``config.json`` with transformers: the method arrives as ``hf_config._attn_implementation``, its parameters
as ``hf_config.<method>``, read through core's :func:`~pid_plugins.core.resolve_attention` (the ``hf`` presets). Served
exactly: methods whose rule is per token around vLLM's attention call; the rest is refused before anything is built."""
from __future__ import annotations

from typing import Any, Iterator, Mapping, Optional

from ..core import SOFTMAX, AttentionContext, AttentionMethod, MethodChoice, list_methods, resolve_attention
from ..core.methods import find_method
from ..core.siblings.elliptical import EllipticalMethod

__all__ = ["ARCHITECTURES", "FAMILIES", "METHOD_PREFIX", "STOCK_ATTENTIONS", "TENSOR_PARALLEL", "check_engine",
           "check_options", "check_servable", "method_architecture", "method_choice", "stock_architecture",
           "unservable_reason"]

#: the architectures whose method checkpoints the plugin serves with native classes (``PidPlugins<Architecture>``)
ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
#: the prefix of the plugin's architecture names: ``PidPlugins<Architecture>`` serves what ``<Architecture>`` would
METHOD_PREFIX = "PidPlugins"


def method_architecture(architecture: str) -> str:
    """The architecture name of the plugin's class serving a method checkpoint of ``architecture``."""
    return architecture if architecture.startswith(METHOD_PREFIX) else METHOD_PREFIX + architecture


def stock_architecture(name: str) -> str:
    """The architecture a method architecture name (``PidPlugins<Architecture>``) stands for; other names as given."""
    return name[len(METHOD_PREFIX):] if name.startswith(METHOD_PREFIX) else name


#: transformers' own ``attn_implementation`` names (a stock checkpoint may carry one): vLLM's own model serves them
STOCK_ATTENTIONS = frozenset({"eager", "sdpa", "flash_attention_2", "flash_attention_3", "flex_attention", SOFTMAX})


def unservable_reason(method: AttentionMethod) -> Optional[str]:
    """Why vLLM cannot serve ``method`` exactly through this plugin (only the cached keys and values of earlier
    tokens are kept), or None when it can."""
    if isinstance(method, EllipticalMethod):
        return None
    if method.reads_visible:
        return ("it reads which keys each query attends to, over every earlier position (Elliptical's prefix mean of "
                "the value differences), which vLLM's paged attention neither exposes nor caches")
    if method.keys_state and not method.mixes_values:  # (value residual mixes the values vLLM then caches)
        return "its state holds the values of every key position, of which vLLM keeps only the cached ones"
    return None


def check_servable(choice: MethodChoice, where: str) -> None:
    """Refuse (``ValueError``) a method or parameters the plugin cannot serve exactly."""
    method, config = choice.method, choice.config
    reason = unservable_reason(method)
    if reason is not None:
        raise ValueError(f"{where}: attention method {method.name!r} cannot be served by vLLM (pid_plugins.vllm): "
                         f"{reason}. Serve this checkpoint with transformers and pid_plugins.hf instead.")
    try:  # e.g. Elliptical's mean="sequence" (not causal)
        method.check(config, AttentionContext(causal=True, cached=True))
    except ValueError as error:
        raise ValueError(f"{where}: {error}") from None
    steps = getattr(config, "warmup_steps", 0) or 0
    if steps:
        raise ValueError(
            f"{where}: config.{method.name} has warmup_steps={steps}, an unfinished gain warm-up: the method's term is "
            f"scaled by min(1, t / {steps}), t a counter saved with the weights (attention_warmup.step) that vLLM does "
            "not load. Finish it (pid_plugins.finish_warmup(model)) and save the model again: the finished model has "
            "warmup_steps=0.")


def method_choice(hf_config: Any, where: str = "this checkpoint") -> Optional[MethodChoice]:
    """The method and parameters a checkpoint's config asks for (``_attn_implementation``, ``config.<method>``), or
    None for vLLM's own model (no method, a stock attention, zero gains); ``ValueError`` for what cannot be served."""
    name = getattr(hf_config, "_attn_implementation", None)
    if name is None or name in STOCK_ATTENTIONS or (isinstance(name, str) and ("/" in name or "|" in name)):
        return None  # transformers' own attentions (hub kernels "org/name", paged "paged|sdpa")
    if name not in list_methods():
        raise ValueError(
            f"{where}: config.json names attn_implementation={name!r}, which is neither an attention method of "
            f"pid-plugins ({', '.join(list_methods())}) nor a stock attention of transformers. A method of another "
            "package is known here when that package is installed in vLLM's environment and declares it in the "
            "entry-point group pid_plugins.methods.")
    raw = getattr(hf_config, name, None)
    choice = resolve_attention(name, dict(raw) if isinstance(raw, Mapping) else raw, zoo="hf", learnable=False,
                               where=where, params_name=f"config.{name}")
    assert choice is not None  # (only "softmax" resolves to None, handled above)
    if choice.method.is_identity(choice.config):
        return None  # zero gains: the stock attention, which vLLM's own model computes
    check_servable(choice, where)
    return choice


class _TensorParallel:
    """``name in TENSOR_PARALLEL``: the servable method ``name`` declares ``per_head_state`` (each rank computes
    exactly what one process computes for its heads). Iterating gives those names, sorted."""

    def __contains__(self, name: Any) -> bool:
        method = find_method(name)
        return method is not None and bool(method.per_head_state) and unservable_reason(method) is None

    def __iter__(self) -> Iterator[str]:
        return iter([name for name in list_methods() if name in self])


#: the methods served with tensor parallelism, read from each method's declaration (``per_head_state``) when asked
TENSOR_PARALLEL = _TensorParallel()


def check_engine(vllm_config: Any, where: str, tensor_parallel: bool = False) -> None:
    """Refuse (``ValueError``) the engine settings the plugin does not cover, naming each (``tensor_parallel``: the
    method is one of :data:`TENSOR_PARALLEL`)."""
    parallel = vllm_config.parallel_config
    refused = []
    if getattr(parallel, "pipeline_parallel_size", 1) > 1:
        refused.append(f"pipeline_parallel_size={parallel.pipeline_parallel_size} (the state would have to travel "
                       "between the stages)")
    if getattr(parallel, "tensor_parallel_size", 1) > 1 and not tensor_parallel:
        refused.append(f"tensor_parallel_size={parallel.tensor_parallel_size} (served only for methods that declare "
                       f"per_head_state: {', '.join(TENSOR_PARALLEL)}, with vLLM's own model classes; not tested here)")
    for name in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        if getattr(parallel, name, 1) > 1:
            refused.append(f"{name}={getattr(parallel, name)} (not tested)")
    if getattr(vllm_config, "speculative_config", None) is not None:
        refused.append("speculative decoding (its draft models and auxiliary hidden states are not covered)")
    if refused:
        raise ValueError(f"{where}: pid_plugins.vllm serves attention methods on one process per model replica; it "
                         f"does not cover " + "; ".join(refused) + ". Serve without them (data parallelism works).")


#: config options of a family that change what its layers compute and that the plugin's loop does not run
_REFUSED_OPTIONS = {
    "mistral": {"llama_4_scaling": "Llama 4 attention scaling of the queries",
                "ada_rms_norm_t_cond": "the time-conditioned adaptive RMS norm"},
    "qwen2": {"dual_chunk_attention_config": "dual chunk attention"},
    "qwen3": {"dual_chunk_attention_config": "dual chunk attention"},
}

#: the family module (``vllm.model_executor.models.<family>``) of each native architecture of the plugin
FAMILIES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
            "Qwen3ForCausalLM": "qwen3"}


def check_options(family: str, hf_config: Any, where: str) -> None:
    """Refuse (``ValueError``) a checkpoint using a family option the plugin's native layer loop does not run."""
    for option, what in _REFUSED_OPTIONS.get(family, {}).items():
        if getattr(hf_config, option, None):
            raise ValueError(f"{where}: config.{option} turns on {what}, which pid_plugins.vllm does not run with an "
                             "attention method; serve this checkpoint with transformers and pid_plugins.hf.")
    if not getattr(hf_config, "is_causal", True):
        raise ValueError(f"{where}: config.is_causal=False (bidirectional attention, an embedding model): "
                         "pid_plugins.vllm serves causal language models only.")
