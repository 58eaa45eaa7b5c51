"""The behavioural probes of :mod:`pid_plugins.fairseq.internals` (registered in its ``PROBES`` on import): the method
classes compute fairseq's ``MultiheadAttention`` (its incremental buffer included), ``TransformerDecoderLayerBase``
and ``TransformerDecoderBase`` again, and ``transformer_lm_pid`` builds what ``TransformerLanguageModel.build_model``
builds. Each probe builds the stock part and the method's on the same perturbed weights and compares what they
compute; the build probe builds both models from one seed and compares their parameters bit for bit. A release that
computes (or builds) differently fails its probe, whatever its source text; one that only rewrites the text passes.

The method's parts run PID at vanishing gains (``lambda_p = 1e-30``, the other gains 0): not the identity, so the
method classes compute the attention (q, k, v from the layer's projections, SDPA with the masks, the output
projection, the incremental buffer) at every layer, but the term they add (1e-30 times the error) is far below the
float32 rounding of the attention output: nothing is added. (At zero gains the adapter keeps fairseq's own layers,
which would test nothing.) Outputs are compared to float32 rounding (``rtol=1e-5, atol=1e-6``), as mmseg's are: the
method attention runs SDPA on the layer's projections, which fairseq's full-sequence forward also does (through
torch's ``multi_head_attention_forward``: equal here, bit for bit, but that is torch's choice of kernel), while
fairseq's incremental path scales q first and runs its own matmuls and softmax (about 2e-7 apart here, and the logits
of the decoder probe about 1e-6; a changed step moves them far more). The cached keys and values are the same
projections in both, compared bit for bit. The decoder probe also runs the gain warm-up at scale 0 (fairseq's own
attention plus the method's term scaled by 0, the method classes' layer and decoder around it), which equals the
stock model bit for bit.
"""
from __future__ import annotations

import argparse
import copy
import json
import types
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from fairseq.data import Dictionary
from fairseq.dataclass.utils import gen_parser_from_dataclass
from fairseq.models.transformer import TransformerConfig
from fairseq.models.transformer_lm import TransformerLanguageModel, base_lm_architecture
from fairseq.modules.multihead_attention import MultiheadAttention
from fairseq.modules.transformer_layer import TransformerDecoderLayerBase

from ..core import get_method
from ..core.record import RECORD
from ..versions import behaviour_probe, close_to_rounding, perturbed
from .internals import MHA_ATTRIBUTES, PROBES
from .layers import PIDMultiheadAttention, PIDTransformerDecoder, PIDTransformerDecoderLayer, _BufferSlot
from .model import PIDTransformerLanguageModel
from .options import PIDTransformerLanguageModelConfig

__all__ = ["PLAIN", "PROBE_LM", "PROBE_LMS", "PROBE_BUILDS"]

#: PID whose term is far below float32 rounding: the method classes compute the attention at every layer and add
#: nothing (at zero gains the adapter keeps fairseq's own layers, which would test nothing)
PLAIN = dict(lambda_p=1e-30, lambda_i=0.0, lambda_d=0.0)
#: the probes' language model: 2 layers, dimension 16, 2 heads (options as fairseq-train spells them)
PROBE_LM = dict(decoder_layers=2, decoder_embed_dim=16, decoder_ffn_embed_dim=32, decoder_attention_heads=2,
                dropout=0.0, max_target_positions=16)
#: the forward probes' variants: every option of fairseq's decoder and layer the method classes compute again
#: (pre-norm with every scale option, an input/output projection, an embedding norm and learned positions; post-norm
#: with sinusoidal positions, unscaled embeddings and no final norm)
PROBE_LMS = (
    dict(decoder_input_dim=8, decoder_output_dim=12, layernorm_embedding=True, decoder_learned_pos=True,
         scale_attn=True, scale_heads=True, scale_fc=True, scale_resids=True),
    dict(decoder_normalize_before=False, no_decoder_final_norm=True, no_scale_embedding=True),
)
#: the build probe's variants: the forward probes' and every branch of build_model (character embeddings; adaptive
#: input with the adaptive softmax tied to it, and decoder_layers_to_keep)
PROBE_BUILDS = (
    *PROBE_LMS,
    dict(character_embeddings=True, character_filters="[(1, 4), (2, 4)]", character_embedding_dim=4,
         char_embedder_highway_layers=1),
    dict(adaptive_input=True, adaptive_input_cutoff="6,12", adaptive_input_factor=2, adaptive_softmax_cutoff="6,12",
         adaptive_softmax_factor=2, tie_adaptive_weights=True, tie_adaptive_proj=True, decoder_layers_to_keep="0,1"),
)
E, H = PROBE_LM["decoder_embed_dim"], PROBE_LM["decoder_attention_heads"]
PAD = 1  # fairseq Dictionary's pad index


def _choice() -> Tuple[Any, Any]:
    """PID at :data:`PLAIN` (over fairseq's preset): the method and its config."""
    method = get_method("pid")
    return method, method.configure(dict(PLAIN), "fairseq")


def _causal(T: int) -> Tensor:
    """fairseq's causal mask (``buffered_future_mask``): 0 on and below the diagonal, -inf above."""
    return torch.triu(torch.full((T, T), float("-inf")), 1)


def _right_padding(B: int, T: int) -> Tensor:
    """A key padding mask with the last two positions of the first row padded (every query still sees a key)."""
    mask = torch.zeros(B, T, dtype=torch.bool)
    mask[0, -2:] = True
    return mask


# ------------------------------------------------------------------------------------------------- attention
def _attention_pair() -> Tuple[MultiheadAttention, PIDMultiheadAttention]:
    stock = perturbed(MultiheadAttention(E, H, dropout=0.1, self_attention=True))
    method, config = _choice()
    layer = PIDMultiheadAttention(E, H, dropout=0.1, self_attention=True, method=method, config=config)
    layer.load_state_dict(stock.state_dict())
    return stock, layer.eval()


@behaviour_probe
def _attention_probe() -> bool:
    """fairseq's MultiheadAttention (self-attention) and the method attention on its weights compute the same, to
    float32 rounding: a full-sequence forward under fairseq's causal mask and a key padding mask. The attributes the
    adapter reads are the stock layer's (its dropout module with the layer's probability)."""
    stock, layer = _attention_pair()
    if not (all(hasattr(stock, name) for name in MHA_ATTRIBUTES) and stock.dropout_module.p == 0.1
            and (stock.num_heads, stock.head_dim) == (H, E // H) and layer.method_active):
        return False
    T, B = 6, 2
    x = torch.randn(T, B, E)
    mask, padding = _causal(T), _right_padding(B, T)
    with torch.no_grad():
        want = stock(x, x, x, key_padding_mask=padding, need_weights=False, attn_mask=mask)[0]
        got = layer.forward_method(x, None, None, mask, padding)[0]
        plain = stock(x, x, x, need_weights=False, attn_mask=mask)[0]
        got_plain = layer.forward_method(x, None, None, mask, None)[0]
    return close_to_rounding(got, want) and close_to_rounding(got_plain, plain)


def _buffers(layer: MultiheadAttention, state: Dict[str, Any]) -> Dict[str, Optional[Tensor]]:
    return dict(layer._get_input_buffer(state))


def _same_buffers(got: Dict[str, Optional[Tensor]], want: Dict[str, Optional[Tensor]]) -> bool:
    """The method layer's buffer holds the stock layer's entries (the same keys and tensors, bit for bit: the same
    projections), and a method's own cache slot beside them."""
    got = {k: v for k, v in got.items() if k != _BufferSlot.KEY}
    return got.keys() == want.keys() and all(
        (a is None and b is None) or (a is not None and b is not None and a.shape == b.shape
                                      and torch.equal(a.float(), b.float())) for a, b in
        ((got[k], want[k]) for k in want))


def _padding_of(step_mask: Tensor, T: int) -> Tensor:
    """The full-sequence key padding mask of a decode whose step 2 had ``step_mask``."""
    padding = torch.zeros(step_mask.size(0), T, dtype=torch.bool)
    padding[:, 2] = step_mask[:, 0]
    return padding


@behaviour_probe
def _incremental_probe() -> bool:
    """Incremental decoding through ``incremental_state``, one position at a time (a key padding mask at one step),
    then fairseq's ``reorder_incremental_state`` (a beam reorder) and more steps: at every step the method attention's
    output equals fairseq's (float32 rounding), its buffer holds fairseq's ``prev_key`` / ``prev_value`` /
    ``prev_key_padding_mask`` bit for bit, and the reorder reorders a method's own cache slot with them (batch-first,
    as the method layer keeps it). Its steps also equal its own full-sequence forward."""
    stock, layer = _attention_pair()
    T, B = 6, 3
    x = torch.randn(T, B, E)
    order = torch.tensor([2, 1, 1])  # (the padded row kept, twice)
    step_mask = torch.tensor([[False], [True], [False]])  # the second row's key at step 2 is padding
    stock_state: Dict[str, Any] = {}
    method_state: Dict[str, Any] = {}
    outputs: List[Tensor] = []
    slot_rows: List[Tensor] = []
    with torch.no_grad():
        for t in range(T):
            xt = x[t:t + 1]
            padding = step_mask if t == 2 else None
            want = stock(xt, xt, xt, key_padding_mask=padding, incremental_state=stock_state, need_weights=False)[0]
            got = layer.forward_method(xt, None, method_state, None, padding)[0]
            if not (close_to_rounding(got, want) and _same_buffers(_buffers(layer, method_state), _buffers(stock, stock_state))):
                return False
            outputs.append(got)
            slot_rows.append(torch.randn(B, H, 1, E // H))
            _BufferSlot(layer, method_state)(slot_rows[-1])  # a method's tensor kept beside the keys (Twicing's A v)
            if t == 2:  # beam search's reorder: the rows follow
                stock.reorder_incremental_state(stock_state, order)
                layer.reorder_incremental_state(method_state, order)
                if not _same_buffers(_buffers(layer, method_state), _buffers(stock, stock_state)):
                    return False
                x, step_mask = x.index_select(1, order), step_mask.index_select(0, order)
                outputs = [out.index_select(1, order) for out in outputs]
                slot_rows = [rows.index_select(0, order) for rows in slot_rows]
        slot = _buffers(layer, method_state).get(_BufferSlot.KEY)
        full = layer.forward_method(x, None, None, _causal(T), _padding_of(step_mask, T))[0]
    return slot is not None and torch.equal(slot, torch.cat(slot_rows, dim=2)) and close_to_rounding(torch.cat(outputs), full)


# ------------------------------------------------------------------------------------------------ decoder layer
def _lm_args(**options: Any) -> argparse.Namespace:
    """``transformer_lm_pid``'s options as fairseq-train gives them (its parser's defaults, the architecture's), for the
    probes' small model with ``options``."""
    parser = argparse.ArgumentParser()
    gen_parser_from_dataclass(parser, PIDTransformerLanguageModelConfig())
    args = parser.parse_args([])
    for key, value in {**PROBE_LM, **options}.items():
        setattr(args, key, value)
    normalize_before = options.get("decoder_normalize_before", True)
    base_lm_architecture(args)
    args.decoder_normalize_before = normalize_before  # the architecture sets it; fairseq's decoder takes either
    return args


@behaviour_probe
def _layer_probe() -> bool:
    """fairseq's TransformerDecoderLayerBase and the method's layer (its weights) compute the same, to float32
    rounding, in each variant: a full-sequence forward (causal mask, key padding) and an incremental decode."""
    method, config = _choice()
    for options in PROBE_LMS:
        cfg = TransformerConfig.from_namespace(_lm_args(**options))
        stock = perturbed(TransformerDecoderLayerBase(cfg, no_encoder_attn=True))
        layer = PIDTransformerDecoderLayer(cfg, no_encoder_attn=True, method=method, config=config)
        layer.load_state_dict(stock.state_dict())
        layer.eval()
        if not isinstance(layer.self_attn, PIDMultiheadAttention):
            return False
        T, B = 5, 2
        x = torch.randn(T, B, E)
        with torch.no_grad():
            want = stock(x, self_attn_mask=_causal(T), self_attn_padding_mask=_right_padding(B, T))[0]
            got = layer(x, self_attn_mask=_causal(T), self_attn_padding_mask=_right_padding(B, T))[0]
            if not close_to_rounding(got, want):
                return False
            stock_state: Dict[str, Any] = {}
            method_state: Dict[str, Any] = {}
            for t in range(T):
                want = stock(x[t:t + 1], incremental_state=stock_state)[0]
                if not close_to_rounding(layer(x[t:t + 1], incremental_state=method_state)[0], want):
                    return False
    return True


# ------------------------------------------------------------------------------------------------------ decoder
def _task() -> types.SimpleNamespace:
    """What build_model reads of a language-modelling task: its dictionary (24 symbols)."""
    dictionary = Dictionary()
    for i in range(20):
        dictionary.add_symbol(f"w{i}")
    return types.SimpleNamespace(source_dictionary=dictionary, target_dictionary=dictionary)


def _build(model_type: type, args: argparse.Namespace, task: Any, seed: int = 0) -> Any:
    torch.manual_seed(seed)
    return model_type.build_model(copy.deepcopy(args), task)


def _decode(model: Any, tokens: Tensor, order: Tensor, reorder_at: int) -> Tensor:
    """The logits of ``tokens`` decoded one position at a time with fairseq's incremental state, the state reordered
    by ``order`` (beam search) after ``reorder_at`` positions and the rows followed: (B, T, vocabulary)."""
    state: Dict[str, Any] = {}
    steps = []
    for t in range(1, tokens.size(1) + 1):
        steps.append(model(tokens[:, :t], incremental_state=state)[0][:, -1])
        if t == reorder_at:
            model.decoder.reorder_incremental_state_scripting(state, order)
            tokens = tokens.index_select(0, order)
            steps = [s.index_select(0, order) for s in steps]
    return torch.stack(steps, 1)


def _outputs(model: Any, padded: Tensor, tokens: Tensor, order: Tensor) -> List[Tensor]:
    """What the decoder probe compares: the logits of ``padded`` (a forward with padding) and of an incremental decode
    of ``tokens`` with a beam reorder after 2 positions."""
    with torch.no_grad():
        return [model(padded)[0], _decode(model, tokens, order, 2)]


@behaviour_probe
def _decoder_probe() -> bool:
    """fairseq's transformer_lm and transformer_lm_pid (its weights) compute the same in each variant, to float32
    rounding: the logits of a forward with padding, and of an incremental decode with a beam reorder. With gain
    warm-up at scale 0 (fairseq's own attention, the method classes' layer and decoder around it) they are equal bit
    for bit."""
    task = _task()
    tokens = torch.randint(4, len(task.source_dictionary), (3, 5))
    padded = tokens.clone()
    padded[0, -2:] = PAD
    order = torch.tensor([2, 0, 0])
    for variant, options in enumerate(PROBE_LMS):
        stock = perturbed(_build(TransformerLanguageModel, _lm_args(**options), task))
        want = _outputs(stock, padded, tokens, order)
        for cfg, exact in ((PLAIN, False), ({"warmup_steps": 10}, True))[:2 if variant == 0 else 1]:
            model = _build(PIDTransformerLanguageModel, _lm_args(**options, attention_cfg=json.dumps(cfg)), task)
            # torch's load, not fairseq's (whose upgrade would log that the warm-up counter is not in stock's weights)
            loaded = torch.nn.Module.load_state_dict(model, stock.state_dict(), strict=False)
            model.eval()
            if (loaded.unexpected_keys or any(not key.startswith("decoder.attention_warmup.")
                                              for key in loaded.missing_keys)
                    or not (isinstance(model.decoder, PIDTransformerDecoder) and model.decoder.method_active)):
                return False
            got = _outputs(model, padded, tokens, order)
            if not all(torch.equal(a, b) if exact else close_to_rounding(a, b) for a, b in zip(got, want)):
                return False
    return True


# -------------------------------------------------------------------------------------------------------- build
@behaviour_probe
def _build_probe() -> bool:
    """``TransformerLanguageModel.build_model`` and ``PIDTransformerLanguageModel.build_model`` from one seed build the
    same parameters (names, shapes, values, bit for bit) and buffers (but the method record) in each variant, with
    the method classes in place."""
    task = _task()
    for options in PROBE_BUILDS:
        args = _lm_args(**options)
        stock, model = _build(TransformerLanguageModel, args, task), _build(PIDTransformerLanguageModel, args, task)
        want, got = dict(stock.named_parameters()), dict(model.named_parameters())
        if not (list(got) == list(want) and all(torch.equal(got[k], want[k]) for k in want)):
            return False
        buffers = [name for name, _ in model.named_buffers() if name.rsplit(".", 1)[-1] != RECORD]
        if buffers != [name for name, _ in stock.named_buffers()]:
            return False
        layers = [model.decoder.layers[i] for i in range(len(model.decoder.layers))]
        if not (isinstance(model.decoder, PIDTransformerDecoder) and len(layers) == len(stock.decoder.layers)
                and all(isinstance(layer, PIDTransformerDecoderLayer)
                        and isinstance(layer.self_attn, PIDMultiheadAttention) for layer in layers)):
            return False
    return True


PROBES.update(attention=_attention_probe, incremental=_incremental_probe, layer=_layer_probe,
              decoder=_decoder_probe, build=_build_probe)
