"""The layers of ``transformer_lm_pid``: fairseq's attention, decoder layer and decoder with an attention method,
the state threaded through the layers; fairseq's parameter names (a ``transformer_lm`` checkpoint loads as is)."""
import json
import logging
from functools import partial
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from fairseq.models.transformer import TransformerDecoder
from fairseq.modules.layer_drop import LayerDropModuleList
from fairseq.modules.multihead_attention import MultiheadAttention
from fairseq.modules.transformer_layer import TransformerDecoderLayerBase

from ..core import AttentionContext, CacheSlot, LayerCall, MethodChoice, StockPath
from ..core.layer import (
    MethodLayer, MethodModel, finished_config, number_layers, replace_module, settle_submodule,
)

#: how to run a fairseq method layer with its state, named in core's MissingLayerState
STATE_ROUTE = ("With fairseq, run the layers through the decoder's own forward (extract_features), which hands the "
               "state from layer to layer (in its method_run).")

__all__ = ["METHOD_PARAM_GROUP", "PIDMultiheadAttention", "PIDTransformerDecoderLayer", "PIDTransformerDecoder"]

IncrementalState = Optional[Dict[str, Dict[str, Optional[Tensor]]]]

logger = logging.getLogger(__name__)

#: the fairseq parameter group (``param.param_group``, ``--optimizer composite``) of every ``attention_params``
METHOD_PARAM_GROUP = "attention_params"


class MethodRun:
    """One forward's method state, warm-up scale and restart flag, which the decoder's layers read and replace."""

    state: Optional[tuple] = None
    scale: Optional[Tensor] = None
    restart = False


class PIDMultiheadAttention(MethodLayer, MultiheadAttention):
    """fairseq self-attention (same parameters) whose output the attention method computes (state in ``method_run``)."""

    def forward(self, query: Tensor, key: Optional[Tensor], value: Optional[Tensor], key_padding_mask: Any = None,
                incremental_state: IncrementalState = None, need_weights: bool = True, static_kv: bool = False,
                attn_mask: Optional[Tensor] = None, **kwargs: Any) -> Tuple[Tensor, Optional[Tensor]]:
        if not self.method_active:
            return super().forward(query, key, value, key_padding_mask, incremental_state, need_weights, static_kv,
                                   attn_mask, **kwargs)
        if key is not query or static_kv:
            raise NotImplementedError(f"{self.attention_method.name} decoder layers support the language-model case "
                                      "(no encoder attention)")
        run = self.method_run
        out, run.state = self.forward_method(query, run.state, incremental_state, attn_mask, key_padding_mask,
                                             run.scale, restart=run.restart)
        return out, None

    def set_attention(self, choice: Optional[MethodChoice], like: Optional[Tensor] = None) -> None:
        """``MethodLayer.set_attention``, then learnable parameters go to :data:`METHOD_PARAM_GROUP`."""
        super().set_attention(choice, like)
        self._tag_learned()

    def _apply(self, fn: Any, *args: Any, **kwargs: Any) -> "PIDMultiheadAttention":
        # a conversion that makes new Parameter objects drops their attributes: tag them again
        result = super()._apply(fn, *args, **kwargs)
        self._tag_learned()
        return result

    def _tag_learned(self) -> None:
        learned = self.__dict__.get("_modules", {}).get("attention_params")
        if learned is not None:
            for parameter in learned.parameters():
                parameter.param_group = METHOD_PARAM_GROUP

    def forward_method(self, x: Tensor, state: Optional[tuple], incremental_state: IncrementalState = None,
                       attn_mask: Optional[Tensor] = None, key_padding_mask: Optional[Tensor] = None,
                       scale: Optional[Tensor] = None, restart: bool = False) -> Tuple[Tensor, tuple]:
        """The layer under its method, one :meth:`~pid_plugins.core.AttentionMethod.apply`, SDPA as ``attend``."""
        T, B, C = x.shape
        H, D = self.num_heads, self.head_dim
        context = AttentionContext(causal=True, cached=incremental_state is not None,
                                   dropout=self.training and self.dropout_module.p > 0)

        def project_term(term: Tensor) -> Tensor:
            return F.linear(term.permute(2, 0, 1, 3).reshape(T, B, C), self.out_proj.weight)

        if scale is not None:
            def stock() -> Tensor:
                return MultiheadAttention.forward(self, query=x, key=x, value=x, key_padding_mask=key_padding_mask,
                                                  incremental_state=incremental_state, need_weights=False,
                                                  attn_mask=attn_mask)[0]

            v = self.v_proj(x).view(T, B, H, D).permute(1, 2, 0, 3)
            call = LayerCall(None, None, None, v, context=context, scale=scale, stock=StockPath(stock, project_term),
                             layer=self.layer_index, restart=restart, state_route=STATE_ROUTE)
            return self.apply_method(call, state)
        q, k, v = (proj(x).view(T, B, H, D).permute(1, 2, 0, 3) for proj in (self.q_proj, self.k_proj, self.v_proj))
        v_query = v
        slot: Optional[Callable[[], CacheSlot]] = None
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
            slot = partial(_BufferSlot, self, incremental_state)
        mask: Optional[Tensor] = None
        if attn_mask is not None:
            mask = attn_mask.to(q.dtype)[None, None]
        if key_padding_mask is not None:
            pad = torch.zeros(B, 1, 1, k.size(2), dtype=q.dtype, device=q.device)
            pad = pad.masked_fill(key_padding_mask.bool()[:, None, None, :], float("-inf"))
            mask = pad if mask is None else mask + pad
        dropout_p = self.dropout_module.p if self.training else 0.0

        def attend(query: Tensor, value: Tensor) -> Tensor:
            return F.scaled_dot_product_attention(query, k, value, attn_mask=mask, dropout_p=dropout_p)

        def visible() -> Optional[Tensor]:  # which keys each query sees (causal mask and padding)
            return None if mask is None else (mask > float("-inf")).expand(mask.shape[0], 1, T, k.size(2))

        def project(out: Tensor) -> Tensor:
            return self.out_proj(out.permute(2, 0, 1, 3).reshape(T, B, C))

        call = LayerCall(attend, q, v, v_query, context=context, visible=visible, slot=slot, project=project,
                         layer=self.layer_index, restart=restart, state_route=STATE_ROUTE)
        return self.apply_method(call, state)


class _BufferSlot(CacheSlot):
    """A method's per-position tensor in the layer's incremental buffer, reordered with its keys and values."""

    KEY = "prev_method_slot"

    def __init__(self, layer: "PIDMultiheadAttention", incremental_state: Dict[str, Dict[str, Optional[Tensor]]]):
        self.layer, self.incremental_state = layer, incremental_state

    def __call__(self, rows: Tensor) -> Tensor:
        saved = self.layer._get_input_buffer(self.incremental_state)
        previous = saved.get(self.KEY)
        stored = rows if previous is None else torch.cat([previous, rows], dim=2)
        saved[self.KEY] = stored
        self.layer._set_input_buffer(self.incremental_state, saved)
        return stored


class PIDTransformerDecoderLayer(TransformerDecoderLayerBase):
    """fairseq's decoder layer (no encoder attention) with :class:`PIDMultiheadAttention` (:func:`switch_layers`)."""


def embedding_like(decoder: TransformerDecoder) -> Tensor:
    """A parameter of the decoder's token embedding, for the device and dtype of what the method adds."""
    return next(decoder.embed_tokens.parameters())


def decoder_layers(decoder: TransformerDecoder) -> List[Any]:
    """The decoder's layers in order, every one (``LayerDropModuleList`` yields a random subset in training)."""
    return [decoder.layers[i] for i in range(len(decoder.layers))]


def self_attentions(decoder: TransformerDecoder) -> List[MultiheadAttention]:
    """The decoder's self-attention modules in layer order: the method's group."""
    return [layer.self_attn for layer in decoder_layers(decoder)]


def switch_layers(decoder: TransformerDecoder, choice: Optional[MethodChoice]) -> None:
    """The decoder's layers and their self-attention as the method classes with ``choice``, in place."""
    run = decoder.__dict__.setdefault("method_run", MethodRun())
    for index in range(len(decoder.layers)):
        layer = replace_module(decoder.layers, str(index), PIDTransformerDecoderLayer)
        attn = replace_module(layer, "self_attn", PIDMultiheadAttention)
        attn.set_attention(choice, attn.q_proj.weight)
        attn.__dict__["method_run"] = run
        settle_submodule(attn, "attention_params")
    number_layers(self_attentions(decoder))


class PIDTransformerDecoder(MethodModel, TransformerDecoder):
    """fairseq's decoder with :class:`PIDTransformerDecoderLayer` layers, the method's state threaded through them."""

    def __init__(self, args: Any, dictionary: Any, embed_tokens: Any, no_encoder_attn: bool = False,
                 output_projection: Any = None, *, choice: Optional[MethodChoice] = None) -> None:
        if getattr(args, "checkpoint_activations", False):
            raise ValueError("--checkpoint-activations is not supported by transformer_lm_pid yet; drop it")
        super().__init__(args, dictionary, embed_tokens, no_encoder_attn=no_encoder_attn,
                         output_projection=output_projection)
        if any(type(layer) is not TransformerDecoderLayerBase for layer in decoder_layers(self)):
            raise ValueError("transformer_lm_pid: fairseq's --ddp-backend fully_sharded (fairscale) wraps the decoder "
                             "layers, which PID's layer loop is not tested with; use --ddp-backend legacy_ddp / "
                             "pytorch_ddp, or torch's FSDP2 fully_shard per layer (README, Scaling out)")
        switch_layers(self, choice)
        self.set_model_method(choice, embedding_like(self), stock_plus_term=True, where="transformer_lm_pid")

    def upgrade_state_dict_named(self, state_dict: Dict[str, Tensor], name: str) -> Dict[str, Tensor]:
        """fairseq's upgrade, then one warning if this decoder warms up and the checkpoint has no warm-up counter."""
        state_dict = super().upgrade_state_dict_named(state_dict, name)
        key = f"{name}.attention_warmup.step" if name else "attention_warmup.step"
        if self.attention_warmup is not None and key not in state_dict:
            cfg = finished_config(self.attention_config)
            logger.warning(
                "%s: this checkpoint has no gain warm-up counter, so the warm-up (warmup_steps=%d) starts at t=0: the "
                "stock model. Meant when fine-tuning a softmax checkpoint; a model saved after "
                "pid_plugins.finish_warmup loads with its warm-up off: arg_overrides={'attention_cfg': %r} (its "
                "--attention-cfg without warmup_steps)", key, self.attention_warmup.warmup_steps,
                json.dumps(cfg.to_dict() if hasattr(cfg, "to_dict") else str(cfg)))
        return state_dict

    def extract_features_scriptable(  # type: ignore[override]
        self, prev_output_tokens: Tensor, encoder_out: Optional[Dict[str, List[Tensor]]],
        incremental_state: IncrementalState = None, full_context_alignment: bool = False,
        alignment_layer: Optional[int] = None, alignment_heads: Optional[int] = None,
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
        run = self.method_run
        run.state, run.scale = None, self.method_scale()  # one warm-up step per forward of the decoder
        # --decoder-layerdrop skips layers on purpose: a layer after only skipped ones starts the state afresh
        run.restart = self.training and isinstance(self.layers, LayerDropModuleList)
        for idx, layer in enumerate(self.layers):
            self_attn_mask = (self.buffered_future_mask(x)
                              if incremental_state is None and not full_context_alignment else None)
            x, layer_attn, _ = layer(
                x, enc, padding_mask, incremental_state, self_attn_mask=self_attn_mask,
                self_attn_padding_mask=self_attn_padding_mask, need_attn=bool(idx == alignment_layer),
                need_head_weights=bool(idx == alignment_layer))
            inner_states.append(x)
            if layer_attn is not None and idx == alignment_layer:
                attn = layer_attn.float().to(x)
        run.state, run.scale, run.restart = None, None, False
        if attn is not None:
            attn = (attn[:alignment_heads] if alignment_heads is not None else attn).mean(dim=0)
        if self.layer_norm is not None:
            x = self.layer_norm(x)
        x = x.transpose(0, 1)
        if self.project_out_dim is not None:
            x = self.project_out_dim(x)
        return x, {"attn": [attn], "inner_states": inner_states}
