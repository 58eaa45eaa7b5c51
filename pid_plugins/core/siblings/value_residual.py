"""Value residual learning (ResFormer: Zhou et al., "Value Residual Learning", ACL 2025) as the attention
method ``value_residual``.

For the layers ``l = 1 .. L`` of one group, with ``v^l`` the layer's values per key/value head::

    u^1 = softmax(q^1 k^1^T * scale + mask) v^1                                 (the first layer records v^1)
    u^l = softmax(q^l k^l^T * scale + mask) (lambda_1 * v^1 + lambda_2 * v^l)    (l >= 2)

The mix is formed per key/value head, over every cached position with a KV cache; ``(0, 1)`` is the stock attention.
Sources: docs/methods/siblings.md."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Tuple

import torch
from torch import Tensor, nn

from ..config import MethodConfig, registry_presets
from ..heads import move_heads
from ..methods import Attend, AttentionMethod, register_method

__all__ = ["ValueResidualConfig", "ValueResidualLambdas", "ValueResidualMethod", "value_residual_mix"]


@dataclass(frozen=True)
class ValueResidualConfig(MethodConfig):
    """Parameters of value residual learning: the weights of ``v^1`` and of the layer's own values; ``learnable``
    gives every layer after the first its own lambdas."""

    lambda_1: float = 0.5
    lambda_2: float = 0.5
    learnable: bool = False

    PRESETS = registry_presets("value_residual")  # registry/presets.toml, each with its source
    ZERO = {"lambda_1": 0.0, "lambda_2": 1.0}

    def validate(self) -> None:
        for name in ("lambda_1", "lambda_2"):
            value = getattr(self, name)
            if not math.isfinite(value):
                raise ValueError(f"ValueResidualConfig.{name} must be a finite number (ResFormer: lambda_1 = lambda_2 "
                                 f"= 0.5; lambda_1 = 0, lambda_2 = 1: the stock attention), got {value!r}")


class ValueResidualLambdas(nn.Module):
    """One layer's trainable ``lambda_1`` and ``lambda_2`` (shape ``(1,)``), from a :class:`ValueResidualConfig`."""

    def __init__(self, config: ValueResidualConfig) -> None:
        super().__init__()
        self.lambda_1 = nn.Parameter(torch.tensor([config.lambda_1]))
        self.lambda_2 = nn.Parameter(torch.tensor([config.lambda_2]))

    def forward(self) -> Tuple[Tensor, Tensor]:
        return self.lambda_1, self.lambda_2


def value_residual_mix(value: Tensor, v_first: Tensor, lambda_1: Any, lambda_2: Any) -> Tensor:
    """``lambda_1 * v^1 + lambda_2 * v`` per key/value head, ``(B, H_kv, K, D)``; of a longer ``v_first`` (a
    sliding-window layer) the last ``K`` rows are used."""
    length = value.shape[-2]
    if not torch.jit.is_tracing() and v_first.shape[-2] != length:  # (traced: no cache, the same positions)
        if v_first.shape[-2] < length or v_first.shape[:-2] != value.shape[:-2]:
            raise ValueError(f"attention method 'value_residual': this layer's values have shape "
                             f"{tuple(value.shape)} but the group's first layer had {tuple(v_first.shape)}: every "
                             "layer must have the first layer's key/value heads and head_dim, and the first layer "
                             "must see every key position a later layer sees (a sliding-window first layer under "
                             "full-attention layers, with a cache, cannot run it)")
        v_first = v_first.narrow(-2, v_first.shape[-2] - length, length)
    if not torch.jit.is_tracing() and v_first.shape != value.shape:
        raise ValueError(f"attention method 'value_residual': this layer's values have shape {tuple(value.shape)} but "
                         f"the group's first layer had {tuple(v_first.shape)}: every layer of a group must have values "
                         "of one shape")
    if isinstance(lambda_1, Tensor) or isinstance(lambda_2, Tensor):
        return v_first * lambda_1.to(value.dtype) + value * lambda_2.to(value.dtype)
    return v_first * lambda_1 + value * lambda_2


# a leaf for every torch.fx tracer: the shape checks above are Python control flow a symbolic trace cannot follow
torch.fx.wrap("value_residual_mix")


class ValueResidualMethod(AttentionMethod):
    """ResFormer: every layer after the group's first attends over ``lambda_1 v^1 + lambda_2 v^l``."""

    name = "value_residual"
    config_type = ValueResidualConfig
    state_fields = ("v_first",)
    default_presets = {"*": "resformer"}
    additive = False
    keys_state = True
    mixes_values = True
    per_head_state = True  # v^1: (B, H_kv, K, D); lambda_1, lambda_2 are shared by every head

    def is_identity(self, config: ValueResidualConfig) -> bool:
        return config.is_zero and not config.learnable

    def make_learned(self, config: ValueResidualConfig) -> Optional[nn.Module]:
        return ValueResidualLambdas(config) if config.learnable else None

    def layer_params(self, config: ValueResidualConfig, learned: Optional[nn.Module],
                     layer: Optional[int] = None) -> Any:
        """``(lambda_1, lambda_2)``: the config's numbers, or the layer's trained ones."""
        if learned is None:
            return (config.lambda_1, config.lambda_2)
        return learned()

    def attend(self, params: Any, attend: Attend, query: Tensor, value: Tensor, state: Optional[tuple] = None,
               head_dim: int = -3) -> Tensor:
        lambda_1, lambda_2 = params
        if state is None:  # the group's first layer: its own values (trained lambdas join the graph with weight 0)
            out = attend(query, value)
            if isinstance(lambda_1, Tensor):
                out = out + 0.0 * (lambda_1 + lambda_2).to(out.dtype)
            return out
        return attend(query, value_residual_mix(value, state[0], lambda_1, lambda_2))

    def update(self, params: Any, out: Tensor, value_q: Tensor, state: Optional[tuple], scale: Optional[Tensor],
               head_dim: int) -> Tuple[Tensor, tuple]:
        """The output unchanged; the state: the first layer's values at every key position."""
        if state is None:
            return out, (move_heads(value_q, head_dim, -3),)
        return out, (state[0],)


register_method(ValueResidualMethod())
