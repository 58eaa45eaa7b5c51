"""vLLM's Transformers backend serving a method checkpoint (imported by vLLM's model registry only): subclasses of
:data:`~pid_plugins.vllm.routing.TRANSFORMERS_CLASSES` whose ``_get_attn_cls`` returns :class:`MethodAttention`,
vLLM's paged ``Attention`` with the method's step around its ``forward``; the state goes from layer to layer through
:class:`_Layers`, in the order the layers run."""
from __future__ import annotations

from typing import Any, ClassVar, Optional

from torch import Tensor
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.models.transformers import TransformersForCausalLM, TransformersMoEForCausalLM

from ..core import MethodChoice
from ..core.record import is_record_key
from . import internals
from .config import check_engine
from .layer import add_calls, method_step, where
from .routing import config_choice

__all__ = ["MethodAttention", "PidPluginsTransformersForCausalLM", "PidPluginsTransformersMoEForCausalLM"]


class _Layers:
    """The method's state of one model between its layers: layer ``i`` reads what layer ``i - 1`` left."""

    def __init__(self, choice: MethodChoice, count: int) -> None:
        self.choice = choice
        self.count = count
        self.state: Optional[tuple] = None


class MethodAttention(Attention):
    """vLLM's paged ``Attention`` of one decoder layer running the method's step around its own ``forward``:
    ``(tokens, heads * head_dim)`` queries, keys and values in, as vLLM's own. ``method_layers`` and ``method_index``
    (the model's :class:`_Layers` and this layer's index) are set by the model that built it."""

    method_layers: _Layers
    method_index: int

    def forward(self, query: Tensor, key: Tensor, value: Tensor, **kwargs: Any) -> Tensor:
        layers, index = self.method_layers, self.method_index
        own = lambda q, k, v: super(MethodAttention, self).forward(q, k, v, **kwargs)  # noqa: E731
        out, state = method_step(layers.choice, index, layers.state if index else None, query, key, value, self, own)
        layers.state = state if index + 1 < layers.count else None
        return out


class _MethodServing:
    """The mixin of the registered classes: vLLM's Transformers-backend model with :class:`MethodAttention` as its
    paged attention, for the method the checkpoint's config names."""

    architecture: ClassVar[str]
    attention_choice: MethodChoice

    def load_weights(self, weights: Any) -> Any:
        """vLLM's loading, without the method record a transformers method model saves beside its weights."""
        return super().load_weights((name, w) for name, w in weights if not is_record_key(name))  # type: ignore[misc]

    def __init__(self, *, vllm_config: Any, prefix: str = "") -> None:
        place = where(vllm_config, self.architecture)
        choice = config_choice(vllm_config.model_config, place)  # (before vLLM sets _attn_implementation to "vllm")
        if choice is None:
            raise ValueError(f"{place}: config.json names no attention method, so vLLM's own Transformers backend "
                             f"serves it; {self.architecture} is pid_plugins.vllm's class for method checkpoints.")
        check_engine(vllm_config, place)
        internals.check_transformers_backend(place)
        self.attention_choice = choice
        self._where = place
        super().__init__(vllm_config=vllm_config, prefix=prefix)  # type: ignore[call-arg]
        self._thread_state()

    def _get_attn_cls(self) -> type:
        """vLLM's choice of the paged attention class, with the method's step: only vLLM's causal ``Attention``."""
        chosen = super()._get_attn_cls()  # type: ignore[misc]
        if chosen is not Attention:
            raise ValueError(f"{self._where}: vLLM's Transformers backend would build {chosen.__name__} layers for "
                             "this model (not one causal self-attention per decoder layer): pid_plugins.vllm runs a "
                             "method through vLLM's Attention only; serve this checkpoint with transformers and "
                             "pid_plugins.hf.")
        return MethodAttention

    def _thread_state(self) -> None:
        """Number the paged attentions vLLM built (one per decoder layer, in order) and give them the model's
        :class:`_Layers`."""
        layers = getattr(self.text_config, "num_hidden_layers", None)  # type: ignore[attr-defined]
        found = [(name, module) for name, module in self.model.named_modules()  # type: ignore[attr-defined]
                 if isinstance(module, Attention)]
        if len(found) != layers or any(type(module) is not MethodAttention for _, module in found):
            raise ValueError(f"{self._where}: vLLM's Transformers backend built {len(found)} paged attention layers "
                             f"({sorted({type(m).__name__ for _, m in found})}) for {layers} decoder layers: "
                             "pid_plugins.vllm runs a method with one causal self-attention per layer only; serve "
                             "this checkpoint with transformers and pid_plugins.hf.")
        state = _Layers(self.attention_choice, len(found))
        for index, (name, attention) in enumerate(found):
            owner = self.model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else self.model  # type: ignore
            if getattr(owner, "layer_idx", index) != index or attention.head_size_v != attention.head_size:
                raise ValueError(f"{self._where}: {name} is not the paged attention of decoder layer {index} with one "
                                 "head size for keys and values: pid_plugins.vllm cannot run the method's state "
                                 "through it; serve this checkpoint with transformers and pid_plugins.hf.")
            attention.method_layers = state
            attention.method_index = index
        add_calls(self.attention_choice, [attention for _, attention in found], self._where)


class PidPluginsTransformersForCausalLM(_MethodServing, TransformersForCausalLM):
    """vLLM's ``TransformersForCausalLM`` serving a method checkpoint."""

    architecture = "PidPluginsTransformersForCausalLM"


class PidPluginsTransformersMoEForCausalLM(_MethodServing, TransformersMoEForCausalLM):
    """vLLM's ``TransformersMoEForCausalLM`` serving a method checkpoint."""

    architecture = "PidPluginsTransformersMoEForCausalLM"
