"""``--arch transformer_lm_pid`` (and ``registry/fairseq.toml``'s architectures): ``transformer_lm`` with a method."""
# no `from __future__ import annotations`: omegaconf 2.0 reads the config dataclass field types at run time

import ast
import json
from typing import Any

from fairseq import options
from fairseq.models import register_model, register_model_architecture
from fairseq.models.transformer_lm import DEFAULT_MAX_TARGET_POSITIONS, TransformerLanguageModel, base_lm_architecture
from fairseq.modules import AdaptiveInput, CharacterTokenEmbedder
from fairseq.utils import safe_getattr

from ..catalogue import load_catalogue
from .hub import load_pid_lm
from .layers import METHOD_PARAM_GROUP, PIDMultiheadAttention, PIDTransformerDecoder, PIDTransformerDecoderLayer
from .options import PIDTransformerLanguageModelConfig, attention_from_args, method_name, parse_attention_cfg

__all__ = ["METHOD_PARAM_GROUP", "PIDMultiheadAttention", "PIDTransformerDecoderLayer", "PIDTransformerDecoder",
           "PIDTransformerLanguageModel", "PIDTransformerLanguageModelConfig", "attention_from_args", "load_pid_lm"]


@register_model("transformer_lm_pid", dataclass=PIDTransformerLanguageModelConfig)
class PIDTransformerLanguageModel(TransformerLanguageModel):
    """fairseq's ``transformer_lm`` built with :class:`PIDTransformerDecoder` and the ``--attention-method``."""

    @classmethod
    def build_model(cls, args: Any, task: Any) -> "PIDTransformerLanguageModel":
        """fairseq's ``build_model`` with :class:`PIDTransformerDecoder`: the same modules in the same order."""
        choice = attention_from_args(args)
        if safe_getattr(args, "checkpoint_activations", False):
            raise ValueError("--checkpoint-activations is not supported by transformer_lm_pid yet; drop it")
        if args.decoder_layers_to_keep:
            args.decoder_layers = len(args.decoder_layers_to_keep.split(","))
        if safe_getattr(args, "max_target_positions", None) is None:
            args.max_target_positions = safe_getattr(args, "tokens_per_sample", DEFAULT_MAX_TARGET_POSITIONS)
        if args.character_embeddings:
            embed_tokens = CharacterTokenEmbedder(
                task.source_dictionary, ast.literal_eval(args.character_filters), args.character_embedding_dim,
                args.decoder_embed_dim, args.char_embedder_highway_layers)
        elif args.adaptive_input:
            embed_tokens = AdaptiveInput(
                len(task.source_dictionary), task.source_dictionary.pad(), args.decoder_input_dim,
                args.adaptive_input_factor, args.decoder_embed_dim,
                options.eval_str_list(args.adaptive_input_cutoff, type=int), args.quant_noise_pq,
                args.quant_noise_pq_block_size)
        else:
            embed_tokens = cls.build_embedding(args, task.source_dictionary, args.decoder_input_dim)
        if args.tie_adaptive_weights:
            if not (args.adaptive_input and args.adaptive_input_factor == args.adaptive_softmax_factor
                    and args.adaptive_softmax_cutoff == args.adaptive_input_cutoff
                    and args.decoder_input_dim == args.decoder_output_dim):
                raise ValueError("--tie-adaptive-weights needs --adaptive-input with the adaptive softmax's factor "
                                 "and cutoff, and --decoder-input-dim equal to --decoder-output-dim")
        decoder = PIDTransformerDecoder(args, task.target_dictionary, embed_tokens, no_encoder_attn=True,
                                        choice=choice)
        return cls(decoder)


def _entry_attention_cfg(entry: Any, given: Any) -> str:
    """``--attention-cfg`` for a catalogue architecture: the entry's parameters, then what the user gave."""
    params = parse_attention_cfg(given) if given not in (None, "") else {}
    if isinstance(params, str) or "preset" in params:
        return given if isinstance(given, str) else json.dumps(params)
    base = {"preset": entry.preset, **entry.gains} if entry.preset else entry.default_config().to_dict()
    return json.dumps({**base, **params})


def _register_architectures() -> None:
    for entry in load_catalogue().values():
        if entry.zoo != "fairseq" or entry.name == "transformer_lm_pid":
            continue

        def arch(args: Any, _entry=entry) -> None:
            # fairseq leaves unset options as None before applying the architecture: fill in the entry's values
            for key, value in _entry.kwargs.items():
                setattr(args, key, safe_getattr(args, key, value))
            if method_name(args) == _entry.method:
                args.attention_cfg = _entry_attention_cfg(_entry, safe_getattr(args, "attention_cfg", None))
            base_lm_architecture(args)

        register_model_architecture("transformer_lm_pid", entry.name)(arch)


_register_architectures()
