"""What every method's update shares about attention heads: expanding key/value heads, moving the head
dimension, the grouped view, the state's dtype, and whether sizes are traced."""
from __future__ import annotations

import functools

import torch
from torch import Tensor

__all__ = ["expand_heads", "move_heads", "symbolic"]


def symbolic(*tensors: Tensor) -> bool:
    """Whether sizes are traced values (TorchScript tracing or torch.fx proxies): no branch, no shape checks."""
    return torch.jit.is_tracing() or any(isinstance(t, torch.fx.Proxy) for t in tensors)


def move_heads(x: Tensor, source: int, destination: int) -> Tensor:
    """``x.movedim(source, destination)``, or ``x`` itself where that moves nothing (no op, no autograd node)."""
    if isinstance(x, torch.fx.Proxy):
        return x.movedim(source, destination)
    dims = x.dim()
    return x if source % dims == destination % dims else x.movedim(source, destination)


def expand_heads(x: Tensor, num_heads: int, head_dim: int = -3) -> Tensor:
    """Expand key/value heads to query heads as grouped-query attention expands the values
    (``repeat_interleave``: head ``j`` serves query heads ``j*r .. j*r + r - 1``)."""
    kv_heads = x.shape[head_dim]
    if torch.jit.is_tracing():  # sizes are traced values: no Python branch on them (exact for r = 1 too)
        dim = head_dim % x.dim()
        return x.unsqueeze(dim + 1).expand(*x.shape[:dim + 1], num_heads // kv_heads, *x.shape[dim + 1:]).flatten(
            dim, dim + 1)
    if symbolic(x):  # torch.fx: sizes are proxies (no branch, no unpacking); a copy for r = 1, exact
        return x.repeat_interleave(num_heads // kv_heads, dim=head_dim)
    if kv_heads == num_heads:
        return x
    if kv_heads <= 0 or num_heads % kv_heads != 0:
        raise ValueError(f"cannot expand {kv_heads} key/value heads to {num_heads} query heads: the number of query "
                         "heads must be a multiple of the number of key/value heads")
    return x.repeat_interleave(num_heads // kv_heads, dim=head_dim)


def _state_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the error and its running sum: float32 at least (a table, not ``torch.promote_types``)."""
    wide = _WIDER.get(dtype)
    return wide if wide is not None else torch.promote_types(dtype, torch.float32)


_WIDER = {torch.float16: torch.float32, torch.bfloat16: torch.float32, torch.float32: torch.float32,
          torch.float64: torch.float64}


@functools.lru_cache(maxsize=256)  # a function of the shapes only: once per shape, not once per layer
def _grouped_shapes(shape: torch.Size, value_shape: torch.Size,
                    head_dim: int) -> tuple[tuple[int, ...], int, tuple[int, ...]]:
    """The output's shape with its head dimension split into ``(H_kv, r)``, the broadcast dimension, and a
    key/value-head tensor's shape there; raises when the values do not divide the output's heads."""
    if -len(shape) <= head_dim < len(shape) and len(shape) == len(value_shape):
        dim = head_dim % len(shape)
        heads, kv_heads = shape[dim], value_shape[dim]
        if kv_heads <= 0 or heads % kv_heads:
            expand_heads(torch.empty(value_shape, device="meta"), heads, dim)  # raises the explanatory error
        if shape[:dim] + (kv_heads,) + shape[dim + 1:] == value_shape:
            return ((*shape[:dim], kv_heads, heads // kv_heads, *shape[dim + 1:]), dim + 1,
                    (*value_shape[:dim + 1], 1, *value_shape[dim + 1:]))
    if len(shape) != len(value_shape):
        raise ValueError(f"attention output {tuple(shape)} and values {tuple(value_shape)} must have the same "
                         "number of dimensions (..., heads, positions, head_dim)")
    raise ValueError(f"attention output {tuple(shape)} does not match values {tuple(value_shape)} (after expanding "
                     "key/value heads): pass the values of the query positions only")
