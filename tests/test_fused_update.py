"""The fused Triton PID update (pid_plugins.core.fused) against the eager pid_update, on the CPU through Triton's
interpreter (TRITON_INTERPRET=1): outputs, the state and gradients, every dtype and layout (heads first or positions
first, grouped-query heads, the first layer controlled or reference-only). Tiny shapes: a few seconds."""
import os

import pytest
import torch

triton = pytest.importorskip("triton", reason="triton is not installed: the fused CUDA update cannot be tested")

from pid_plugins.core import control  # noqa: E402

_saved = os.environ.get("TRITON_INTERPRET")
os.environ["TRITON_INTERPRET"] = "1"  # while the kernels are defined: triton.jit picks the interpreter then
try:
    from pid_plugins.core.fused import fused_pid_update  # noqa: E402
finally:  # the rest of this test process (other modules under xdist) sees the environment it had
    if _saved is None:
        del os.environ["TRITON_INTERPRET"]
    else:
        os.environ["TRITON_INTERPRET"] = _saved

@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    """Triton's interpreter for each test of this module only (it reads the variable at launch too)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")


TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=1e-2, atol=1e-2),
       torch.float16: dict(rtol=2e-3, atol=2e-3)}


def layers(dtype, heads, kv_heads, L=3, B=2, N=3, D=4, seed=0):
    """Leaf tensors, heads first ``(B, H, N, D)``; :func:`view` gives the layout passed to the update."""
    g = torch.Generator().manual_seed(seed)
    attn = [torch.randn(B, heads, N, D, generator=g).to(dtype).requires_grad_() for _ in range(L)]
    vals = [torch.randn(B, kv_heads, N, D, generator=g).to(dtype).requires_grad_() for _ in range(L)]
    return attn, vals


def view(layout, a, v):
    """heads: contiguous ``(B, H, N, D)``; positions: ``(B, N, H, D)`` outputs, values a transposed view (the
    HF adapter's layout, heads at -2); strided: heads first, both transposed views of positions-first tensors."""
    if layout == "heads":
        return a, v, -3
    if layout == "positions":
        return a.transpose(1, 2).contiguous(), v.transpose(1, 2), -2
    return a.transpose(1, 2).contiguous().transpose(1, 2), v.transpose(1, 2).contiguous().transpose(1, 2), -3


def run(update, attn, vals, gains, layout):
    state, outs = None, []
    for a, v in zip(attn, vals):
        a, v, head_dim = view(layout, a, v)
        if update == "eager":
            u, state = control.pid_update(a, v, state, gains, head_dim=head_dim)
        else:
            if state is None and not gains[4]:
                u, state = a, (v.to(control._state_dtype(v.dtype)) * gains[3], None, None)  # reference-only layer
            else:
                u, state = fused_pid_update(a, v, state, gains[:4], head_dim, control._state_dtype(v.dtype))
        outs.append(u)
    return outs, state


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize("layout", ["heads", "positions", "strided"])
@pytest.mark.parametrize("control_first", [True, False])
def test_fused_update_matches_eager_outputs_state_and_gradients(dtype, heads, kv_heads, layout, control_first):
    gains = (0.7, 0.4, 0.2, 0.6, control_first)
    got_attn, got_vals = layers(dtype, heads, kv_heads)
    want_attn, want_vals = layers(dtype, heads, kv_heads)
    got, got_state = run("fused", got_attn, got_vals, gains, layout)
    want, want_state = run("eager", want_attn, want_vals, gains, layout)
    for g_, w in zip(got, want):
        assert g_.dtype == w.dtype == dtype and g_.shape == w.shape and g_.stride() == w.stride()
        torch.testing.assert_close(g_, w, **TOL[dtype])
    for g_, w in zip(got_state, want_state):
        assert g_.dtype == w.dtype and g_.shape == w.shape
        torch.testing.assert_close(g_, w, **TOL[torch.float32])
    # gradients through every layer's output and the last state (as a next group member would use it), against
    # the eager rule in float64 on the same (rounded) inputs: the fused backward rounds each gradient once
    ref_attn = [a.detach().double().requires_grad_() for a in want_attn]
    ref_vals = [v.detach().double().requires_grad_() for v in want_vals]
    ref, ref_state = run("eager", ref_attn, ref_vals, gains, layout)
    weights = torch.Generator().manual_seed(1)
    # (the outputs' gradients representable in their dtype: the gradient a float16/bfloat16 output receives)
    ws = [torch.randn(u.shape, generator=weights).to(dtype).double() for u in want]
    wstate = [torch.randn(t.shape, generator=weights, dtype=torch.float64) for t in want_state]

    def loss(outs, state):
        return (sum((u.double() * w).sum() for u, w in zip(outs, ws))
                + sum((t.double() * w).sum() for t, w in zip(state, wstate)))

    loss(got, got_state).backward()
    loss(ref, ref_state).backward()
    for g_, w, x in zip(got_attn + got_vals, ref_attn + ref_vals, got_attn + got_vals):
        assert g_.grad.dtype == x.dtype and g_.grad.shape == x.shape
        torch.testing.assert_close(g_.grad.double(), w.grad, **TOL[dtype])


def test_pid_update_uses_eager_off_cuda_and_the_switch_exists():
    assert isinstance(control.FUSED, bool)
    a, v = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4)
    u, _ = control.pid_update(a, v, None, (0.5, 0.2, 0.1, 0.6))
    torch.testing.assert_close(u, a + 0.7 * (0.6 * v - v))


@pytest.mark.parametrize("env, expected", [(None, "False"), ("0", "False"), ("1", "True")])
def test_the_fused_update_is_opt_in(env, expected):
    """Off unless ``PID_PLUGINS_FUSED=1``: measured on an H200, the eager update was faster in every row
    (docs/performance.md)."""
    import subprocess
    import sys

    environ = {k: v for k, v in os.environ.items() if k != "PID_PLUGINS_FUSED"}
    if env is not None:
        environ["PID_PLUGINS_FUSED"] = env
    out = subprocess.run([sys.executable, "-c", "import pid_plugins.core.control as c; print(c.FUSED)"],
                         env=environ, capture_output=True, text=True, check=True).stdout.strip()
    assert out == expected


def test_import_pid_plugins_needs_no_triton():
    """The kernels' module is imported lazily: on the CUDA path or by this test, never by ``import pid_plugins``."""
    import subprocess
    import sys

    code = ("import sys; import pid_plugins; import pid_plugins.core.control; "
            "assert 'pid_plugins.core.fused' not in sys.modules and 'triton' not in sys.modules, sorted(sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "TRITON_INTERPRET": "0"})


@pytest.mark.parametrize("control_first", [True, False])
def test_pid_update_dispatches_to_the_fused_update_and_back(monkeypatch, control_first):
    """pid_update itself with the fused path switched on for CPU tensors: the same outputs and state as with
    ``FUSED = False`` (the eager reference), for a PIDConfig and GQA in the HF layout; learnable (tensor) gains and
    the warm-up's scale stay on the eager path."""
    from pid_plugins import PIDConfig

    cfg = PIDConfig(0.4, 0.5, 0.1, 0.3, control_first_layer=control_first)
    attn, vals = layers(torch.float32, 4, 2)
    calls = []
    real = __import__("pid_plugins.core.fused", fromlist=["fused_pid_update"]).fused_pid_update
    monkeypatch.setattr("pid_plugins.core.fused.fused_pid_update", lambda *a: calls.append(1) or real(*a))
    results = {}
    for fused in (True, False):
        monkeypatch.setattr(control, "_FUSED_ON_CPU", fused)
        monkeypatch.setattr(control, "FUSED", fused)
        state, outs = None, []
        for a, v in zip(attn, vals):
            a, v, head_dim = view("positions", a.detach(), v.detach())
            u, state = control.pid_update(a, v, state, cfg, head_dim=head_dim)
            assert type(state) is control.PIDState
            outs.append(u)
        results[fused] = outs, state
    assert len(calls) == (3 if control_first else 2)  # every controlled layer, and only with the switch on
    for g_, w in zip(results[True][0], results[False][0]):
        torch.testing.assert_close(g_, w, **TOL[torch.float32])
    for g_, w in zip(results[True][1], results[False][1]):
        torch.testing.assert_close(g_, w, **TOL[torch.float32])
    monkeypatch.setattr(control, "_FUSED_ON_CPU", True)
    monkeypatch.setattr(control, "FUSED", True)
    a, v, head_dim = view("heads", attn[0].detach(), vals[0].detach())
    control.pid_update(a, v, None, (torch.tensor(0.4), 0.5, 0.1, 0.3), head_dim=head_dim)
    control.pid_update(a, v, None, cfg, head_dim=head_dim, scale=torch.tensor(0.5))
    assert len(calls) == (3 if control_first else 2)
