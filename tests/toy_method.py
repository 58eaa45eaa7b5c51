"""The toy method the contract registers as a user would: ``scaled_reference``, ``u^l = A^l v^l + gamma * v^1`` (state
``v^1``), known to pid_plugins only through :func:`pid_plugins.register_method`; :func:`naive_scaled_reference` is its
independent float64 statement."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
from torch import Tensor

import pid_plugins
from pid_plugins import AttentionMethod, MethodConfig
from pid_plugins.core import expand_heads

NAME = "scaled_reference"


@dataclass(frozen=True)
class ScaledReferenceConfig(MethodConfig):
    """``gamma``: the weight of the reference ``v^1`` (0: the stock attention)."""

    gamma: float = 0.5
    PRESETS = {"default": {"gamma": 0.5}, "strong": {"gamma": 2.0}}
    ZERO = {"gamma": 0.0}

    def validate(self) -> None:
        if not math.isfinite(self.gamma):
            raise ValueError(f"ScaledReferenceConfig.gamma must be finite, got {self.gamma!r}")


class ScaledReference(AttentionMethod):
    name = NAME
    config_type = ScaledReferenceConfig
    state_fields = ("v_first",)
    default_presets = {"*": "default"}

    def update(self, params: ScaledReferenceConfig, out: Tensor, value_q: Tensor, state: Optional[tuple],
               scale: Optional[Tensor], head_dim: int) -> Tuple[Tensor, tuple]:
        v_first = value_q if state is None else state[0]
        gamma = params.gamma if scale is None else params.gamma * scale
        reference = expand_heads(v_first, out.shape[head_dim], head_dim).to(out.dtype)
        return out + gamma * reference, (v_first,)


METHOD = pid_plugins.register_method(ScaledReference(), replace=True)


def naive_scaled_reference(attn_outs, values, gamma):
    """attn_outs[l]: (B, H, N, D); values[l]: (B, Hkv, N, D), per layer; float64 outputs, position by position."""
    B, H, N, D = attn_outs[0].shape
    group = H // values[0].shape[1]
    outs = []
    for a in attn_outs:
        u = torch.zeros(B, H, N, D, dtype=torch.float64)
        for b in range(B):
            for h in range(H):
                for i in range(N):
                    u[b, h, i] = a[b, h, i].double() + gamma * values[0][b, h // group, i].double()
        outs.append(u)
    return outs


def toy_rule(gamma):
    """The per-layer rule of the zoo references (tests/zoo_cases.py): this layer's ``A v`` plus ``gamma v^1``, from
    :func:`naive_scaled_reference`."""
    from zoo_cases import on_outputs

    return on_outputs(lambda attn_outs, values: naive_scaled_reference(attn_outs, values, gamma)[-1])


def register_non_additive_method(monkeypatch, method_name: str) -> AttentionMethod:
    """A method that calls the attention twice (``2 A v``: no separate additive term) and takes ``warmup_steps``,
    registered under ``method_name`` for one test only (``monkeypatch``): the subject of the refusal of warm-up where a zoo
    warms up as its stock attention plus the method's term."""
    from pid_plugins.core import methods

    @dataclass(frozen=True)
    class DoubledConfig(MethodConfig):
        warmup_steps: int = 0
        PRESETS = {"default": {"warmup_steps": 0}}

    class Doubled(AttentionMethod):
        name = method_name
        config_type = DoubledConfig
        state_fields = ()
        default_presets = {"*": "default"}
        additive = False

        def attend(self, params, attend, query, value, state=None, head_dim=-3):
            return 2 * attend(query, value)

        def update(self, params, out, value_q, state, scale, head_dim):
            return out, ()

    method = Doubled()
    monkeypatch.setitem(methods._METHODS, method_name, method)
    return method
