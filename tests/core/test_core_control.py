import pytest
import torch

from pid_plugins import PIDConfig, PIDState, expand_heads, pid_update
from reference import naive_pid_stack


def run_stack(attn_outs, values, gains):
    outs, state = [], None
    for a, v in zip(attn_outs, values):
        u, state = pid_update(a, v, state, gains)
        outs.append(u)
    return outs, state


def random_layers(L, B, H, Hkv, N, D, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    attn = [torch.randn(B, H, N, D, generator=g, dtype=dtype) for _ in range(L)]
    vals = [torch.randn(B, Hkv, N, D, generator=g, dtype=dtype) for _ in range(L)]
    return attn, vals


@pytest.mark.parametrize("preset", ["deit", "segmenter", "lm"])
@pytest.mark.parametrize("H, Hkv", [(4, 4), (4, 2), (6, 1)])
def test_matches_naive_reference(preset, H, Hkv):
    """Fixed float gains (a fused path) and tensor (learnable) gains (the general one), grouped-query heads."""
    cfg = PIDConfig.preset(preset)
    attn, vals = random_layers(L=5, B=2, H=H, Hkv=Hkv, N=7, D=3)
    want = naive_pid_stack(attn, vals, *cfg.gains)
    tensors = tuple(torch.tensor(g, dtype=torch.float64) for g in cfg.gains[:3]) + (cfg.beta,)
    for gains in (cfg, tensors):
        for g, w in zip(run_stack(attn, vals, gains)[0], want):
            torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("gains", [(0.7, 0.4, 0.2, 0.6), (0.7, 0.0, 0.2, 0.6), (0.7, 0.4, 0.0, 0.6), (0.0, 0.5, 0.0, 1.0)])
@pytest.mark.parametrize("N", [1, 2048])  # both sides of the small-tensor threshold of the fixed-gain path
@pytest.mark.parametrize("H, Hkv", [(4, 4), (8, 2)])
def test_fixed_gain_paths_match_the_reference_in_both_layouts(gains, N, H, Hkv):
    """Decoding-sized and training-sized tensors take different fixed-gain code paths; heads first
    ``(B, H, N, D)`` or positions first ``(B, N, H, D)`` with the values a transposed view (as the HF adapter
    passes them): all must equal the rule."""
    attn, vals = random_layers(L=4, B=1, H=H, Hkv=Hkv, N=N, D=16)
    want = naive_pid_stack(attn, vals, *gains) if N == 1 else None
    got, _ = run_stack(attn, vals, gains)
    state, got_t = None, []
    for a, v in zip(attn, vals):
        u, state = pid_update(a.transpose(1, 2).contiguous(), v.transpose(1, 2), state, gains, head_dim=-2)
        assert u.is_contiguous()
        got_t.append(u.transpose(1, 2))
    if want is None:  # the loop reference is slow at N=2048: check against the vectorised rule instead
        lp, li, ld, beta = gains
        e = [beta * vals[0] - v for v in vals]
        want = []
        for layer, a in enumerate(attn):
            term = lp * e[layer] + li * sum(e[: layer + 1]) + (ld * (e[layer] - e[layer - 1]) if layer else 0)
            want.append(a + term.repeat_interleave(H // Hkv, 1))
    for g, gt, w in zip(got, got_t, want):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(gt, w, rtol=1e-12, atol=1e-12)


def test_state_contents_follow_the_definition():
    cfg = PIDConfig(0.3, 0.2, 0.1, 0.6)
    attn, vals = random_layers(L=3, B=1, H=2, Hkv=2, N=4, D=5)
    _, state = run_stack(attn, vals, cfg)
    assert isinstance(state, PIDState)
    errors = [0.6 * vals[0] - v for v in vals]
    torch.testing.assert_close(state.v_first, 0.6 * vals[0])  # the reference beta v^1, formed once
    torch.testing.assert_close(state.e_sum, errors[0] + errors[1] + errors[2])
    torch.testing.assert_close(state.e_prev, errors[2])


def test_first_layer_has_no_derivative_term():
    attn, vals = random_layers(L=1, B=1, H=2, Hkv=2, N=3, D=4)
    u_with_d, _ = pid_update(attn[0], vals[0], None, (0.5, 0.2, 7.0, 0.4))
    u_without, _ = pid_update(attn[0], vals[0], None, (0.5, 0.2, 0.0, 0.4))
    torch.testing.assert_close(u_with_d, u_without, rtol=0, atol=0)
    # and it is exactly lP*e + lI*e with e = (beta - 1) v
    torch.testing.assert_close(u_with_d, attn[0] + 0.7 * (0.4 - 1.0) * vals[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_zero_gains_return_the_attention_output_bit_for_bit(dtype):
    attn, vals = random_layers(L=4, B=2, H=4, Hkv=2, N=5, D=8, dtype=dtype)
    outs, state = run_stack(attn, vals, PIDConfig(0.0, 0.0, 0.0, 0.5))
    for o, a in zip(outs, attn):
        assert torch.equal(o, a)
    assert state.v_first.shape == vals[0].shape


def test_no_leakage_across_positions():
    cfg = PIDConfig.preset("deit")
    attn, vals = random_layers(L=4, B=2, H=2, Hkv=2, N=6, D=4)
    base, _ = run_stack(attn, vals, cfg)
    j = 3
    changed_vals = [v.clone() for v in vals]
    for v in changed_vals:
        v[:, :, j] += torch.randn_like(v[:, :, j]) * 10
    changed, _ = run_stack(attn, changed_vals, cfg)
    for b, c in zip(base, changed):
        others = [i for i in range(6) if i != j]
        assert torch.equal(b[:, :, others], c[:, :, others])
        assert not torch.allclose(b[:, :, j], c[:, :, j])


def test_query_slice_equals_full_computation():
    """With a KV cache only the last q positions are computed; the PID term must agree with the full pass."""
    cfg = PIDConfig.preset("lm")
    attn, vals = random_layers(L=4, B=2, H=4, Hkv=2, N=9, D=4)
    full, full_state = run_stack(attn, vals, cfg)
    q = 3
    sliced, sliced_state = run_stack([a[..., -q:, :] for a in attn], [v[..., -q:, :] for v in vals], cfg)
    for f, s in zip(full, sliced):
        assert torch.equal(f[..., -q:, :], s)
    for f, s in zip(full_state, sliced_state):
        assert torch.equal(f[..., -q:, :], s)


def test_gqa_expands_like_repeat_interleave_of_values():
    x = torch.arange(2 * 3 * 1 * 1).reshape(2, 3, 1, 1)
    y = expand_heads(x, 6)
    assert y[:, :, 0, 0].tolist() == [[0, 0, 1, 1, 2, 2], [3, 3, 4, 4, 5, 5]]
    with pytest.raises(ValueError, match="multiple of the number of key/value heads"):
        expand_heads(x, 4)


@pytest.mark.parametrize("shape", [(5, 3), (2, 5, 3), (2, 3, 4, 5, 3)])
def test_any_leading_shape(shape):
    cfg = PIDConfig.preset("deit")
    g = torch.Generator().manual_seed(1)
    a1, a2, v1, v2 = (torch.randn(shape, generator=g, dtype=torch.float64) for _ in range(4))
    u1, s = pid_update(a1, v1, None, cfg)
    u2, _ = pid_update(a2, v2, s, cfg)
    e1, e2 = 0.1 * v1 - v1, 0.1 * v1 - v2
    torch.testing.assert_close(u2, a2 + 0.8 * e2 + 0.5 * (e1 + e2) + 0.05 * (e2 - e1))


@pytest.mark.parametrize("dtype, tol", [(torch.float16, 2e-2), (torch.bfloat16, 6e-2), (torch.float32, 1e-5)])
def test_low_precision_close_to_float64(dtype, tol):
    cfg = PIDConfig.preset("deit")
    attn, vals = random_layers(L=4, B=2, H=4, Hkv=2, N=8, D=16, dtype=torch.float64)
    want, _ = run_stack(attn, vals, cfg)
    got, state = run_stack([a.to(dtype) for a in attn], [v.to(dtype) for v in vals], cfg)
    for g_, w in zip(got, want):
        assert g_.dtype == dtype
        torch.testing.assert_close(g_.double(), w, rtol=tol, atol=tol)
    # the reference beta v^1, the error and its running sum are kept in float32
    assert state.v_first.dtype == state.e_sum.dtype == state.e_prev.dtype == torch.float32
    torch.testing.assert_close(state.v_first, 0.1 * vals[0].to(dtype).float(), rtol=0, atol=0)


def test_gradcheck_values_attention_and_gains():
    attn, vals = random_layers(L=3, B=1, H=2, Hkv=1, N=3, D=2)
    attn = [a.requires_grad_() for a in attn]
    vals = [v.requires_grad_() for v in vals]
    gains = [torch.tensor(x, dtype=torch.float64, requires_grad=True) for x in (0.8, 0.5, 0.05)]

    def f(*tensors):
        a, v, (lp, li, ld) = tensors[:3], tensors[3:6], tensors[6:]
        outs, _ = run_stack(a, v, (lp, li, ld, 0.1))
        return torch.stack(outs)

    assert torch.autograd.gradcheck(f, (*attn, *vals, *gains))


def test_gradient_reaches_first_layer_values_through_later_layers():
    cfg = PIDConfig.preset("deit")
    attn, vals = random_layers(L=3, B=1, H=1, Hkv=1, N=2, D=2)
    vals[0].requires_grad_()
    outs, _ = run_stack(attn, vals, cfg)
    outs[-1].sum().backward()
    # d u^3 / d v^1 (per element): beta*(lP + lD) + lI*(3*beta - 1) - lD*beta
    expected = 0.1 * (0.8 + 0.05) + 0.5 * (3 * 0.1 - 1) - 0.05 * 0.1
    torch.testing.assert_close(vals[0].grad, torch.full_like(vals[0], expected))


def test_layers_with_different_value_shapes_are_refused():
    cfg = PIDConfig.preset("deit")
    _, s = pid_update(torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8), None, cfg)
    with pytest.raises(ValueError, match="every layer of a PID group must have values of one shape"):
        pid_update(torch.randn(1, 2, 4, 16), torch.randn(1, 2, 4, 16), s, cfg)


def test_mismatched_output_and_values_are_refused():
    cfg = PIDConfig.preset("deit")
    with pytest.raises(ValueError, match="pass the values of the query positions only"):
        pid_update(torch.randn(1, 2, 1, 8), torch.randn(1, 2, 5, 8), None, cfg)
    with pytest.raises(ValueError, match="same number of dimensions"):
        pid_update(torch.randn(2, 1, 8), torch.randn(1, 2, 1, 8), None, cfg)
    with pytest.raises(ValueError, match=r"\(lambda_p, lambda_i, lambda_d, beta\[, control_first_layer\]\)"):
        pid_update(torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8), None, (0.1, 0.2))


def test_compiles_to_one_graph():
    cfg = PIDConfig.preset("lm")
    attn, vals = random_layers(L=3, B=2, H=4, Hkv=2, N=5, D=8, dtype=torch.float32)

    def stack(a0, a1, a2, v0, v1, v2):
        outs, _ = run_stack([a0, a1, a2], [v0, v1, v2], cfg)
        return torch.stack(outs)

    torch._dynamo.reset()
    compiled = torch.compile(stack, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(*attn, *vals), stack(*attn, *vals))


def test_inputs_are_never_modified_in_place():
    cfg = PIDConfig.preset("deit")
    attn, vals = random_layers(L=3, B=1, H=2, Hkv=2, N=4, D=3)
    copies = [t.clone() for t in attn + vals]
    _, state = run_stack(attn, vals, cfg)
    saved = [t.clone() for t in state]
    pid_update(attn[0], vals[0], state, cfg)
    for a, b in zip(attn + vals, copies):
        assert torch.equal(a, b)
    for a, b in zip(state, saved):
        assert torch.equal(a, b)


@pytest.mark.parametrize("preset", ["deit", "segmenter", "lm", "neutreno"])
@pytest.mark.parametrize("H, Hkv", [(4, 4), (4, 2)])
@pytest.mark.parametrize("N", [3, 2048])  # both fixed-gain paths
def test_reference_only_first_layer_matches_naive_reference(preset, H, Hkv, N):
    cfg = PIDConfig.preset(preset, control_first_layer=False)
    attn, vals = random_layers(L=4, B=1, H=H, Hkv=Hkv, N=N, D=2)
    got, state = run_stack(attn, vals, cfg)
    if N > 3:  # the loop reference is slow at N=2048: compare those positions' first rows only
        attn, vals, got = [a[..., :3, :] for a in attn], [v[..., :3, :] for v in vals], [u[..., :3, :] for u in got]
    want = naive_pid_stack(attn, vals, *cfg.gains, control_first_layer=False)
    assert torch.equal(got[0], attn[0])  # plain attention at the first layer
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)
    # learnable (tensor) gains take the general path: same numbers
    tensors = tuple(torch.tensor(g, dtype=torch.float64) for g in cfg.gains[:3]) + (cfg.beta, False)
    learned, _ = run_stack([a[..., :3, :] for a in attn] if N > 3 else attn,
                           [v[..., :3, :] for v in vals] if N > 3 else vals, tensors)
    for g, w in zip(learned, want):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


def test_reference_only_state_and_second_layer_by_hand():
    cfg = PIDConfig(0.8, 0.5, 0.05, 0.1, control_first_layer=False)
    g = torch.Generator().manual_seed(3)
    a1, a2, a3, v1, v2, v3 = (torch.randn(1, 2, 3, 4, generator=g, dtype=torch.float64) for _ in range(6))
    u1, s1 = pid_update(a1, v1, None, cfg)
    assert u1 is a1 and s1.e_sum is None and s1.e_prev is None
    assert torch.equal(s1.v_first, 0.1 * v1)  # the reference beta v^1, formed once
    u2, s2 = pid_update(a2, v2, s1, cfg)
    e2 = 0.1 * v1 - v2
    torch.testing.assert_close(u2, a2 + 0.8 * e2 + 0.5 * e2)  # S^2 = e^2, no D term at the second layer
    u3, _ = pid_update(a3, v3, s2, cfg)
    e3 = 0.1 * v1 - v3
    torch.testing.assert_close(u3, a3 + 0.8 * e3 + 0.5 * (e2 + e3) + 0.05 * (e3 - e2))


def test_neutreno_preset_is_the_p_only_rule_under_both_conventions():
    """NeuTRENO: u = A v + 0.6 (v^1 - v^l); with beta = 1 the first layer's error is zero either way."""
    attn, vals = random_layers(L=3, B=1, H=2, Hkv=2, N=4, D=3)
    for control in (True, False):
        got, _ = run_stack(attn, vals, PIDConfig.preset("neutreno", control_first_layer=control))
        for layer, (a, v, u) in enumerate(zip(attn, vals, got)):
            torch.testing.assert_close(u, a + 0.6 * (vals[0] - v), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("lambda_i", [1e-5, 1e-4, 1e-30])
@pytest.mark.parametrize("N", [1, 2048])
def test_small_integral_gain_stays_finite_in_every_precision(dtype, lambda_i, N):
    """(lP + lD) / lI overflowed float16 in the fused decoding path (1e-5 raised, 1e-4 gave inf)."""
    gains = (0.8, lambda_i, 0.05, 0.1)
    attn, vals = random_layers(L=3, B=1, H=2, Hkv=2, N=N, D=8)
    want, _ = run_stack(attn, vals, gains)
    got, state = run_stack([a.to(dtype) for a in attn], [v.to(dtype) for v in vals], gains)
    tol = {torch.float16: 1e-2, torch.bfloat16: 5e-2, torch.float32: 1e-5}[dtype]
    for g_, w in zip(got, want):
        assert g_.dtype == dtype and torch.isfinite(g_).all()
        torch.testing.assert_close(g_.double(), w, rtol=tol, atol=tol)


def test_running_sum_over_depth_is_accumulated_in_float32():
    """48 layers in bfloat16: the state in float32 keeps the running sum to float32 accuracy."""
    cfg = PIDConfig.preset("deit")
    attn, vals = random_layers(L=48, B=1, H=2, Hkv=2, N=16, D=8)
    want, state64 = run_stack(attn, vals, cfg)
    _, state = run_stack([a.bfloat16() for a in attn], [v.bfloat16() for v in vals], cfg)
    # only the rounding of the inputs to bfloat16 remains: compare with the sum of the rounded inputs
    rounded = [v.bfloat16().double() for v in vals]
    exact = sum(0.1 * rounded[0] - v for v in rounded)
    torch.testing.assert_close(state.e_sum.double(), exact, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape, kv_heads, dtype", [
    ((2, 4, 3, 8), 4, torch.float32),      # small tensors: the fused decoding form
    ((2, 4, 96, 64), 4, torch.float32),    # large tensors: accumulated in place
    ((2, 4, 96, 64), 2, torch.float32),    # grouped-query attention
    ((2, 4, 16, 8), 4, torch.bfloat16),    # low precision: the term in float32, one rounding
])
def test_warmup_scale_one_is_the_fixed_gain_path_bit_for_bit(shape, kv_heads, dtype):
    """The warm-up scale multiplies the term's error tensors, never the fixed gains: at scale 1 every path gives
    exactly the fixed-gain result (what finish_warmup relies on), and at 0 the attention output."""
    torch.manual_seed(0)
    cfg = PIDConfig(lambda_p=0.8, lambda_i=0.5, lambda_d=0.05, beta=0.1)
    one, zero = torch.ones((), dtype=torch.float64), torch.zeros((), dtype=torch.float64)
    fixed = scaled = zeroed = None
    for _ in range(3):
        out = torch.randn(shape).to(dtype)
        v = torch.randn(shape[0], kv_heads, *shape[2:]).to(dtype)
        want, fixed = pid_update(out, v, fixed, cfg)
        got, scaled = pid_update(out, v, scaled, cfg, scale=one)
        none, zeroed = pid_update(out, v, zeroed, cfg, scale=zero)
        assert torch.equal(got, want)
        assert torch.equal(none, out)
