"""vLLM's Transformers backend serving a method checkpoint (imported by vLLM's model registry only).

The backend runs the family's own transformers code and sends each layer's attention to a paged ``Attention`` of
vLLM that it sets on the transformers attention module (attribute ``attn``), through transformers' attention
interface under the name ``"vllm"``. The classes here are the backend's :data:`~pid_plugins.vllm.routing.
TRANSFORMERS_CLASSES`, subclasses registered under the same names: built for a checkpoint that names no method they
are vLLM's model, unchanged; for a method checkpoint they build vLLM's model and give each layer's ``Attention`` (on
that object only) a forward that runs the method's one step (:meth:`~pid_plugins.core.AttentionMethod.apply`) around
vLLM's own: the queries and values it gets are what the transformers adapter's attention function gets, one token
per row (the tokens of every running sequence side by side), so every term is per token, as in the native classes.
The method's state goes from layer to layer through :class:`_Layers`, in the order the layers run.
"""
from __future__ import annotations

from typing import Any, Callable, ClassVar, Optional

from torch import Tensor, nn
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.models.transformers import TransformersForCausalLM as _Causal
from vllm.model_executor.models.transformers import TransformersMoEForCausalLM as _MoE

from ..core import AttentionContext, LayerCall, MethodChoice
from ..core.record import is_record_key
from . import internals
from .config import check_engine
from .routing import config_choice

__all__ = ["TransformersForCausalLM", "TransformersMoEForCausalLM", "method_attention"]

STATE_ROUTE = ("pid_plugins.vllm runs every layer of the model in one forward, which hands the state from layer to "
               "layer; pipeline parallelism is refused.")


class _Layers:
    """The method's state of one model between its layers: layer ``i`` reads what layer ``i - 1`` left in the same
    forward (the layers run in order; the first starts afresh, the last leaves nothing), so one layer's state is held
    at a time, as in the native classes."""

    def __init__(self, choice: MethodChoice, count: int) -> None:
        self.choice = choice
        self.count = count
        self.state: Optional[tuple] = None


def method_attention(layers: _Layers, index: int, attention: Attention) -> Callable[..., Tensor]:
    """The forward given to ``attention`` (vLLM's paged attention of layer ``index``): ``(tokens, heads * head_dim)``
    queries, keys and values in, as vLLM's own; the method's step around it."""
    stock = type(attention).forward
    heads, kv_heads, dim = attention.num_heads, attention.num_kv_heads, attention.head_size
    method, config = layers.choice.method, layers.choice.config

    def forward(query: Tensor, key: Tensor, value: Tensor, **kwargs: Any) -> Tensor:
        tokens = query.shape[0]

        def attend(q: Tensor, v: Tensor) -> Tensor:  # (H, T, D), (H_kv, T, D) -> A v as (H, T, D)
            out = stock(attention, q.transpose(0, 1).reshape(tokens, heads * dim), key,
                        v.transpose(0, 1).reshape(tokens, kv_heads * dim), **kwargs)
            return out.view(tokens, heads, dim).transpose(0, 1)

        values = value.view(tokens, kv_heads, dim).transpose(0, 1)
        call = LayerCall(attend, query.view(tokens, heads, dim).transpose(0, 1), values, values, head_dim=-3,
                         context=AttentionContext(causal=True, cached=True, grouped=kv_heads != heads), layer=index,
                         state_route=STATE_ROUTE)
        out, state = method.apply(config, None, call, layers.state if index else None)
        layers.state = state if index + 1 < layers.count else None
        return out.transpose(0, 1).reshape(tokens, heads * dim)

    return forward


def _where(vllm_config: Any, architecture: str) -> str:
    return f"vLLM serving {getattr(vllm_config.model_config, 'model', 'a checkpoint')!s} ({architecture})"


class _MethodServing(nn.Module):
    """The mixin of the registered classes: vLLM's own model, and for a method checkpoint the method's step given to
    each layer's paged attention (a stock checkpoint's model is vLLM's, untouched: the class adds no method, so vLLM's
    wrappers of the class, pooling adapters included, keep working)."""

    architecture: ClassVar[str]
    attention_choice: Optional[MethodChoice]

    def load_weights(self, weights: Any) -> Any:
        """vLLM's loading, without the method record a transformers method model saves beside its weights."""
        return super().load_weights((name, w) for name, w in weights if not is_record_key(name))

    def __init__(self, *args: Any, vllm_config: Any, prefix: str = "", **kwargs: Any) -> None:
        where = _where(vllm_config, self.architecture)
        choice = config_choice(vllm_config.model_config, where)  # (before vLLM sets _attn_implementation to "vllm")
        if choice is not None:
            check_engine(vllm_config, where)
            internals.check_transformers_backend(where)
        super().__init__(*args, vllm_config=vllm_config, prefix=prefix, **kwargs)
        self.attention_choice = choice
        if choice is not None:
            _give_method(self.model, choice, getattr(self.text_config, "num_hidden_layers", None), where)


def _give_method(model: nn.Module, choice: MethodChoice, layers: Optional[int], where: str) -> None:
    """Give every paged attention of ``model`` (the transformers model vLLM built) the method's step."""
    found = [(name, module) for name, module in model.named_modules() if isinstance(module, Attention)]
    if len(found) != layers or any(type(module) is not Attention for _, module in found):
        raise ValueError(f"{where}: vLLM's Transformers backend built {len(found)} paged attention layers "
                         f"({sorted({type(m).__name__ for _, m in found})}) for {layers} decoder layers: "
                         "pid_plugins.vllm runs a method with one causal self-attention per layer only; serve this "
                         "checkpoint with transformers and pid_plugins.hf.")
    state = _Layers(choice, len(found))
    for index, (name, attention) in enumerate(found):
        owner = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
        if getattr(owner, "layer_idx", index) != index or attention.head_size_v != attention.head_size:
            raise ValueError(f"{where}: {name} is not the paged attention of decoder layer {index} with one head "
                             "size for keys and values: pid_plugins.vllm cannot run the method's state through it; "
                             "serve this checkpoint with transformers and pid_plugins.hf.")
        attention.forward = method_attention(state, index, attention)  # this object only


def _registered(stock: type, architecture: str) -> type:
    return type(architecture, (_MethodServing, stock), {
        "architecture": architecture, "__module__": __name__,
        "__doc__": f"vLLM's {architecture} (Transformers backend), serving method checkpoints"})


TransformersForCausalLM = _registered(_Causal, "TransformersForCausalLM")
TransformersMoEForCausalLM = _registered(_MoE, "TransformersMoEForCausalLM")
