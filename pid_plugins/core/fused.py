"""The PID update as two Triton kernels (forward and backward): what :func:`~pid_plugins.core.control.pid_update`
runs on CUDA with fixed gains. The eager path of ``control.py`` is the reference; this module is imported only on
that path (and by its tests), so ``import pid_plugins`` needs nothing but torch.

Per element of key/value-head space ``(L, H_kv, q, D)`` (``L``: the leading dims merged) one program computes, as
:func:`~pid_plugins.core.control.pid_update` does::

    r   = beta v                              (the group's first layer only: the reference beta v^1)
    e   = r - v
    S   = S_prev + e                          (S = e at the first controlled layer)
    t   = (lP + lD) e + lI S - lD e_prev      ((lP + lI) e at the first controlled layer)
    u_j = A_j v + t   for the r query heads j of the key/value head (grouped-query attention)

in float32 (float16/bfloat16 outputs rounded once; the state in float32 at least), reading every operand through its
strides (heads first or positions first, GQA as the adapters pass it) and writing ``u``, ``S`` and ``e`` once. The
backward kernel forms ``G = sum_j dL/du_j`` and from it the gradients of ``v``, the reference, ``S_prev`` and
``e_prev`` in one pass; ``dL/dA = dL/du`` needs no kernel.

Switch (off by default): ``PID_PLUGINS_FUSED=1`` in the environment (read at import of
:mod:`pid_plugins.core.control`), ``pid_plugins.core.control.FUSED = True`` or ``with control.use_fused(True)`` turns it
on (the device bench measures both).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl
from torch import Tensor

__all__ = ["fused_pid_update"]

_BLOCK = 256


@triton.jit
def _offsets(i, Hk, Q, D, s0, s1, s2, s3):
    d = i % D
    t = (i // D) % Q
    h = (i // (D * Q)) % Hk
    b = i // (D * Q * Hk)
    return b * s0 + h * s1 + t * s2 + d * s3


@triton.jit
def _pid_fwd(a_ptr, o_ptr, v_ptr, ref_ptr, sp_ptr, ep_ptr, refo_ptr, s_ptr, e_ptr,
             n, Hk, Q, D, R,
             as0, as1, asr, as2, as3, os0, os1, osr, os2, os3, vs0, vs1, vs2, vs3,
             rs0, rs1, rs2, rs3, ps0, ps1, ps2, ps3, qs0, qs1, qs2, qs3,
             beta, c_e, c_s, c_p,
             FIRST: tl.constexpr, HAS_REF: tl.constexpr, HAS_PREV: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    v = tl.load(v_ptr + _offsets(i, Hk, Q, D, vs0, vs1, vs2, vs3), mask=m).to(tl.float32)
    if HAS_REF:
        ref = tl.load(ref_ptr + _offsets(i, Hk, Q, D, rs0, rs1, rs2, rs3), mask=m).to(tl.float32)
    else:  # the group's first layer: the reference beta v^1, written to the new state
        ref = v * beta
        tl.store(refo_ptr + i, ref.to(refo_ptr.dtype.element_ty), mask=m)
    e = ref - v
    if FIRST:
        s = e
        term = c_e * e
    else:
        s = tl.load(sp_ptr + _offsets(i, Hk, Q, D, ps0, ps1, ps2, ps3), mask=m).to(tl.float32) + e
        term = c_e * e + c_s * s
        if HAS_PREV:
            term += c_p * tl.load(ep_ptr + _offsets(i, Hk, Q, D, qs0, qs1, qs2, qs3), mask=m).to(tl.float32)
        tl.store(s_ptr + i, s.to(s_ptr.dtype.element_ty), mask=m)
    tl.store(e_ptr + i, e.to(e_ptr.dtype.element_ty), mask=m)
    a_off = _offsets(i, Hk, Q, D, as0, as1, as2, as3)
    o_off = _offsets(i, Hk, Q, D, os0, os1, os2, os3)
    for j in range(R):
        a = tl.load(a_ptr + a_off + j * asr, mask=m).to(tl.float32)
        tl.store(o_ptr + o_off + j * osr, (a + term).to(o_ptr.dtype.element_ty), mask=m)


@triton.jit
def _pid_bwd(go_ptr, gs_ptr, ge_ptr, gr_ptr, dv_ptr, dref_ptr, dsp_ptr, dep_ptr,
             n, Hk, Q, D, R, gs0, gs1, gsr, gs2, gs3,
             beta, c_e, c_s, c_p,
             FIRST: tl.constexpr, HAS_REF: tl.constexpr, HAS_PREV: tl.constexpr,
             HAS_GS: tl.constexpr, HAS_GR: tl.constexpr, BLOCK: tl.constexpr):
    # the state outputs' gradients (ge_ptr, gs_ptr, gr_ptr) and the inputs' are contiguous (L, H_kv, q, D)
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    g_off = _offsets(i, Hk, Q, D, gs0, gs1, gs2, gs3)
    g = tl.load(go_ptr + g_off, mask=m).to(tl.float32)
    for j in range(1, R):  # G = the sum of dL/du over the query heads of the key/value head
        g += tl.load(go_ptr + g_off + j * gsr, mask=m).to(tl.float32)
    de = c_e * g + tl.load(ge_ptr + i, mask=m).to(tl.float32)
    if not FIRST:  # S = S_prev + e, used in u (c_s) and handed on
        ds = c_s * g
        if HAS_GS:
            ds += tl.load(gs_ptr + i, mask=m).to(tl.float32)
        de += ds
        tl.store(dsp_ptr + i, ds.to(dsp_ptr.dtype.element_ty), mask=m)
        if HAS_PREV:
            tl.store(dep_ptr + i, (c_p * g).to(dep_ptr.dtype.element_ty), mask=m)
    if HAS_REF:  # e = ref - v with the reference an input
        tl.store(dref_ptr + i, de.to(dref_ptr.dtype.element_ty), mask=m)
        dv = -de
    else:  # ref = beta v, formed here
        dref = de
        if HAS_GR:
            dref += tl.load(gr_ptr + i, mask=m).to(tl.float32)
        dv = beta * dref - de
    tl.store(dv_ptr + i, dv.to(dv_ptr.dtype.element_ty), mask=m)


class _FusedPID(torch.autograd.Function):
    """Outputs ``(u, e[, S][, ref])``: ``S`` except at the first controlled layer (where ``S`` is ``e``), ``ref``
    (``beta v``) at the group's first layer only (later, the reference is the input handed on)."""

    @staticmethod
    def forward(ctx, attn5: Tensor, value4: Tensor, ref: Optional[Tensor], s_prev: Optional[Tensor],
                e_prev: Optional[Tensor], gains: Tuple[float, float, float, float], wide: torch.dtype):
        lambda_p, lambda_i, lambda_d, beta = gains
        _, Hk, R, Q, D = attn5.shape
        first = s_prev is None
        c_e, c_s, c_p = (lambda_p + lambda_i, 0.0, 0.0) if first else (lambda_p + lambda_d, lambda_i, -lambda_d)
        out = torch.empty_like(attn5)  # (dense layouts kept: heads first or positions first)
        e = torch.empty(value4.shape, dtype=wide, device=value4.device)
        s = e if first else torch.empty_like(e)
        ref_out = torch.empty_like(e) if ref is None else e
        n = value4.numel()
        zeros4 = (0, 0, 0, 0)
        _pid_fwd[(triton.cdiv(n, _BLOCK),)](
            attn5, out, value4, e if ref is None else ref, e if first else s_prev, e if e_prev is None else e_prev,
            ref_out, s, e, n, Hk, Q, D, R,
            *attn5.stride(), *out.stride(), *value4.stride(),
            *(zeros4 if ref is None else ref.stride()), *(zeros4 if first else s_prev.stride()),
            *(zeros4 if e_prev is None else e_prev.stride()),
            float(beta), float(c_e), float(c_s), float(c_p),
            FIRST=first, HAS_REF=ref is not None, HAS_PREV=e_prev is not None, BLOCK=_BLOCK)
        ctx.meta = (first, ref is not None, e_prev is not None, float(beta), c_e, c_s, c_p, value4.dtype)
        ctx.kv_shape, ctx.wide, ctx.attn_shape, ctx.attn_dtype = value4.shape, wide, attn5.shape, attn5.dtype
        outs = (out, e) + (() if first else (s,)) + ((ref_out,) if ref is None else ())
        return outs

    @staticmethod
    def backward(ctx, g_out, g_e, *rest):
        first, has_ref, has_prev, beta, c_e, c_s, c_p, v_dtype = ctx.meta
        rest = list(rest)
        g_s = None if first else rest.pop(0)
        g_ref = None if has_ref else rest.pop(0)
        like = g_e if g_e is not None else (g_s if g_s is not None else g_ref)
        if g_out is None and like is None:
            return (None,) * 7
        ref_shape = ctx.kv_shape
        wide = ctx.wide
        if g_out is None:
            g_out = torch.zeros(ctx.attn_shape, dtype=ctx.attn_dtype, device=like.device)
        g_e = torch.zeros(ref_shape, dtype=wide, device=g_out.device) if g_e is None else g_e.contiguous()
        g_s = None if g_s is None else g_s.contiguous()
        g_ref = None if g_ref is None else g_ref.contiguous()
        dv = torch.empty(ref_shape, dtype=v_dtype, device=g_out.device)
        dref = torch.empty(ref_shape, dtype=wide, device=g_out.device) if has_ref else None
        dsp = None if first else torch.empty(ref_shape, dtype=wide, device=g_out.device)
        dep = torch.empty(ref_shape, dtype=wide, device=g_out.device) if has_prev else None
        _, Hk, R, Q, D = g_out.shape
        n = dv.numel()
        _pid_bwd[(triton.cdiv(n, _BLOCK),)](
            g_out, g_e if g_s is None else g_s, g_e, g_e if g_ref is None else g_ref, dv,
            dv if dref is None else dref, dv if dsp is None else dsp, dv if dep is None else dep,
            n, Hk, Q, D, R, *g_out.stride(), beta, c_e, c_s, c_p,
            FIRST=first, HAS_REF=has_ref, HAS_PREV=has_prev, HAS_GS=g_s is not None, HAS_GR=g_ref is not None,
            BLOCK=_BLOCK)
        return g_out, dv, dref, dsp, dep, None, None


def _to5(attn_out: Tensor, value: Tensor, head_dim: int) -> Tuple[Tensor, Tensor]:
    """``attn_out`` as ``(L, H_kv, r, q, D)`` and ``value`` as ``(L, H_kv, q, D)`` views (heads moved next to the
    positions, the leading dims merged: a copy only where they cannot be merged)."""
    a = attn_out.movedim(head_dim, -3)
    v = value.movedim(head_dim, -3)
    heads, kv_heads = a.shape[-3], v.shape[-3]
    a = a.reshape(-1, heads, *a.shape[-2:]) if a.dim() != 4 else a
    v = v.reshape(-1, kv_heads, *v.shape[-2:]) if v.dim() != 4 else v
    return a.unflatten(1, (kv_heads, heads // kv_heads)), v


def fused_pid_update(attn_out: Tensor, value: Tensor, state, gains: Tuple[float, float, float, float],
                     head_dim: int, wide: torch.dtype):
    """The update of :func:`~pid_plugins.core.control.pid_update` with fixed (float) gains and
    ``control_first_layer`` applied by the caller, by the kernels above: ``(u, (ref, S, e))``.
    ``state``: None at the group's first layer, else ``(ref, S_prev or None, e_prev or None)``."""
    attn5, value4 = _to5(attn_out, value, head_dim)
    ref = None if state is None else state[0]
    s_prev = None if state is None else state[1]
    e_prev = None if state is None else state[2]
    ref4, s4, e4 = (None if t is None else t.movedim(head_dim, -3).reshape(value4.shape) for t in (ref, s_prev, e_prev))
    outs = _FusedPID.apply(attn5, value4, ref4, s4, e4, tuple(float(g) for g in gains), wide)
    out5, e = outs[0], outs[1]
    rest = list(outs[2:])
    s = e if s_prev is None else rest.pop(0)
    r = ref if ref is not None else rest.pop(0)
    kv_shape = value.movedim(head_dim, -3).shape

    def back(t: Tensor) -> Tensor:  # (L, H_kv, q, D) -> the values' own shape and head dimension
        return t.reshape(kv_shape).movedim(-3, head_dim)

    u = out5.flatten(1, 2).reshape(attn_out.movedim(head_dim, -3).shape).movedim(-3, head_dim)
    return u, (r if ref is not None else back(r), back(s), back(e))
