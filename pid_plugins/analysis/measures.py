"""Per-layer measures of representation collapse on token matrices ``(..., N, D)``: one value per leading index."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

__all__ = ["mean_pairwise_cosine", "numerical_rank", "effective_rank", "consensus_distance", "attention_sparsity"]


def _at_least_float32(x: Tensor) -> Tensor:
    return x.to(torch.promote_types(x.dtype, torch.float32))


def mean_pairwise_cosine(tokens: Tensor, eps: float = 1e-12) -> Tensor:
    """Mean cosine similarity over all pairs i != j of the N tokens (PIDformer, Appendix A.6)."""
    n = tokens.shape[-2]
    if n < 2:
        raise ValueError("mean_pairwise_cosine needs at least two tokens")
    x = _at_least_float32(tokens)
    x = x / x.norm(dim=-1, keepdim=True).clamp_min(eps)
    sim = x @ x.transpose(-1, -2)
    off_diag = sim.sum(dim=(-1, -2)) - sim.diagonal(dim1=-2, dim2=-1).sum(-1)
    return off_diag / (n * (n - 1))


def numerical_rank(tokens: Tensor, rtol: float = 1e-3) -> Tensor:
    """Number of singular values above ``rtol`` times the largest (a numerically robust rank)."""
    s = torch.linalg.svdvals(tokens.double())
    return (s > rtol * s[..., :1]).sum(-1)


def effective_rank(tokens: Tensor) -> Tensor:
    """exp(entropy) of the normalised singular values (Roy & Vetterli, 2007): 1 for rank 1, N for N orthogonal."""
    s = torch.linalg.svdvals(tokens.double())
    p = s / s.sum(-1, keepdim=True).clamp_min(1e-300)
    entropy = -(p * p.clamp_min(1e-300).log()).sum(-1)
    return entropy.exp()


def consensus_distance(tokens: Tensor, eps: float = 1e-12) -> Tensor:
    """E = 1 - (1/N) sum_i |y_1 . y_i| / (|y_1| |y_i|) (Rodriguez Abella et al., eq. 25): 0 when aligned."""
    x = _at_least_float32(tokens)
    x = x / x.norm(dim=-1, keepdim=True).clamp_min(eps)
    cos_first = (x[..., :1, :] * x).sum(-1).abs()
    return 1.0 - cos_first.mean(-1)


def attention_sparsity(attn: Tensor, allowed: Optional[Tensor] = None) -> Tensor:
    """S(a) = E|a| / sqrt(E a^2) per attention row (last dim), over its ``allowed`` entries (None: all); smaller means
    more concentrated, 1 for uniform attention."""
    a = _at_least_float32(attn).abs()
    if allowed is None:
        return a.mean(-1) / a.pow(2).mean(-1).sqrt().clamp_min(1e-30)
    allowed = allowed.expand_as(a)
    a, n = a * allowed, allowed.sum(-1).to(a.dtype)
    return (a.sum(-1) / n) / (a.pow(2).sum(-1) / n).sqrt().clamp_min(1e-30)
