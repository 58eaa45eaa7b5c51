"""The reference PID layer for models of your own (timm's ``Attention`` parameter names), and
:func:`sdpa_with_pid` for attention code of your own (``research/`` uses them; the adapters do not)."""
from __future__ import annotations

from typing import Optional

import torch.nn.functional as F
from torch import Tensor, nn

from .pid import PIDConfig, PIDGains, PIDState, layer_gains, pid_update

__all__ = ["PIDSelfAttention", "sdpa_with_pid"]


def sdpa_with_pid(q: Tensor, k: Tensor, v: Tensor, state: Optional[PIDState], gains, *,
                  attn_mask: Optional[Tensor] = None, dropout_p: float = 0.0, is_causal: bool = False,
                  scale: Optional[float] = None) -> tuple[Tensor, PIDState]:
    """SDPA followed by :func:`pid_update`; q/k/v are ``(B, H, N, D)`` (k/v may have fewer heads). With a KV
    cache the PID term uses the last ``q.shape[-2]`` value rows."""
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                                         scale=scale, **({"enable_gqa": True} if k.shape[-3] != q.shape[-3] else {}))
    q_len = q.shape[-2]
    v_q = v if v.shape[-2] == q_len else v[..., -q_len:, :]
    return pid_update(out, v_q, state, gains)


class PIDSelfAttention(nn.Module):
    """Multi-head self-attention, softmax (``pid=None``) or PID: ``forward(x, state) -> (y, new_state)``, the state
    None at the group's first layer."""

    def __init__(self, dim: int, num_heads: int = 8, qkv_bias: bool = False, qk_norm: bool = False,
                 proj_bias: bool = True, attn_drop: float = 0.0, proj_drop: float = 0.0,
                 norm_layer: type[nn.Module] = nn.LayerNorm, pid: Optional[PIDConfig] = None) -> None:
        super().__init__()
        if dim % num_heads != 0:
            raise ValueError(f"dim ({dim}) must be divisible by num_heads ({num_heads})")
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.scale = self.head_dim ** -0.5
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.q_norm = norm_layer(self.head_dim) if qk_norm else nn.Identity()
        self.k_norm = norm_layer(self.head_dim) if qk_norm else nn.Identity()
        self.attn_drop = nn.Dropout(attn_drop)
        self.proj = nn.Linear(dim, dim, bias=proj_bias)
        self.proj_drop = nn.Dropout(proj_drop)
        self.attention_config = pid
        self.attention_params = PIDGains(pid) if pid is not None and pid.learnable else None

    def forward(self, x: Tensor, state: Optional[PIDState] = None, attn_mask: Optional[Tensor] = None,
                is_causal: bool = False) -> tuple[Tensor, Optional[PIDState]]:
        B, N, C = x.shape
        q, k, v = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        q, k = self.q_norm(q), self.k_norm(k)
        kwargs = dict(attn_mask=attn_mask, dropout_p=self.attn_drop.p if self.training else 0.0, is_causal=is_causal,
                      scale=self.scale)
        if self.attention_config is None:
            out = F.scaled_dot_product_attention(q, k, v, **kwargs)
        else:
            out, state = sdpa_with_pid(q, k, v, state, layer_gains(self.attention_config, self.attention_params),
                                       **kwargs)
        return self.proj_drop(self.proj(out.transpose(1, 2).reshape(B, N, C))), state

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}, pid={self.attention_config}"
