"""The model classes the plugin registers with vLLM, one per architecture (imported by vLLM's model registry only).

Each is a subclass of vLLM's own class. Built for a checkpoint whose config names no method (or zero gains), it
keeps vLLM's own forward and inner model, unchanged (a subclass vLLM derives, such as its pooling adapters, keeps
its own methods). For a method checkpoint it builds vLLM's
model with the same weights and layers and runs its own loop over them (:func:`method_forward`): per layer, vLLM's
norm, ``qkv_proj``, qk-norm where the family has one, rotary embedding, then the method's one step
(:meth:`~pid_plugins.core.AttentionMethod.apply`) around vLLM's paged attention, ``o_proj``, norm and MLP, with the
method's state handed from layer to layer as a value.

Layouts: vLLM flattens the tokens of every sequence of a step into one axis (decode tokens and chunks of prefills of
several requests side by side). The method sees ``(heads, tokens, head_dim)`` views: every term is per token, so the
update is exact for any mix of requests, for chunked prefill and for prefix caching (a cached prefix's values were
mixed, for value residual, before they were cached). The loop is the ``forward`` of a subclass of vLLM's inner model
(``LlamaModel``, ...), so it runs inside vLLM's ``torch.compile`` wrapper of that model as the stock forward does.
"""
from __future__ import annotations

import functools
import hashlib
import types
from typing import Any, ClassVar, Optional

from torch import Tensor, nn
from vllm.model_executor.models.llama import LlamaForCausalLM as _Llama
from vllm.model_executor.models.mistral import MistralForCausalLM as _Mistral
from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM as _Qwen2
from vllm.model_executor.models.qwen3 import Qwen3ForCausalLM as _Qwen3

from ..core import AttentionContext, LayerCall, MethodChoice
from ..core.record import is_record_key
from . import internals
from ..versions import InternalChanged
from .config import TENSOR_PARALLEL, check_engine, method_choice

__all__ = ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "method_forward"]

#: how the method's state reaches every layer here (core's MissingLayerState names it)
STATE_ROUTE = ("pid_plugins.vllm runs every layer of the model in one forward, which hands the state from layer to "
               "layer; pipeline parallelism is refused.")


def _where(vllm_config: Any, architecture: str) -> str:
    return f"vLLM serving {getattr(vllm_config.model_config, 'model', 'a checkpoint')!s} ({architecture})"


class _MethodServing(nn.Module):
    """The mixin of the registered classes: vLLM's own forward for a stock checkpoint, the method loop otherwise."""

    stock: ClassVar[type]  #: vLLM's own class for this architecture
    architecture: ClassVar[str]

    def load_weights(self, weights: Any) -> Any:
        """vLLM's loading, without the method record a transformers method model saves beside its weights."""
        return super().load_weights((name, w) for name, w in weights if not is_record_key(name))

    def __init__(self, *args: Any, vllm_config: Any, prefix: str = "", **kwargs: Any) -> None:
        where = _where(vllm_config, self.architecture)
        choice = method_choice(vllm_config.model_config.hf_config, where)
        if choice is not None:  # refused before vLLM builds anything
            # tensor parallelism: vLLM's layers give the loop each rank's heads (num_heads, q_size, ... are per rank)
            check_engine(vllm_config, where, tensor_parallel=choice.method.name in TENSOR_PARALLEL)
            internals.check_family(self.stock, vllm_config.model_config.hf_config, where)
        super().__init__(*args, vllm_config=vllm_config, prefix=prefix, **kwargs)
        if choice is not None:  # a stock checkpoint keeps vLLM's forward and inner model, unchanged
            _serve_method(self.model, choice, where)


def _serve_method(model: nn.Module, choice: MethodChoice, where: str) -> None:
    """Make vLLM's inner model (``LlamaModel``, ...; built by vLLM with its weights and layers) run ``choice``'s
    method: its class becomes a subclass whose ``forward`` is the method's loop (:func:`_method_model_forward`).

    vLLM's ``support_torch_compile`` (on the stock class, inherited) compiles the bound ``forward`` it finds when the
    model is built: its wrapper is set up again for the new one (:func:`_compile_forward`). The subclass's
    ``forward`` is a copy per method and parameters, with a qualified name naming both: vLLM keys its compiled-code
    cache on that name and on vLLM's config, which holds ``config.<method>`` but not ``attn_implementation`` (and
    the parameters are compiled in as constants)."""
    model.__class__ = _method_model_class(type(model), choice.method.name, repr(choice.config))
    model.attention_choice = choice
    _compile_forward(model, where)


def _method_model_forward(self: nn.Module, input_ids: Optional[Tensor], positions: Tensor,
                          intermediate_tensors: Any = None, inputs_embeds: Optional[Tensor] = None) -> Tensor:
    """The ``forward`` of a method model's inner model (vLLM's signature): :func:`method_forward` with its method."""
    if intermediate_tensors is not None:
        raise ValueError(f"pid_plugins.vllm: {type(self).__name__} got intermediate tensors (pipeline parallelism), "
                         "which a method model does not take")
    return method_forward(self, self.attention_choice, input_ids, positions, inputs_embeds)


@functools.lru_cache(maxsize=None)
def _method_model_class(stock: type, method: str, params: str) -> type:
    """The subclass of vLLM's inner model class ``stock`` that runs ``method`` with parameters ``params`` (repr)."""
    digest = hashlib.sha256(f"{method}:{params}".encode()).hexdigest()[:12]
    name = f"{stock.__name__}_{method}_{digest}"
    forward = types.FunctionType(_method_model_forward.__code__, _method_model_forward.__globals__, "forward",
                                 _method_model_forward.__defaults__)
    forward.__qualname__ = f"{name}.forward"
    forward.__doc__ = _method_model_forward.__doc__
    return type(name, (stock,), {"forward": forward, "__module__": __name__,
                                 "__doc__": f"vLLM's {stock.__name__} running attention method {method!r}"})


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

    def attend(query: Tensor, value: Tensor) -> Tensor:  # (H, T, D), (H_kv, T, D) -> A v as (H, T, D)
        out = attn.attn(query.transpose(0, 1).reshape(tokens, heads * dim), k,
                        value.transpose(0, 1).reshape(tokens, kv_heads * dim))
        return out.view(tokens, heads, dim).transpose(0, 1)

    values = v.view(tokens, kv_heads, dim).transpose(0, 1)
    call = LayerCall(attend, q.view(tokens, heads, dim).transpose(0, 1), values, values, head_dim=-3,
                     context=AttentionContext(causal=True, cached=True, grouped=kv_heads != heads), layer=index,
                     state_route=STATE_ROUTE)
    out, state = choice.method.apply(choice.config, None, call, state)
    output, _ = attn.o_proj(out.transpose(0, 1).reshape(tokens, heads * dim))
    return output, state


def _registered(stock: type, architecture: str) -> type:
    return type(architecture, (_MethodServing, stock), {"stock": stock, "architecture": architecture,
                                                        "__module__": __name__,
                                                        "__doc__": f"vLLM's {architecture}, serving method checkpoints"})


LlamaForCausalLM = _registered(_Llama, "LlamaForCausalLM")
MistralForCausalLM = _registered(_Mistral, "MistralForCausalLM")
Qwen2ForCausalLM = _registered(_Qwen2, "Qwen2ForCausalLM")
Qwen3ForCausalLM = _registered(_Qwen3, "Qwen3ForCausalLM")


def _compile_forward(model: Any, where: str) -> None:
    """Point vLLM's ``torch.compile`` wrapper of ``model`` (``support_torch_compile`` on its stock class) at the
    ``forward`` of ``model``'s current class: the wrapper compiles the bound ``forward`` it finds when the model is
    built (``TorchCompileWithNoGuardsWrapper.__init__``), so it is set up again after the class changed, its
    bytecode hook for the old ``forward`` removed first. Nothing to do when vLLM runs the model eagerly. A wrapper
    that does not then compile this ``forward`` gets :class:`~pid_plugins.versions.InternalChanged`."""
    from vllm.compilation.wrapper import TorchCompileWithNoGuardsWrapper

    if not isinstance(model, TorchCompileWithNoGuardsWrapper) or getattr(model, "do_not_compile", False):
        return
    model.cleanup()
    TorchCompileWithNoGuardsWrapper.__init__(model, compile_prefix="", is_encoder=False)
    compiled = getattr(getattr(model, "_compiled_callable", None), "_torchdynamo_orig_callable", None)
    if compiled != model.forward:
        import vllm

        raise InternalChanged(
            f"{where}: vLLM {getattr(vllm, '__version__', '?')}'s torch.compile wrapper does not compile the method "
            f"model's forward after TorchCompileWithNoGuardsWrapper.__init__ (it compiles {compiled!r}); pid-plugins "
            f"is tested with vLLM {internals.TESTED_VLLM}. Serve with enforce_eager=True, or the tested vLLM.")
