"""The plugin's native model classes, one per family, registered with vLLM under their own architecture names
(:data:`~pid_plugins.vllm.config.METHOD_ARCHITECTURES`: ``PidPluginsLlamaForCausalLM``, ...; imported by vLLM's model
registry only, where it builds a model).

Each is written as vLLM writes a model that changes its family's decoder stack (vLLM's ``MistralModel``,
``Qwen3Model``, ``MiMoModel``): an outer class, a subclass of vLLM's ``<Family>ForCausalLM`` that builds the inner
model below (through vLLM's ``_init_model`` where the family has it, else an ``__init__`` of its own as vLLM's
``MiMoForCausalLM`` writes one), and an inner model class, a subclass of vLLM's ``<Family>Model`` under
``@support_torch_compile``, whose ``forward`` is the method's layer loop (:func:`method_forward`): per layer, vLLM's
norm, ``qkv_proj``, qk-norm where the family has one, rotary embedding, then the method's one step
(:meth:`~pid_plugins.core.AttentionMethod.apply`) around vLLM's paged attention, ``o_proj``, norm and MLP, with the
method's state handed from layer to layer as a value. The method and its parameters are read from the model's config
(``hf_config``) when the model is built, as vLLM's layers read theirs; vLLM's compile cache is keyed on that config
(:func:`pid_plugins.vllm.routing.config_choice` writes a preset's parameters into it).

Layouts: vLLM flattens the tokens of every sequence of a step into one axis (decode tokens and chunks of prefills of
several requests side by side). The method sees ``(heads, tokens, head_dim)`` views: every term is per token, so the
update is exact for any mix of requests, for chunked prefill and for prefix caching (a cached prefix's values were
mixed, for value residual, before they were cached).

A checkpoint that names no method never reaches these classes: vLLM serves it with its own class.
"""
from __future__ import annotations

from typing import Any, ClassVar, Optional

from torch import Tensor, nn
from vllm.compilation.decorators import support_torch_compile
from vllm.distributed import get_pp_group
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
from vllm.model_executor.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from vllm.model_executor.models.mistral import MistralDecoderLayer, MistralForCausalLM, MistralModel
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
    """What every outer class adds to vLLM's: the checks before anything is built, and weight loading without the
    method record a transformers method model saves beside its weights."""

    architecture: ClassVar[str]
    stock: ClassVar[type]
    attention_choice: MethodChoice

    def load_weights(self, weights: Any) -> Any:
        return super().load_weights((name, w) for name, w in weights if not is_record_key(name))  # type: ignore[misc]


class PidPluginsLlamaForCausalLM(_Serving, LlamaForCausalLM):
    """vLLM's ``LlamaForCausalLM`` with :class:`PidPluginsLlamaModel` as its inner model (vLLM's ``_init_model``)."""

    architecture, stock = "PidPluginsLlamaForCausalLM", LlamaForCausalLM

    def __init__(self, *, vllm_config: Any, prefix: str = "", layer_type: type = LlamaDecoderLayer) -> None:
        self.attention_choice = _served_choice(vllm_config, self.architecture, self.stock)
        super().__init__(vllm_config=vllm_config, prefix=prefix, layer_type=layer_type)

    def _init_model(self, vllm_config: Any, prefix: str = "", layer_type: type = LlamaDecoderLayer) -> nn.Module:
        return PidPluginsLlamaModel(vllm_config=vllm_config, prefix=prefix, layer_type=layer_type)


class PidPluginsMistralForCausalLM(_Serving, MistralForCausalLM):
    """vLLM's ``MistralForCausalLM`` with :class:`PidPluginsMistralModel` as its inner model (``_init_model``)."""

    architecture, stock = "PidPluginsMistralForCausalLM", MistralForCausalLM

    def __init__(self, *, vllm_config: Any, prefix: str = "", layer_type: type = MistralDecoderLayer) -> None:
        self.attention_choice = _served_choice(vllm_config, self.architecture, self.stock)
        super().__init__(vllm_config=vllm_config, prefix=prefix, layer_type=layer_type)

    def _init_model(self, vllm_config: Any, prefix: str = "", layer_type: type = MistralDecoderLayer) -> nn.Module:
        return PidPluginsMistralModel(vllm_config=vllm_config, prefix=prefix, layer_type=layer_type)


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

    architecture, stock = "PidPluginsQwen2ForCausalLM", Qwen2ForCausalLM

    def __init__(self, *, vllm_config: Any, prefix: str = "") -> None:
        choice = _served_choice(vllm_config, self.architecture, self.stock)
        nn.Module.__init__(self)
        self.attention_choice = choice
        _build_lm(self, vllm_config, prefix, PidPluginsQwen2Model)


class PidPluginsQwen3ForCausalLM(_Serving, Qwen3ForCausalLM):
    """vLLM's ``Qwen3ForCausalLM`` with :class:`PidPluginsQwen3Model` as its inner model."""

    architecture, stock = "PidPluginsQwen3ForCausalLM", Qwen3ForCausalLM

    def __init__(self, *, vllm_config: Any, prefix: str = "") -> None:
        choice = _served_choice(vllm_config, self.architecture, self.stock)
        nn.Module.__init__(self)
        self.attention_choice = choice
        _build_lm(self, vllm_config, prefix, PidPluginsQwen3Model)


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
