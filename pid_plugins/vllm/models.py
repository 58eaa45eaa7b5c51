"""The plugin's native model classes (``PidPlugins<Family>ForCausalLM``), written as vLLM writes a model that
changes its family's decoder stack: an outer subclass of vLLM's ``<Family>ForCausalLM`` building an inner
``<Family>Model`` subclass under ``@support_torch_compile`` whose ``forward`` is the method's layer loop
(:func:`method_forward`). Every term is per token, so any mix of requests, chunked prefill and prefix caching is
exact. A checkpoint that names no method never reaches these classes."""
from __future__ import annotations

from typing import Any, ClassVar, Optional

from torch import Tensor, nn
from vllm.compilation.decorators import support_torch_compile
from vllm.distributed import get_pp_group
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
from vllm.model_executor.models.llama import LlamaForCausalLM, LlamaModel
from vllm.model_executor.models.mistral import MistralForCausalLM, MistralModel
from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM, Qwen2Model
from vllm.model_executor.models.qwen3 import Qwen3ForCausalLM, Qwen3Model
from vllm.model_executor.models.utils import PPMissingLayer, maybe_prefix

from ..core import MethodChoice
from ..core.record import is_record_key
from . import internals
from .config import TENSOR_PARALLEL, check_engine, method_choice
from .layer import add_calls, method_step, where

__all__ = ["PidPluginsLlamaForCausalLM", "PidPluginsMistralForCausalLM", "PidPluginsQwen2ForCausalLM",
           "PidPluginsQwen3ForCausalLM", "PidPluginsLlamaModel", "PidPluginsMistralModel", "PidPluginsQwen2Model",
           "PidPluginsQwen3Model", "method_forward"]

#: the dynamic dimensions vLLM's torch.compile marks (as on vLLM's LlamaModel and Qwen2Model)
_LLAMA_DIMS = {"input_ids": 0, "positions": 0, "intermediate_tensors": 0, "inputs_embeds": 0}
_QWEN_DIMS = {"input_ids": 0, "positions": -1, "intermediate_tensors": 0, "inputs_embeds": 0}


def _served_choice(vllm_config: Any, architecture: str, stock: type) -> MethodChoice:
    """The method and parameters the model's config names, after every check that comes before vLLM builds anything
    (the engine settings, the family's layers in this vLLM release, the family options the loop does not run)."""
    place = where(vllm_config, architecture)
    hf_config = vllm_config.model_config.hf_config
    choice = method_choice(hf_config, place)
    if choice is None:
        raise ValueError(f"{place}: config.json names no attention method (or parameters that compute the stock "
                         f"attention), so vLLM's own {stock.__name__} serves it; {architecture} is pid_plugins.vllm's "
                         f"class for method checkpoints. Name {stock.__name__} in config.json's architectures.")
    # tensor parallelism: vLLM's layers give the loop each rank's heads (num_heads, q_size, ... are per rank)
    check_engine(vllm_config, place, tensor_parallel=choice.method.name in TENSOR_PARALLEL)
    internals.check_family(stock, hf_config, place)
    return choice


class _MethodLoop:
    """The inner model's ``forward``: the method's layer loop over vLLM's layers (:func:`method_forward`), for the
    method and parameters of the model's config (``attention_choice``, read when the model is built)."""

    attention_choice: MethodChoice

    def __init__(self, *, vllm_config: Any, prefix: str = "", **kwargs: Any) -> None:
        """vLLM's inner model, then the method from the config, and each layer's further paged attentions."""
        super().__init__(vllm_config=vllm_config, prefix=prefix, **kwargs)  # type: ignore[call-arg]
        place = where(vllm_config, type(self).__name__)
        self.attention_choice = method_choice(vllm_config.model_config.hf_config, place)
        add_calls(self.attention_choice, [layer.self_attn.attn for layer in self.layers], place)

    def forward(self, input_ids: Optional[Tensor], positions: Tensor, intermediate_tensors: Any = None,
                inputs_embeds: Optional[Tensor] = None) -> Tensor:
        if intermediate_tensors is not None:
            raise ValueError(f"pid_plugins.vllm: {type(self).__name__} got intermediate tensors (pipeline "
                             "parallelism), which a method model does not take")
        return method_forward(self, self.attention_choice, input_ids, positions, inputs_embeds)


@support_torch_compile(dynamic_arg_dims=_LLAMA_DIMS)
class PidPluginsLlamaModel(_MethodLoop, LlamaModel):
    """vLLM's ``LlamaModel`` (its layers, weights and names) running the method's layer loop."""


@support_torch_compile(dynamic_arg_dims=_LLAMA_DIMS)
class PidPluginsMistralModel(_MethodLoop, MistralModel):
    """vLLM's ``MistralModel`` running the method's layer loop."""


@support_torch_compile(dynamic_arg_dims=_QWEN_DIMS)
class PidPluginsQwen2Model(_MethodLoop, Qwen2Model):
    """vLLM's ``Qwen2Model`` running the method's layer loop."""


@support_torch_compile(dynamic_arg_dims=_QWEN_DIMS)
class PidPluginsQwen3Model(_MethodLoop, Qwen3Model):
    """vLLM's ``Qwen3Model`` running the method's layer loop."""


class _Serving:
    """What every outer class adds to vLLM's: the checks before anything is built, its inner model (vLLM's
    ``_init_model``, or :func:`_build_lm` for the families that build it by name), and weight loading without the
    method record a transformers method model saves beside its weights."""

    stock: ClassVar[type]
    inner: ClassVar[type]
    attention_choice: MethodChoice

    def __init__(self, *, vllm_config: Any, prefix: str = "", **kwargs: Any) -> None:
        choice = _served_choice(vllm_config, type(self).__name__, self.stock)
        if hasattr(self.stock, "_init_model"):  # Llama, Mistral (the stock defaults of layer_type)
            self.attention_choice = choice
            super().__init__(vllm_config=vllm_config, prefix=prefix, **kwargs)  # type: ignore[call-arg]
        else:  # Qwen2, Qwen3
            nn.Module.__init__(self)  # type: ignore[arg-type]
            self.attention_choice = choice
            _build_lm(self, vllm_config, prefix, self.inner)  # type: ignore[arg-type]

    def _init_model(self, vllm_config: Any, prefix: str = "", **kwargs: Any) -> nn.Module:
        return self.inner(vllm_config=vllm_config, prefix=prefix, **kwargs)

    def load_weights(self, weights: Any) -> Any:
        return super().load_weights((name, w) for name, w in weights if not is_record_key(name))  # type: ignore[misc]


class PidPluginsLlamaForCausalLM(_Serving, LlamaForCausalLM):
    """vLLM's ``LlamaForCausalLM`` with :class:`PidPluginsLlamaModel` as its inner model."""

    stock, inner = LlamaForCausalLM, PidPluginsLlamaModel


class PidPluginsMistralForCausalLM(_Serving, MistralForCausalLM):
    """vLLM's ``MistralForCausalLM`` with :class:`PidPluginsMistralModel` as its inner model."""

    stock, inner = MistralForCausalLM, PidPluginsMistralModel


def _build_lm(model: nn.Module, vllm_config: Any, prefix: str, inner: type) -> None:
    """The body of vLLM's ``Qwen2ForCausalLM.__init__`` / ``Qwen3ForCausalLM.__init__`` with ``inner`` as the inner
    model (those build ``Qwen2Model``/``Qwen3Model`` by name; vLLM's own ``MiMoForCausalLM`` writes it the same way)."""
    config = vllm_config.model_config.hf_config
    model.config = config
    model.vllm_config = vllm_config
    model.quant_config = vllm_config.quant_config
    model.model = inner(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"))
    if get_pp_group().is_last_rank:
        model.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, quant_config=model.quant_config,
                                       prefix=maybe_prefix(prefix, "lm_head"))
        if config.tie_word_embeddings:
            model.lm_head = model.lm_head.tie_weights(model.model.embed_tokens)
    else:
        model.lm_head = PPMissingLayer()
    model.logits_processor = LogitsProcessor(config.vocab_size)
    model.make_empty_intermediate_tensors = model.model.make_empty_intermediate_tensors


class PidPluginsQwen2ForCausalLM(_Serving, Qwen2ForCausalLM):
    """vLLM's ``Qwen2ForCausalLM`` with :class:`PidPluginsQwen2Model` as its inner model."""

    stock, inner = Qwen2ForCausalLM, PidPluginsQwen2Model


class PidPluginsQwen3ForCausalLM(_Serving, Qwen3ForCausalLM):
    """vLLM's ``Qwen3ForCausalLM`` with :class:`PidPluginsQwen3Model` as its inner model."""

    stock, inner = Qwen3ForCausalLM, PidPluginsQwen3Model


def method_forward(model: nn.Module, choice: MethodChoice, input_ids: Optional[Tensor], positions: Tensor,
                   inputs_embeds: Optional[Tensor] = None) -> Tensor:
    """vLLM's decoder stack (``model``: its ``LlamaModel``, ``Qwen2Model``, ...) with ``choice``'s method in every
    self-attention layer: the final hidden states ``(tokens, hidden)``."""
    hidden = inputs_embeds if inputs_embeds is not None else model.embed_input_ids(input_ids)
    residual: Optional[Tensor] = None
    state: Optional[tuple] = None
    for index, layer in enumerate(model.layers):
        if residual is None:
            residual = hidden
            hidden = layer.input_layernorm(hidden)
        else:
            hidden, residual = layer.input_layernorm(hidden, residual)
        hidden, state = _attention(layer.self_attn, positions, hidden, choice, state, index)
        hidden, residual = layer.post_attention_layernorm(hidden, residual)
        hidden = layer.mlp(hidden)
    hidden, _ = model.norm(hidden, residual)
    return hidden


def _attention(attn: nn.Module, positions: Tensor, hidden: Tensor, choice: MethodChoice, state: Optional[tuple],
               index: int) -> tuple[Tensor, tuple]:
    """One self-attention layer of vLLM's Llama/Mistral/Qwen2/Qwen3 with the method's step around ``attn.attn``."""
    qkv, _ = attn.qkv_proj(hidden)
    q, k, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
    tokens, heads, kv_heads, dim = q.shape[0], attn.num_heads, attn.num_kv_heads, attn.head_dim
    if getattr(attn, "qk_norm", hasattr(attn, "q_norm")):  # Qwen3 always, Qwen2 when configured: per head, pre-RoPE
        q = attn.q_norm(q.view(tokens, heads, dim)).view(tokens, attn.q_size)
        k = attn.k_norm(k.view(tokens, kv_heads, dim)).view(tokens, attn.kv_size)
    q, k = attn.rotary_emb(positions, q, k)
    out, state = method_step(choice, index, state, q, k, v, attn.attn)
    output, _ = attn.o_proj(out)
    return output, state
