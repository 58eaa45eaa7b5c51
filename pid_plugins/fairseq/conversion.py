"""``convert(model, attention, attention_cfg)``: switch a loaded fairseq language model's attention, in place."""
from typing import Any, Optional, TypeVar

from fairseq.hub_utils import GeneratorHubInterface
from fairseq.models.transformer import TransformerDecoder
from fairseq.models.transformer_lm import TransformerLanguageModel
from fairseq.modules.multihead_attention import MultiheadAttention
from fairseq.modules.transformer_layer import TransformerDecoderLayerBase
from torch import nn

from ..core import MethodChoice, method_warmup, resolve_attention
from ..core.layer import (
    LAYER_ATTRIBUTES, MODEL_ATTRIBUTES, replace_module, settle_submodule, strip_attributes,
    warn_switch_of_trained_weights,
)
from .layers import (
    PIDMultiheadAttention, PIDTransformerDecoder, PIDTransformerDecoderLayer, decoder_layers, embedding_like,
    switch_layers,
)
from .model import PIDTransformerLanguageModel

__all__ = ["convert"]

ModelT = TypeVar("ModelT", bound=nn.Module)


_WHERE = "pid_plugins.fairseq.convert"


def convert(model: ModelT, attention: str = "pid", attention_cfg: Any = None) -> ModelT:
    """Switch a ``TransformerLanguageModel`` (or each model of a hub interface) to ``attention`` with
    ``attention_cfg``, in place; returns ``model``. The root keeps its class; its decoder, layers and attention
    become this adapter's."""
    if isinstance(model, GeneratorHubInterface):
        models = list(model.models)
        if not models:
            raise TypeError(f"{_WHERE}: this hub interface holds no model")
    else:
        models = [model]
    choice = resolve_attention(attention, attention_cfg, zoo="fairseq", where=_WHERE)
    for lm in models:
        _check(lm, choice)
    for lm in models:
        warn_switch_of_trained_weights(lm, choice, _WHERE, current=lm.decoder)
        if choice is None:
            _to_stock(lm)
        else:
            _to_method(lm, choice)
    return model


def _check(model: nn.Module, choice: Optional[MethodChoice]) -> None:
    """Refuse what cannot be converted, before anything changes."""
    kind = type(model)
    if kind not in (TransformerLanguageModel, PIDTransformerLanguageModel):
        hint = ("; convert the model before torch.compile" if hasattr(model, "_orig_mod")
                else "; only decoder-only language models (--arch transformer_lm and its variants) are supported")
        raise TypeError(f"{_WHERE}: a fairseq TransformerLanguageModel (transformer_lm) or transformer_lm_pid model, "
                        f"got {kind.__name__}{hint}")
    decoder = model.decoder
    if type(decoder) not in (TransformerDecoder, PIDTransformerDecoder):
        raise TypeError(f"{_WHERE}: the model's decoder must be fairseq's TransformerDecoder, got "
                        f"{type(decoder).__name__}")
    if getattr(decoder, "cross_self_attention", False):
        raise TypeError(f"{_WHERE}: --cross-self-attention is not supported by transformer_lm_pid; the model has it")
    for i, layer in enumerate(decoder_layers(decoder)):
        attn = getattr(layer, "self_attn", None)
        if (type(layer), type(attn)) not in ((TransformerDecoderLayerBase, MultiheadAttention),
                                            (PIDTransformerDecoderLayer, PIDMultiheadAttention)):
            raise TypeError(f"{_WHERE}: decoder layer {i} is {type(layer).__name__} with {type(attn).__name__} "
                            "self-attention; transformer_lm_pid needs fairseq's TransformerDecoderLayerBase + "
                            "MultiheadAttention (a model built with --ddp-backend fully_sharded wraps them: convert "
                            "before wrapping)")
        if "forward" in layer.__dict__ or "forward" in attn.__dict__:
            raise TypeError(f"{_WHERE}: decoder layer {i} has its forward replaced (--checkpoint-activations); "
                            "transformer_lm_pid does not support activation checkpointing: build the model without it")
        if getattr(layer, "encoder_attn", None) is not None:
            raise TypeError(f"{_WHERE}: decoder layer {i} has encoder attention; only decoder-only language models "
                            "are supported")
        if attn.bias_k is not None or attn.add_zero_attn or not attn.self_attention:
            raise TypeError(f"{_WHERE}: decoder layer {i}'s attention has extra key/value biases or zero attention "
                            "(add_bias_kv / add_zero_attn), which transformer_lm_pid does not support")
    if choice is not None:
        method_warmup(choice, stock_plus_term=True, where=_WHERE)  # refuses warm-up of a non-additive method


def _to_method(model: nn.Module, choice: MethodChoice) -> None:
    """Stock (or method) transformer_lm -> the method classes with ``choice``; the root keeps its class."""
    decoder = replace_module(model, "decoder", PIDTransformerDecoder)
    switch_layers(decoder, choice)
    decoder.set_model_method(choice, embedding_like(decoder), stock_plus_term=True, where=_WHERE)
    settle_submodule(decoder, "attention_warmup")


def _to_stock(model: nn.Module) -> None:
    """(Method) transformer_lm -> fairseq's own classes, with everything pid-plugins added removed."""
    decoder = model.decoder
    for index in range(len(decoder.layers)):
        layer = decoder.layers[index]
        if type(layer.self_attn) is PIDMultiheadAttention:
            strip_attributes(replace_module(layer, "self_attn", MultiheadAttention), LAYER_ATTRIBUTES + ("method_run",))
        replace_module(decoder.layers, str(index), TransformerDecoderLayerBase)
    if type(decoder) is PIDTransformerDecoder:
        strip_attributes(replace_module(model, "decoder", TransformerDecoder), MODEL_ATTRIBUTES + ("method_run",))
