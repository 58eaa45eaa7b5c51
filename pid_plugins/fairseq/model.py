"""PID transformer language model for fairseq (``--arch transformer_lm_pid``).

fairseq's ``MultiheadAttention`` runs the fused ``F.multi_head_attention_forward`` in training, where per-head
values never exist in Python, and its decoder calls each layer with no side channel. So the PID model is
fairseq's own ``transformer_lm`` with three classes swapped in after building (parameters untouched, so a
softmax ``transformer_lm`` checkpoint loads as is):

* :class:`PIDMultiheadAttention` computes q/k/v with the layer's own projections, runs SDPA, applies
  :func:`pid_plugins.core.pid_update` to the current positions' values, and keeps fairseq's incremental
  cache (``prev_key``/``prev_value`` batch-first, so beam reordering needs nothing more);
* :class:`PIDTransformerDecoderLayer` returns the PID state as a fourth output;
* :class:`PIDTransformerDecoder` threads it through the layer loop, one fresh state per forward.

With softmax attention or all gains zero the layers run fairseq's own code, so outputs equal the stock model's.
"""
# no `from __future__ import annotations`: omegaconf 2.0 reads the config dataclass field types at run time

import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from fairseq.models import register_model, register_model_architecture
from fairseq.models.transformer import TransformerDecoder
from fairseq.models.transformer_lm import (
    TransformerLanguageModel, TransformerLanguageModelConfig, base_lm_architecture,
)
from fairseq.modules.multihead_attention import MultiheadAttention
from fairseq.modules.transformer_layer import TransformerDecoderLayerBase
from fairseq.utils import safe_getattr

from ..catalogue import load_catalogue
from ..core import GainWarmup, PIDConfig, PIDState, make_warmup, pid_term, pid_update, scaled_gains, warmup_scale

__all__ = [
    "PIDMultiheadAttention", "PIDTransformerDecoderLayer", "PIDTransformerDecoder", "PIDTransformerLanguageModel",
    "PIDTransformerLanguageModelConfig", "load_pid_lm",
]

_LM = PIDConfig.preset("lm")
IncrementalState = Optional[Dict[str, Dict[str, Optional[Tensor]]]]


@dataclass
class PIDTransformerLanguageModelConfig(TransformerLanguageModelConfig):
    pid_attention: str = field(default="pid", metadata={"help": "'pid', or 'softmax' for the stock model"})
    pid_lambda_p: float = field(default=_LM.lambda_p, metadata={"help": "PID proportional gain (>= 0)"})
    pid_lambda_i: float = field(default=_LM.lambda_i, metadata={"help": "PID integral gain (>= 0)"})
    pid_lambda_d: float = field(default=_LM.lambda_d, metadata={"help": "PID derivative gain (>= 0)"})
    pid_beta: float = field(default=_LM.beta, metadata={"help": "weight of the first layer's values, in (0, 1]"})
    # a value, not a flag: fairseq turns a bool field that defaults to True into a flag that sets it False
    pid_control_first_layer: str = field(default="true", metadata={
        "help": "'true' (default): the first layer gets the PID term too (eq. 25 with sums from layer 1); 'false': "
                "it computes plain attention and only records v^1 (NeuTRENO's convention)"})
    pid_warmup_steps: int = field(default=0, metadata={
        "help": "gain warm-up for fine-tuning into PID: the PID term is scaled by min(1, t/N), t counting training "
                "forward passes (saved in the checkpoint: --restore-file continues it); 0 (default): off"})


def pid_config_from_args(args: Any) -> Optional[PIDConfig]:
    attention = safe_getattr(args, "pid_attention", "pid")
    if attention not in ("pid", "softmax"):
        raise ValueError(f"--pid-attention must be 'pid' or 'softmax', got {attention!r}")
    if attention == "softmax":
        return None
    return PIDConfig(
        lambda_p=safe_getattr(args, "pid_lambda_p", _LM.lambda_p), lambda_i=safe_getattr(args, "pid_lambda_i", _LM.lambda_i),
        lambda_d=safe_getattr(args, "pid_lambda_d", _LM.lambda_d), beta=safe_getattr(args, "pid_beta", _LM.beta),
        control_first_layer=_as_bool(safe_getattr(args, "pid_control_first_layer", "true"), "--pid-control-first-layer"),
        warmup_steps=safe_getattr(args, "pid_warmup_steps", 0),
    )


def _as_bool(value: Any, option: str) -> bool:
    """``true``/``false`` (any case; also 1/0, yes/no) or a bool, as fairseq stores the option."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "1", "yes"):
        return True
    if text in ("false", "0", "no"):
        return False
    raise ValueError(f"{option} takes true or false, got {value!r}")


class PIDMultiheadAttention(MultiheadAttention):
    """fairseq self-attention (same parameters) with :meth:`forward_pid`; ``pid`` set by the model."""

    pid: Optional[PIDConfig] = None

    def forward_pid(
        self,
        x: Tensor,
        state: Optional[PIDState],
        incremental_state: IncrementalState = None,
        attn_mask: Optional[Tensor] = None,
        key_padding_mask: Optional[Tensor] = None,
    ) -> Tuple[Tensor, PIDState]:
        T, B, C = x.shape
        H, D = self.num_heads, self.head_dim
        q, k, v = (proj(x).view(T, B, H, D).permute(1, 2, 0, 3) for proj in (self.q_proj, self.k_proj, self.v_proj))
        v_query = v
        if incremental_state is not None:
            saved = self._get_input_buffer(incremental_state)
            if "prev_key" in saved and saved["prev_key"] is not None:
                k = torch.cat([saved["prev_key"].view(B, H, -1, D), k], dim=2)
                v = torch.cat([saved["prev_value"].view(B, H, -1, D), v], dim=2)
            key_padding_mask = MultiheadAttention._append_prev_key_padding_mask(
                key_padding_mask=key_padding_mask, prev_key_padding_mask=saved.get("prev_key_padding_mask"),
                batch_size=B, src_len=k.size(2), static_kv=False)
            saved["prev_key"], saved["prev_value"], saved["prev_key_padding_mask"] = k, v, key_padding_mask
            self._set_input_buffer(incremental_state, saved)
        mask: Optional[Tensor] = None
        if attn_mask is not None:
            mask = attn_mask.to(q.dtype)[None, None]
        if key_padding_mask is not None:
            pad = torch.zeros(B, 1, 1, k.size(2), dtype=q.dtype, device=q.device)
            pad = pad.masked_fill(key_padding_mask.bool()[:, None, None, :], float("-inf"))
            mask = pad if mask is None else mask + pad
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                             dropout_p=self.dropout_module.p if self.training else 0.0)
        out, state = pid_update(out, v_query, state, self.pid)
        return self.out_proj(out.permute(2, 0, 1, 3).reshape(T, B, C)), state

    def forward_warmup(
        self,
        x: Tensor,
        state: Optional[PIDState],
        scale: Tensor,
        incremental_state: IncrementalState = None,
        attn_mask: Optional[Tensor] = None,
        key_padding_mask: Optional[Tensor] = None,
    ) -> Tuple[Tensor, PIDState]:
        """Under gain warm-up: fairseq's own attention (its fused kernel and cache) plus the PID term scaled by
        ``scale`` through the output projection's weight, so a zero scale is the stock layer exactly."""
        out, _ = MultiheadAttention.forward(self, query=x, key=x, value=x, key_padding_mask=key_padding_mask,
                                            incremental_state=incremental_state, need_weights=False,
                                            attn_mask=attn_mask)
        T, B, C = x.shape
        v = self.v_proj(x).view(T, B, self.num_heads, self.head_dim).permute(1, 2, 0, 3)
        term, state = pid_term(v, state, scaled_gains(self.pid, scale))
        return out + F.linear(term.permute(2, 0, 1, 3).reshape(T, B, C), self.out_proj.weight), state


class PIDTransformerDecoderLayer(TransformerDecoderLayerBase):
    """fairseq's decoder layer (language-model use: no encoder attention) returning the PID state too."""

    def forward(  # type: ignore[override]
        self,
        x: Tensor,
        encoder_out: Optional[Tensor] = None,
        encoder_padding_mask: Optional[Tensor] = None,
        incremental_state: IncrementalState = None,
        prev_self_attn_state: Optional[List[Tensor]] = None,
        prev_attn_state: Optional[List[Tensor]] = None,
        self_attn_mask: Optional[Tensor] = None,
        self_attn_padding_mask: Optional[Tensor] = None,
        need_attn: bool = False,
        need_head_weights: bool = False,
        pid_state: Optional[PIDState] = None,
        pid_scale: Optional[Tensor] = None,
    ):
        pid = self.self_attn.pid
        if pid is None or pid.is_zero:
            out = super().forward(x, encoder_out, encoder_padding_mask, incremental_state, prev_self_attn_state,
                                  prev_attn_state, self_attn_mask, self_attn_padding_mask, need_attn, need_head_weights)
            return (*out, pid_state)
        if encoder_out is not None or self.cross_self_attention or prev_self_attn_state is not None:
            raise NotImplementedError("PID decoder layers support the language-model case (no encoder attention)")
        residual = x
        if self.normalize_before:
            x = self.self_attn_layer_norm(x)
        if pid_scale is not None:  # gain warm-up
            x, pid_state = self.self_attn.forward_warmup(x, pid_state, pid_scale, incremental_state, self_attn_mask,
                                                         self_attn_padding_mask)
        else:
            x, pid_state = self.self_attn.forward_pid(x, pid_state, incremental_state, self_attn_mask,
                                                      self_attn_padding_mask)
        if self.c_attn is not None:
            T, B = x.size(0), x.size(1)
            x = torch.einsum("tbhd,h->tbhd", x.view(T, B, self.nh, self.head_dim), self.c_attn).reshape(T, B, -1)
        if self.attn_ln is not None:
            x = self.attn_ln(x)
        x = self.residual_connection(self.dropout_module(x), residual)
        if not self.normalize_before:
            x = self.self_attn_layer_norm(x)
        residual = x
        if self.normalize_before:
            x = self.final_layer_norm(x)
        x = self.activation_dropout_module(self.activation_fn(self.fc1(x)))
        if self.ffn_layernorm is not None:
            x = self.ffn_layernorm(x)
        x = self.dropout_module(self.fc2(x))
        if self.w_resid is not None:
            residual = torch.mul(self.w_resid, residual)
        x = self.residual_connection(x, residual)
        if not self.normalize_before:
            x = self.final_layer_norm(x)
        return x, None, None, pid_state


class PIDTransformerDecoder(TransformerDecoder):
    """fairseq's decoder with the PID state threaded through the layer loop (one fresh state per forward)."""

    def extract_features_scriptable(  # type: ignore[override]
        self,
        prev_output_tokens: Tensor,
        encoder_out: Optional[Dict[str, List[Tensor]]],
        incremental_state: IncrementalState = None,
        full_context_alignment: bool = False,
        alignment_layer: Optional[int] = None,
        alignment_heads: Optional[int] = None,
    ):
        if alignment_layer is None:
            alignment_layer = self.num_layers - 1
        enc = encoder_out["encoder_out"][0] if encoder_out and len(encoder_out["encoder_out"]) > 0 else None
        padding_mask = (encoder_out["encoder_padding_mask"][0]
                        if encoder_out and len(encoder_out["encoder_padding_mask"]) > 0 else None)
        positions = (self.embed_positions(prev_output_tokens, incremental_state=incremental_state)
                     if self.embed_positions is not None else None)
        if incremental_state is not None:
            prev_output_tokens = prev_output_tokens[:, -1:]
            positions = positions[:, -1:] if positions is not None else None
        prev_output_tokens = prev_output_tokens.contiguous()
        x = self.embed_scale * self.embed_tokens(prev_output_tokens)
        if self.quant_noise is not None:
            x = self.quant_noise(x)
        if self.project_in_dim is not None:
            x = self.project_in_dim(x)
        if positions is not None:
            x += positions
        if self.layernorm_embedding is not None:
            x = self.layernorm_embedding(x)
        x = self.dropout_module(x).transpose(0, 1)
        self_attn_padding_mask: Optional[Tensor] = None
        if torch.compiler.is_compiling():  # no data-dependent branch in a graph: always the mask (maybe all False)
            self_attn_padding_mask = prev_output_tokens.eq(self.padding_idx)
        elif self.cross_self_attention or prev_output_tokens.eq(self.padding_idx).any():
            self_attn_padding_mask = prev_output_tokens.eq(self.padding_idx)
        attn: Optional[Tensor] = None
        inner_states: List[Optional[Tensor]] = [x]
        state: Optional[PIDState] = None
        scale = warmup_scale(self.pid_warmup)  # one warm-up step per forward of the decoder
        for idx, layer in enumerate(self.layers):
            self_attn_mask = (self.buffered_future_mask(x)
                              if incremental_state is None and not full_context_alignment else None)
            x, layer_attn, _, state = layer(
                x, enc, padding_mask, incremental_state, self_attn_mask=self_attn_mask,
                self_attn_padding_mask=self_attn_padding_mask, need_attn=bool(idx == alignment_layer),
                need_head_weights=bool(idx == alignment_layer), pid_state=state, pid_scale=scale,
            )
            inner_states.append(x)
            if layer_attn is not None and idx == alignment_layer:
                attn = layer_attn.float().to(x)
        if attn is not None:
            attn = (attn[:alignment_heads] if alignment_heads is not None else attn).mean(dim=0)
        if self.layer_norm is not None:
            x = self.layer_norm(x)
        x = x.transpose(0, 1)
        if self.project_out_dim is not None:
            x = self.project_out_dim(x)
        return x, {"attn": [attn], "inner_states": inner_states}


def to_pid_decoder(decoder: TransformerDecoder, pid: Optional[PIDConfig]) -> TransformerDecoder:
    """Swap a built fairseq ``TransformerDecoder``'s classes for the PID ones (parameters untouched)."""
    if type(decoder) not in (TransformerDecoder, PIDTransformerDecoder):
        raise TypeError(f"expected fairseq's TransformerDecoder, got {type(decoder).__name__}")
    for i, layer in enumerate(decoder.layers):
        if type(layer) not in (TransformerDecoderLayerBase, PIDTransformerDecoderLayer):
            raise TypeError(
                f"decoder layer {i} is {type(layer).__name__} (wrapped for activation checkpointing or FSDP?): "
                "PID layers need plain TransformerDecoderLayerBase layers; drop --checkpoint-activations"
            )
        if type(layer.self_attn) not in (MultiheadAttention, PIDMultiheadAttention):
            raise TypeError(f"decoder layer {i} uses {type(layer.self_attn).__name__}, not fairseq's MultiheadAttention")
        layer.__class__ = PIDTransformerDecoderLayer
        layer.self_attn.__class__ = PIDMultiheadAttention
        layer.self_attn.pid = pid
    decoder.__class__ = PIDTransformerDecoder
    decoder.pid = pid
    #: the gain warm-up counter (``--pid-warmup-steps N``), advanced once per training forward
    decoder.pid_warmup = make_warmup(pid, decoder._modules.get("pid_warmup"),
                                     like=next(decoder.parameters()))
    return decoder


@register_model("transformer_lm_pid", dataclass=PIDTransformerLanguageModelConfig)
class PIDTransformerLanguageModel(TransformerLanguageModel):
    """fairseq's ``transformer_lm`` with PID attention (gains from ``--pid-*``, preset ``lm`` by default)."""

    @classmethod
    def build_model(cls, args: Any, task: Any) -> "PIDTransformerLanguageModel":
        pid = pid_config_from_args(args)
        if safe_getattr(args, "checkpoint_activations", False):
            raise ValueError("--checkpoint-activations is not supported by transformer_lm_pid yet; drop it")
        model = super().build_model(args, task)
        to_pid_decoder(model.decoder, pid)
        return model


def _register_architectures() -> None:
    for entry in load_catalogue().values():
        if entry.zoo != "fairseq" or entry.name == "transformer_lm_pid":
            continue

        def arch(args: Any, _entry=entry) -> None:
            # fairseq leaves unset options as None before applying the architecture: fill in the entry's values
            for key, value in _entry.kwargs.items():
                setattr(args, key, safe_getattr(args, key, value))
            gains = _entry.pid_config()
            for key in ("lambda_p", "lambda_i", "lambda_d", "beta"):
                setattr(args, f"pid_{key}", safe_getattr(args, f"pid_{key}", getattr(gains, key)))
            args.pid_control_first_layer = safe_getattr(args, "pid_control_first_layer",
                                                        str(gains.control_first_layer).lower())
            base_lm_architecture(args)

        register_model_architecture("transformer_lm_pid", entry.name)(arch)


_register_architectures()


def load_pid_lm(checkpoint: str, data: str, **kwargs: Any):
    """Load a ``transformer_lm_pid`` (or ``transformer_lm``) checkpoint for inference: fairseq's hub interface
    (``.score()``, ``.sample()``, ``.generate()``), in eval mode. ``data`` is the binarised data directory
    (its ``dict.txt``). The file is read with ``torch.load(weights_only=True)`` whatever the environment says
    (:mod:`pid_plugins.fairseq.checkpoint`): a checkpoint holding anything but tensors, containers and
    ``argparse.Namespace`` raises :class:`~pid_plugins.fairseq.checkpoint.UnsafeCheckpointError`.
    """
    if not os.path.isfile(checkpoint):
        raise FileNotFoundError(f"fairseq checkpoint not found: {checkpoint!r}")
    if not os.path.isfile(os.path.join(data, "dict.txt")):
        raise FileNotFoundError(f"no dict.txt in {data!r}: pass the data-bin directory the model was trained on")
    hub = TransformerLanguageModel.from_pretrained(
        os.path.dirname(os.path.abspath(checkpoint)), checkpoint_file=os.path.basename(checkpoint),
        data_name_or_path=os.path.abspath(data), **kwargs)
    hub.eval()
    return hub
