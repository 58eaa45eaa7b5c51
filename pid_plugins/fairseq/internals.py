"""Every fairseq internal the adapter reads (and the one Python internal its compatibility hook relies on), in one
place: what, why, which versions, and the check that runs where the adapter first uses it
(:meth:`pid_plugins.versions.Internal.require`).

fairseq's public extension points carry most of the adapter: ``--user-dir``, ``register_model`` /
``register_model_architecture``, the config dataclasses, the model's builder hooks (``build_model``,
``build_decoder_layer``, ``build_self_attention``) and ``upgrade_state_dict_named``. What is left: the incremental
state of ``MultiheadAttention`` (its private buffer accessors and layout), the parts of fairseq's decoder layer,
decoder and language model that the method classes compute again with the method's step in between, the ``torch``
global ``checkpoint_utils`` loads through, ``numpy.compat`` (gone in NumPy 2), the ``param_group`` attribute
``--optimizer composite`` reads, and Python's ``dataclasses._get_field`` (the hook that lets fairseq 0.12.2 import on
Python 3.11). If one of these changes, the user gets :class:`~pid_plugins.versions.InternalChanged` naming the version
and the tested range, never a different result.

fairseq is imported inside the checks only.
"""
from __future__ import annotations

import inspect
import platform
import re
from typing import Any, FrozenSet

from ..versions import Internal, parameters, reads, require, squashed

__all__ = ["INTERNALS", "PythonInternal", "require_all"]

ZOO = "fairseq"


def assigned(function: Any) -> FrozenSet[str]:
    """The attributes ``function`` assigns on ``self`` (``self.<attribute> =``)."""
    return frozenset(re.findall(r"\bself\.(\w+)\s*=(?!=)", inspect.getsource(function)))


class PythonInternal(Internal):
    """An internal of Python itself (not of a zoo): the message names Python's version and the versions the internal
    is known to hold in (Python has no entry in :data:`~pid_plugins.versions.TESTED`)."""

    def message(self, detail: str = "") -> str:
        extra = f" ({detail})" if detail else ""
        return (
            f"Python {platform.python_version()} changed an internal pid-plugins reads: {self.name}{extra}, needed for "
            f"{self.why}. It is known to hold in Python {self.versions}; run fairseq under one of those, or report it "
            "with this message. Nothing was computed with the changed internal."
        )


# ------------------------------------------------------------------------------------------------------ checks
def _dataclass_field() -> bool:
    import pid_plugins_fairseq_compat

    return pid_plugins_fairseq_compat.target_holds()


def _numpy_compat() -> bool:
    from fairseq.data import language_pair_dataset, token_block_dataset

    names = set()
    for module in (token_block_dataset, language_pair_dataset):
        names.update(re.findall(r"\bnp\.compat\.(\w+)", inspect.getsource(module)))
    return names == {"long"}


def _checkpoint_torch() -> bool:
    import types

    from fairseq import checkpoint_utils

    source, load = squashed(checkpoint_utils), squashed(checkpoint_utils.load_checkpoint_to_cpu)
    return (isinstance(checkpoint_utils.torch, types.ModuleType) and checkpoint_utils.torch.__name__ == "torch"
            and "state=torch.load(f,map_location=torch.device('cpu'))" in load
            and "fromtorchimport" not in source and "serialization.load(" not in source)


#: the attributes of fairseq's ``MultiheadAttention`` the method layer reads (set in its ``__init__``)
MHA_ATTRIBUTES = frozenset({"q_proj", "k_proj", "v_proj", "out_proj", "dropout_module", "num_heads", "head_dim",
                            "bias_k", "add_zero_attn", "self_attention", "scaling"})


def _mha() -> bool:
    from fairseq.modules.multihead_attention import MultiheadAttention

    return (MHA_ATTRIBUTES <= assigned(MultiheadAttention.__init__)
            and "self.scaling=self.head_dim**-0.5" in squashed(MultiheadAttention.__init__)
            and parameters(MultiheadAttention.forward)[:8] == ["self", "query", "key", "value", "key_padding_mask",
                                                               "incremental_state", "need_weights", "static_kv"]
            and "attn_mask" in parameters(MultiheadAttention.forward))


def _input_buffer() -> bool:
    from fairseq.modules.multihead_attention import MultiheadAttention

    forward, reorder = squashed(MultiheadAttention.forward), squashed(MultiheadAttention.reorder_incremental_state)
    append = inspect.getattr_static(MultiheadAttention, "_append_prev_key_padding_mask")
    return (parameters(MultiheadAttention._get_input_buffer) == ["self", "incremental_state"]
            and parameters(MultiheadAttention._set_input_buffer) == ["self", "incremental_state", "buffer"]
            and isinstance(append, staticmethod)
            and parameters(append.__func__) == ["key_padding_mask", "prev_key_padding_mask", "batch_size", "src_len",
                                                "static_kv"]
            and "saved_state['prev_key']=k.view(kv_bsz,self.num_heads,-1,self.head_dim)" in forward
            and "saved_state['prev_value']=v.view(kv_bsz,self.num_heads,-1,self.head_dim)" in forward
            and "saved_state['prev_key_padding_mask']=key_padding_mask" in forward
            and "forkininput_buffer.keys():" in reorder
            and "input_buffer[k]=input_buffer_k.index_select(0,new_order)" in reorder)


#: what fairseq's ``TransformerDecoderLayerBase.forward`` reads: the method layer computes it again
DECODER_LAYER_READS = frozenset({
    "activation_dropout_module", "activation_fn", "attn_ln", "c_attn", "cross_self_attention", "dropout_module",
    "embed_dim", "encoder_attn", "encoder_attn_layer_norm", "fc1", "fc2", "ffn_layernorm", "final_layer_norm",
    "head_dim", "need_attn", "nh", "normalize_before", "onnx_trace", "residual_connection", "self_attn",
    "self_attn_layer_norm", "training", "w_resid"})
DECODER_LAYER_PARAMETERS = ["self", "x", "encoder_out", "encoder_padding_mask", "incremental_state",
                            "prev_self_attn_state", "prev_attn_state", "self_attn_mask", "self_attn_padding_mask",
                            "need_attn", "need_head_weights"]


def _decoder_layer() -> bool:
    from fairseq.modules.transformer_layer import TransformerDecoderLayerBase

    init = squashed(TransformerDecoderLayerBase.__init__)
    built = init.find("self.self_attn=self.build_self_attention(self.embed_dim,cfg,add_bias_kv=add_bias_kv,")
    return (0 <= init.find("self.quant_noise_block_size=cfg.quant_noise.pq_block_size") < built
            and parameters(TransformerDecoderLayerBase.build_self_attention) == ["self", "embed_dim", "cfg",
                                                                                 "add_bias_kv", "add_zero_attn"]
            and parameters(TransformerDecoderLayerBase.forward) == DECODER_LAYER_PARAMETERS
            and reads(TransformerDecoderLayerBase.forward) == DECODER_LAYER_READS)


#: what fairseq's ``TransformerDecoderBase.extract_features_scriptable`` reads: the method decoder computes it again
DECODER_READS = frozenset({
    "buffered_future_mask", "cross_self_attention", "dropout_module", "embed_positions", "embed_scale", "embed_tokens",
    "layer_norm", "layernorm_embedding", "layers", "num_layers", "padding_idx", "project_in_dim", "project_out_dim",
    "quant_noise"})
DECODER_PARAMETERS = ["self", "prev_output_tokens", "encoder_out", "incremental_state", "full_context_alignment",
                      "alignment_layer", "alignment_heads"]


def _decoder() -> bool:
    from fairseq.models.transformer import TransformerDecoder, TransformerDecoderBase

    return (parameters(TransformerDecoderBase.extract_features_scriptable) == DECODER_PARAMETERS
            and reads(TransformerDecoderBase.extract_features_scriptable) == DECODER_READS
            and "extract_features_scriptable" not in vars(TransformerDecoder)
            and parameters(TransformerDecoder.build_decoder_layer) == ["self", "args", "no_encoder_attn"]
            and "self.build_decoder_layer(cfg,no_encoder_attn)" in squashed(TransformerDecoderBase.__init__))


#: the options fairseq's ``TransformerLanguageModel.build_model`` reads: the method model's builds the same modules
BUILD_MODEL_ARGS = frozenset({
    "adaptive_input", "adaptive_input_cutoff", "adaptive_input_factor", "adaptive_softmax_cutoff",
    "adaptive_softmax_factor", "char_embedder_highway_layers", "character_embedding_dim", "character_embeddings",
    "character_filters", "decoder_embed_dim", "decoder_input_dim", "decoder_layers", "decoder_layers_to_keep",
    "decoder_output_dim", "max_target_positions", "quant_noise_pq", "quant_noise_pq_block_size",
    "tie_adaptive_weights"})


def _build_model() -> bool:
    from fairseq.models.transformer_lm import TransformerLanguageModel

    build = TransformerLanguageModel.build_model
    return (reads(build, "args") == BUILD_MODEL_ARGS and reads(build, "cls") == {"build_embedding"}
            and "decoder=TransformerDecoder(args,task.target_dictionary,embed_tokens,no_encoder_attn=True)"
            in squashed(build))


def _param_group() -> bool:
    from fairseq.optim import composite

    return "group=getattr(p,'param_group','default')" in squashed(composite)


# ------------------------------------------------------------------------------------------------- the internals
DATACLASS_FIELD = PythonInternal(
    "python", "dataclasses._get_field(cls, a_name, a_type, ...) refusing defaults whose class is unhashable",
    "importing fairseq 0.12.2 and hydra 1.0.7, whose config dataclasses have dataclass instances as defaults "
    "(pid_plugins_fairseq_compat)", "3.11 - 3.13", _dataclass_field)
NUMPY_COMPAT = Internal(
    ZOO, "fairseq reads numpy.compat.long (and no other numpy.compat name)",
    "providing numpy.compat.long under NumPy 2 (fairseq's eos-break datasets: fairseq-interactive, the hub "
    "interface's score/sample)", "0.12.2", _numpy_compat)
CHECKPOINT_TORCH = Internal(
    ZOO, "fairseq.checkpoint_utils.torch (the module global every checkpoint load calls torch.load on)",
    "loading every fairseq checkpoint with weights_only=True whatever TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD says",
    "0.12.2", _checkpoint_torch)
MHA = Internal(
    ZOO, "MultiheadAttention's q_proj/k_proj/v_proj/out_proj, dropout_module, num_heads, head_dim, scaling, bias_k, "
    "add_zero_attn, self_attention and its forward's keywords",
    "the method layer's q/k/v from the layer's own projections, and fairseq's own attention as the warm-up's stock "
    "path", "0.12.2", _mha)
INPUT_BUFFER = Internal(
    ZOO, "MultiheadAttention._get_input_buffer/_set_input_buffer, _append_prev_key_padding_mask and the buffer's "
    "layout (prev_key/prev_value (batch, heads, time, head_dim); reorder_incremental_state reorders every entry)",
    "incremental decoding and beam search of the method layers (their keys, values and a method's own cache slot)",
    "0.12.2", _input_buffer)
DECODER_LAYER = Internal(
    ZOO, "TransformerDecoderLayerBase: build_self_attention(embed_dim, cfg, add_bias_kv, add_zero_attn) called in "
    "__init__, and forward (its parameters and the attributes it reads)",
    "PIDTransformerDecoderLayer builds PIDMultiheadAttention and computes fairseq's layer again with the method",
    "0.12.2", _decoder_layer)
DECODER = Internal(
    ZOO, "TransformerDecoderBase.extract_features_scriptable (its parameters and the attributes it reads) and "
    "TransformerDecoder.build_decoder_layer(args, no_encoder_attn)",
    "PIDTransformerDecoder builds the method layers and computes fairseq's decoder again with the method's state "
    "threaded through the layers", "0.12.2", _decoder)
BUILD_MODEL = Internal(
    ZOO, "TransformerLanguageModel.build_model (the options it reads, build_embedding, the decoder it builds)",
    "transformer_lm_pid builds the same modules in the same order (a seed gives the stock model's weights)",
    "0.12.2", _build_model)
PARAM_GROUP = Internal(
    ZOO, "--optimizer composite reads each parameter's param_group attribute",
    "keeping learnable method parameters in their own parameter group (attention_params)", "0.12.2", _param_group)

INTERNALS = (DATACLASS_FIELD, NUMPY_COMPAT, CHECKPOINT_TORCH, MHA, INPUT_BUFFER, DECODER_LAYER, DECODER, BUILD_MODEL,
             PARAM_GROUP)

#: what the method attention relies on
ATTENTION = (MHA, INPUT_BUFFER)
#: what a method language model relies on (built by fairseq, or converted)
MODEL = (BUILD_MODEL, DECODER, DECODER_LAYER, *ATTENTION)


def require_all() -> None:
    """Check every internal now."""
    require(*INTERNALS)
