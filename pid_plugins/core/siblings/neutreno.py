"""NeuTRENO attention (Nguyen, Nguyen and Baraniuk, "Mitigating Over-smoothing in Transformers via Regularized
Nonlocal Functionals", NeurIPS 2023: Advances in NeurIPS 36, which the code's readme cites as 2024), as a registered
attention method ``"neutreno"``.

For the layers ``l = 1 .. L`` of one group (a stack of self-attention layers in one forward pass, as for PID), with
``A^l`` the layer's (dropped-out) attention matrix and ``v^l`` its values, per head and query position::

    u^1 = A^1 v^1                              (the first layer only records v^1)
    u^l = A^l v^l + alpha * (v^1 - v^l)        (l >= 2)

It is PID with ``(lambda_p, lambda_i, lambda_d, beta) = (alpha, 0, 0, 1)`` under either first-layer convention (and
computes the same float operations: equal bit for bit in float32/float64), but threads only ``v^1`` from layer to
layer (PID also threads its running error and last error).

As the official code computes it (github.com/tamnguyen9520/NeuTRENO_NeurIPS2024, read at its public snapshot):

* ``DeiT/neutreno.py`` (``Attention.forward``): the term ``alpha * (v0 - v)`` is added to ``attn @ v`` after the
  attention dropout, for every layer but the first (``layerth > 0``); the first block returns its values as ``v0``;
  ``alpha = 0.6`` is fixed in ``Attention.__init__``.
* ``segmenter/segm/model/blocks_neutreno.py`` (``Attention.forward``), ``vit_neutreno.py`` and
  ``decoder_neutreno.py``: the same rule in the ViT encoder and in the mask-transformer decoder, each stack with its
  own first layer (the decoder's ``v0`` is its own first block's values); ``alpha`` comes from ``--alpha``, 0.6 in
  ``segmenter/run.sh``.
* ``wikitext103/src/mem_transformer.py`` (``NeuTRENOMultiHeadAttn``, ``--attn_type 222`` in ``src/script.sh``): the
  softmax language model adds ``0.4 * (head_v0 - head_v)`` to the attention output, causal mask and no memory
  (``--mem_len 0``): every term is per position, so a causal model stays causal and a KV cache needs only the
  values of the positions being computed (no refusal is needed: every zoo context is exact).

Grouped-query attention: the term is formed in key/value-head space and expanded to the query heads as the values
are (``repeat_interleave``). In float16/bfloat16 the term is computed in float32 and the output rounded once (as
PID's update does); the official code adds it in the model's dtype.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any, Optional, Tuple

import torch
from torch import Tensor

from ..config import MethodConfig, registry_presets
from ..heads import _kv_head_split, expand_heads
from ..methods import AttentionMethod, register_method

__all__ = ["NeuTRENOConfig", "NeuTRENOMethod", "neutreno_update"]

_LOW_PRECISION = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class NeuTRENOConfig(MethodConfig):
    """Parameters of NeuTRENO attention.

    Args:
        alpha: weight of the fidelity term ``v^1 - v^l``, >= 0 (0: the stock attention).
        warmup_steps: warm-up for fine-tuning a pretrained model into NeuTRENO (0, the default: off); with
            ``N > 0`` alpha is scaled by ``min(1, t / N)`` over the model's training forwards, as PID's gains are
            (see :mod:`pid_plugins.core.warmup`).
    """

    alpha: float = 0.6
    warmup_steps: int = 0

    PRESETS = registry_presets("neutreno")  # registry/presets.toml, each with its source
    ZERO = {"alpha": 0.0}

    def validate(self) -> None:
        if not math.isfinite(self.alpha) or self.alpha < 0.0:
            raise ValueError(
                f"NeuTRENOConfig.alpha must be a finite number >= 0 (0: the stock attention; the official code "
                f"uses 0.6 for DeiT and Segmenter, 0.4 for the WikiText-103 language model), got {self.alpha!r}"
            )
        steps = self.warmup_steps
        if isinstance(steps, bool) or not isinstance(steps, numbers.Integral) or steps < 0:
            raise ValueError(
                "NeuTRENOConfig.warmup_steps must be a whole number of training forward passes >= 0 "
                f"(0: no warm-up), got {steps!r}"
            )


def neutreno_update(attn_out: Tensor, value: Tensor, v_first: Optional[Tensor], alpha: Any,
                    head_dim: int = -3, scale: Optional[Tensor] = None) -> Tensor:
    """One layer's output: ``attn_out`` at the group's first layer (``v_first`` None), else
    ``attn_out + alpha * (v_first - value)``, the term in key/value-head space expanded to ``attn_out``'s heads.

    ``alpha``: a float or a 0-dim tensor. ``scale``: the warm-up's factor (0-dim tensor) or None; it multiplies the
    difference, so at 1 the result is bit for bit the one without it. ``value`` and ``v_first``: the values of the
    query positions.
    """
    if v_first is None:
        return attn_out
    if not torch.jit.is_tracing() and v_first.shape != value.shape:
        raise ValueError(
            f"NeuTRENO layer values have shape {tuple(value.shape)} but the group's first layer had "
            f"{tuple(v_first.shape)}: every layer of a group must have values of one shape (same heads, head_dim "
            "and positions); use softmax attention for the odd layers"
        )
    # (v^1 - v) in key/value-head space, broadcast over each group of r query heads of a view of the attention
    # output (as expand_heads would repeat it, without the copy); float16/bfloat16: in float32, rounded once
    traced = torch.jit.is_tracing()
    grouped = None if traced or attn_out.shape == value.shape else _kv_head_split(attn_out, value, head_dim)
    wide = attn_out.dtype in _LOW_PRECISION
    diff = (v_first.float() if wide else v_first) - value  # (type promotion: value is upcast exactly)
    target = attn_out
    if traced:
        diff = expand_heads(diff, attn_out.shape[head_dim], head_dim)
    elif grouped is not None:
        target, diff = attn_out.reshape(grouped[0]), diff.reshape(grouped[2])  # (a size-1 dimension: a view)
    if scale is not None:
        diff = diff * scale.to(diff.dtype)
    out = target + diff * alpha.to(diff.dtype) if isinstance(alpha, Tensor) else torch.add(target, diff, alpha=alpha)
    if wide:
        out = out.to(attn_out.dtype)
    return out if grouped is None else out.reshape(attn_out.shape)


class NeuTRENOMethod(AttentionMethod):
    """NeuTRENO: ``A v + alpha (v^1 - v)`` from a group's second layer on (the first records ``v^1``)."""

    name = "neutreno"
    config_type = NeuTRENOConfig
    state_fields = ("v_first",)
    default_presets = {"timm": "deit", "mmseg": "segmenter", "hf": "lm", "fairseq": "lm", "*": "deit"}

    def update(self, params: NeuTRENOConfig, out: Tensor, value_q: Tensor, state: Optional[tuple],
               scale: Optional[Tensor], head_dim: int) -> Tuple[Tensor, tuple]:
        if state is None:
            return out, (value_q,)
        return neutreno_update(out, value_q, state[0], params.alpha, head_dim, scale), (state[0],)


register_method(NeuTRENOMethod())
