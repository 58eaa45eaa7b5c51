"""Shared test support: each zoo's tiny builders and float64 references (pid_plugins.testing.zoos, the method author's
kit, re-exported here) and the float64 rules of the built-in methods, written from their official code."""
from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple

import pytest
import torch
from torch import Tensor

from pid_plugins.testing import zoos
from pid_plugins.testing.zoos import *  # noqa: F401,F403  (the builders and references, by their old names here)
from pid_plugins.testing.zoos import Rule, attention64, on_outputs, on_scores


def import_timm():
    pytest.importorskip("timm")
    return zoos.import_timm()


def import_transformers():
    pytest.importorskip("transformers")
    return zoos.import_transformers()

def value_residual_rule(lambdas: Sequence[Tuple[float, float]]) -> Rule:
    """Value residual (ResFormer, the official ``modeling_llama_resformer.py``): layer ``l`` (1-based, ``len(qs)``)
    attends over its own values when it is the group's first, else over ``lambda_1 * v^1 + lambda_2 * v^l`` with
    ``lambdas[l - 1]``, per key/value head (float64)."""
    def rule(qs, ks, vs, mask):
        if len(qs) == 1:
            return attention64(qs[-1], ks[-1], vs[-1], mask)
        l1, l2 = lambdas[len(qs) - 1]
        return attention64(qs[-1], ks[-1], l1 * vs[0].double() + l2 * vs[-1].double(), mask)
    return rule


def elliptical_prefix_rule(delta: float, from_layer: int = 2) -> Rule:
    """Elliptical attention's causal form (``mean="prefix"``), written per position: from layer ``from_layer``
    (1-based) on, query ``i`` is scaled per dimension by the mean over positions ``j <= i`` of
    ``|v^l_j - v^{l-1}_j| / delta``, divided by its max over the dimension (key/value head ``j`` scaling the query
    heads of its group), under the causal mask."""
    def rule(qs, ks, vs, mask):
        q = qs[-1].double()
        if len(qs) >= from_layer:
            d = ((vs[-1].double() - vs[-2].double()) / delta).abs()
            m = torch.empty_like(d)
            for i in range(d.shape[2]):
                mean = d[:, :, : i + 1].mean(2)
                m[:, :, i] = mean / mean.amax(-1, keepdim=True)
            q = q * m.repeat_interleave(q.shape[1] // d.shape[1], 1)
        return attention64(q, ks[-1], vs[-1], mask)
    return rule


def naive_neutreno(attn_out: Tensor, values: Sequence[Tensor], alpha: float) -> Tensor:
    """NeuTRENO's official rule, position by position in float64 (github.com/tamnguyen9520/NeuTRENO_NeurIPS2024):
    ``attn_out`` (B, H, N, D) is this layer's ``A v``, ``values`` the group's values so far ``[v^1, ..., v^l]``
    (B, H_kv, N, D); layers l >= 2 add ``alpha (v^1 - v^l)``; a query head reads key/value head ``h // (H / H_kv)``."""
    B, H, N, D = attn_out.shape
    group = H // values[0].shape[1]
    u = attn_out.double().clone()
    if len(values) == 1:
        return u
    for b in range(B):
        for h in range(H):
            for i in range(N):
                u[b, h, i] += alpha * (values[0][b, h // group, i].double() - values[-1][b, h // group, i].double())
    return u


def neutreno_rule(alpha: float) -> Rule:
    """The zoo references' NeuTRENO rule: this layer's ``A v`` plus the term from :func:`naive_neutreno`."""
    return on_outputs(lambda attn_outs, values: naive_neutreno(attn_outs[-1], values, alpha))


def twice64(scores: Tensor, v: Tensor) -> Tensor:
    """Twicing's official rule from the attention matrix (github.com/lazizcodes/twicing_attention): ``A = softmax(
    scores)`` (masked scores), ``A v + A (v - A v)`` in float64 (grouped-query: values repeated like the keys)."""
    a = torch.softmax(scores.double(), -1)
    v = v.double().repeat_interleave(a.shape[1] // v.shape[1], 1)
    av = a @ v
    return av + a @ (v - av)


def twiced_from(from_layer: int) -> Rule:
    """The zoo references' Twicing rule: stock ``A v`` before ``from_layer`` (0-based), :func:`twice64` from it on."""
    def statement(index, scores, v):
        if index >= from_layer:
            return twice64(scores, v)
        return torch.softmax(scores, -1) @ v.double().repeat_interleave(scores.shape[1] // v.shape[1], 1)
    return on_scores(statement)


def naive_elliptical_scales(v: Tensor, v_prev: Tensor, delta: float) -> Tensor:
    """Elliptical attention's scales (stefvk/Elliptical-Attention, ``MahalaAttention.W_over_layers``), by loops:
    ``m[b, h, d] = (1/N) sum_n |v - v_prev|[b, h, n, d] / delta``, then divided by ``max_d m[b, h, d]`` (float64)."""
    B, H, N, D = v.shape
    m = torch.zeros(B, H, D, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            for d in range(D):
                total = 0.0
                for n in range(N):
                    total += abs(float(v[b, h, n, d]) - float(v_prev[b, h, n, d])) / delta
                m[b, h, d] = total / N
            m[b, h] = m[b, h] / max(float(x) for x in m[b, h])
    return m


def naive_elliptical_attention(q: Tensor, k: Tensor, v: Tensor, m: Optional[Tensor] = None,
                               mask: Optional[Tensor] = None) -> Tensor:
    """``softmax((q diag(m)) k^T / sqrt(D) + mask) v`` in float64; the scaling of key/value head j serves query heads
    j*r .. j*r + r - 1 (grouped-query attention)."""
    q, k, v = q.double(), k.double(), v.double()
    r = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(r, 1), v.repeat_interleave(r, 1)
    if m is not None:
        q = q * m.repeat_interleave(r, 1)[:, :, None, :]
    scores = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    if mask is not None:
        scores = scores + mask
    return torch.softmax(scores, -1) @ v


def naive_elliptical_layer(q: Tensor, k: Tensor, v: Tensor, v_prev: Tensor, layer: int, from_layer: int = 2,
                           delta: float = 5.0) -> Tensor:
    """One layer (1-based index ``layer``) of elliptical attention's bidirectional (``mean="sequence"``) rule."""
    if layer < from_layer:
        return naive_elliptical_attention(q, k, v)
    return naive_elliptical_attention(q, k, v, naive_elliptical_scales(v, v_prev, delta))


def elliptical_rule(from_layer: int = 2, delta: float = 5.0) -> Rule:
    """The zoo references' bidirectional elliptical rule: the first layer plain, then :func:`naive_elliptical_layer`
    with the previous layer's values (layers counted from 1)."""
    def rule(qs, ks, vs, mask):
        if len(vs) == 1:
            return naive_elliptical_attention(qs[-1], ks[-1], vs[-1])
        return naive_elliptical_layer(qs[-1], ks[-1], vs[-1], vs[-2], len(vs), from_layer, delta)
    return rule


def pid_rule(lambda_p: float, lambda_i: float, lambda_d: float, beta: float, control_first_layer: bool = True) -> Rule:
    """The zoo references' PID rule: :func:`reference.naive_pid_stack` (PIDformer eq."""
    from reference import naive_pid_stack

    return on_outputs(lambda attn_outs, values: naive_pid_stack(
        attn_outs, values, lambda_p, lambda_i, lambda_d, beta, control_first_layer)[-1])


#: two prompts of 9 tokens for gqa_llama
GQA_PROMPT = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 3, 4], [9, 8, 7, 6, 5, 4, 3, 12, 13]])


def gqa_llama(name: str):
    """The Llama a new user decodes with: 4 layers, 4 query / 2 key-value heads, vocabulary 128, running ``name``
    (a key of tests/method_cases.py's ``CAUSAL_METHODS``) with its causal parameters; eval mode, the same weights for
    every method."""
    from method_cases import CAUSAL_METHODS  # the method table (it imports this module: not at the top)

    T = import_transformers()
    config = T.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=2, initializer_range=0.1)
    torch.manual_seed(0)
    if CAUSAL_METHODS[name] is not None:
        setattr(config, name, CAUSAL_METHODS[name])  # the method's parameters: config.<method>
    return T.LlamaForCausalLM._from_config(config, attn_implementation=name).eval()


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """A fairseq dictionary of 40 words (w0 .. w39) in a folder: the language-modelling task's data directory."""
    return fs_dictionary(tmp_path_factory.mktemp("dict"))


def assert_direct_path_equals_apply(adapter, run: Callable[[], List[Tensor]], monkeypatch,
                                    direct: str = "update_once", forget: Callable[[], None] = lambda: None) -> None:
    """``run()`` through ``adapter``'s direct path (the module that imported ``calls_once``; the path's function
    ``direct``, asserted called) and again with ``calls_once`` off, through core's ``apply`` (asserted): the tensors
    equal bit for bit. ``forget()``: the adapter forgets the path it chose (before each run)."""
    calls = []
    real = getattr(adapter, direct)
    monkeypatch.setattr(adapter, direct, lambda *a, **k: calls.append(1) or real(*a, **k))
    forget()
    direct = run()
    assert calls  # the direct path ran
    monkeypatch.setattr(adapter, "calls_once", lambda method: False)
    forget()
    calls.clear()
    through_apply = run()
    assert not calls and len(direct) == len(through_apply)
    for a, b in zip(direct, through_apply):
        assert torch.equal(a, b)
