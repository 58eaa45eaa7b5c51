import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from pid_plugins import PIDConfig, PIDGains, PIDSelfAttention, sdpa_with_pid

DIM, HEADS = 32, 4


def make_pair(pid, seed=0, **kw):
    torch.manual_seed(seed)
    stock = PIDSelfAttention(DIM, HEADS, qkv_bias=True, **kw)
    torch.manual_seed(seed)
    controlled = PIDSelfAttention(DIM, HEADS, qkv_bias=True, pid=pid, **kw)
    controlled.load_state_dict(stock.state_dict())
    return stock.eval(), controlled.eval()


def manual_attention(m, x, mask=None):
    """Attention written out by hand (no SDPA), returning per-head output and values."""
    B, N, C = x.shape
    q, k, v = m.qkv(x).reshape(B, N, 3, HEADS, C // HEADS).permute(2, 0, 3, 1, 4)
    scores = q @ k.transpose(-1, -2) * (C // HEADS) ** -0.5
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(-1) @ v, v


def test_softmax_module_is_plain_attention():
    m = PIDSelfAttention(DIM, HEADS, qkv_bias=True).eval()
    x = torch.randn(2, 7, DIM)
    y, state = m(x)
    assert state is None
    out, _ = manual_attention(m, x)
    torch.testing.assert_close(y, m.proj(out.transpose(1, 2).reshape(2, 7, DIM)), rtol=1e-5, atol=1e-5)


def test_zero_gains_module_equals_softmax_module_bit_for_bit():
    stock, zero = make_pair(PIDConfig(0.0, 0.0, 0.0, 1.0))
    x = torch.randn(2, 9, DIM)
    s1 = s2 = None
    for _ in range(3):
        (y1, s1), (y2, s2) = stock(x, s1), zero(x, s2)
        assert torch.equal(y1, y2)
        x = y1
    assert set(zero.state_dict()) == set(stock.state_dict())


def test_pid_module_adds_the_pid_term_before_the_projection():
    cfg = PIDConfig.preset("deit")
    _, m = make_pair(cfg)
    x1, x2 = torch.randn(2, 5, DIM), torch.randn(2, 5, DIM)
    y1, s = m(x1)
    y2, _ = m(x2, s)
    a1, v1 = manual_attention(m, x1)
    a2, v2 = manual_attention(m, x2)
    e1, e2 = 0.1 * v1 - v1, 0.1 * v1 - v2
    u2 = a2 + 0.8 * e2 + 0.5 * (e1 + e2) + 0.05 * (e2 - e1)
    torch.testing.assert_close(y2, m.proj(u2.transpose(1, 2).reshape(2, 5, DIM)), rtol=1e-5, atol=1e-5)
    u1 = a1 + (0.8 + 0.5) * e1
    torch.testing.assert_close(y1, m.proj(u1.transpose(1, 2).reshape(2, 5, DIM)), rtol=1e-5, atol=1e-5)


def test_causal_mask_stays_causal():
    _, m = make_pair(PIDConfig.preset("lm"))
    x = torch.randn(1, 8, DIM)
    x_changed = x.clone()
    x_changed[:, 5:] += 3.0
    outs = []
    for inp in (x, x_changed):
        y, s = m(inp, is_causal=True)
        y, s = m(y, s, is_causal=True)
        outs.append(y)
    assert torch.equal(outs[0][:, :5], outs[1][:, :5])
    assert not torch.allclose(outs[0][:, 5:], outs[1][:, 5:])


def test_boolean_mask_matches_manual():
    _, m = make_pair(PIDConfig.preset("deit"))
    x = torch.randn(2, 6, DIM)
    mask = torch.ones(6, 6, dtype=torch.bool)
    mask[:, 4:] = False  # padding: the last two keys are masked out
    y, _ = m(x, attn_mask=mask)
    a, v = manual_attention(m, x, mask)
    u = a + (0.8 + 0.5) * (0.1 - 1.0) * v
    torch.testing.assert_close(y, m.proj(u.transpose(1, 2).reshape(2, 6, DIM)), rtol=1e-5, atol=1e-5)


def test_attention_dropout_only_in_training():
    _, m = make_pair(PIDConfig.preset("deit"), attn_drop=0.5)
    x = torch.randn(2, 6, DIM)
    y_eval, _ = m(x)
    m.train()
    torch.manual_seed(0)
    y_train, _ = m(x)
    assert not torch.allclose(y_eval, y_train)
    m.eval()
    assert torch.equal(m(x)[0], y_eval)


def test_kv_cache_slice_in_sdpa_with_pid():
    cfg = PIDConfig.preset("lm")
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 10, 8, generator=g) for _ in range(3))
    full, full_state = sdpa_with_pid(q, k, v, None, cfg, is_causal=True)
    # last 3 positions decoded against the cached keys/values
    mask = torch.ones(3, 10, dtype=torch.bool).tril(diagonal=7)
    part, part_state = sdpa_with_pid(q[:, :, -3:], k, v, None, cfg, attn_mask=mask)
    torch.testing.assert_close(part, full[:, :, -3:], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(part_state.v_first, full_state.v_first[:, :, -3:])


def test_sdpa_with_pid_gqa():
    cfg = PIDConfig.preset("lm")
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 6, 5, 8, generator=g)
    k, v = torch.randn(2, 2, 5, 8, generator=g), torch.randn(2, 2, 5, 8, generator=g)
    out, state = sdpa_with_pid(q, k, v, None, cfg)
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1))
    torch.testing.assert_close(out, ref + (0.4 + 0.5) * (0.3 - 1) * v.repeat_interleave(3, 1),
                               rtol=1e-5, atol=1e-5)
    assert state.v_first.shape == (2, 2, 5, 8)


class Stack(nn.Module):
    """Residual attention blocks passing (x, *state) explicitly, as the zoo adapters do."""

    def __init__(self, pid, depth=3, ckpt=None):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(PIDSelfAttention(DIM, HEADS, pid=pid) for _ in range(depth))
        self.ckpt = ckpt

    @staticmethod
    def _run(block, x, *state):
        y, new_state = block(x, tuple(state) if state else None)
        return (x + y, *new_state)

    def forward(self, x):
        state = ()
        for blk in self.blocks:
            if self.ckpt is None:
                x, *state = self._run(blk, x, *state)
            else:
                x, *state = checkpoint(self._run, blk, x, *state, use_reentrant=self.ckpt == "reentrant")
        return x


@pytest.mark.parametrize("ckpt", ["non_reentrant", "reentrant"])
def test_gradient_checkpointing_gives_exact_gradients(ckpt):
    cfg = PIDConfig.preset("deit", learnable=True)
    ref, chk = Stack(cfg), Stack(cfg, ckpt=ckpt)
    chk.load_state_dict(ref.state_dict())
    x = torch.randn(2, 6, DIM)
    grads = []
    for model in (ref, chk):
        inp = x.clone().requires_grad_()
        # two forwards before one backward (teacher/student, two views): module-held state gets this wrong
        (model(inp).square().sum() + model(inp * 0.5).sum()).backward()
        grads.append([inp.grad, *(p.grad for p in model.parameters())])
    assert len(grads[0]) == len(grads[1]) == 1 + 3 * 6  # x; qkv.weight, proj.weight, proj.bias and 3 gains per block
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_learnable_gains_are_opt_in():
    fixed = PIDSelfAttention(DIM, HEADS, pid=PIDConfig.preset("deit"))
    stock = PIDSelfAttention(DIM, HEADS)
    assert sum(p.numel() for p in fixed.parameters()) == sum(p.numel() for p in stock.parameters())
    learned = PIDSelfAttention(DIM, HEADS, pid=PIDConfig.preset("deit", learnable=True))
    extra = set(learned.state_dict()) - set(stock.state_dict())
    assert extra == {"attention_params.lambda_p_raw", "attention_params.lambda_i_raw", "attention_params.lambda_d_raw"}
    lp, li, ld, beta, control = learned.attention_params()
    assert (lp.item(), li.item(), ld.item(), beta, control) == pytest.approx((0.8, 0.5, 0.05, 0.1, True))
    # a softmax checkpoint loads into the fixed-gain PID module strictly
    fixed.load_state_dict(stock.state_dict(), strict=True)


def test_learned_gains_are_one_element_vectors_and_older_layouts_load():
    """(1,)-shaped raw gains (FSDP2's fully_shard refuses 0-dim parameters); state dicts with 0-dim raw gains
    (before that) and with the gains themselves (before the softplus parametrisation) load to the same gains."""
    learned = PIDSelfAttention(DIM, HEADS, pid=PIDConfig.preset("deit", learnable=True))
    assert {p.shape for p in learned.attention_params.parameters()} == {torch.Size([1])}
    with torch.no_grad():
        learned.attention_params.lambda_i_raw.fill_(0.3)
    want = [g.detach().clone() for g in learned.attention_params()[:3]]
    sd = learned.state_dict()
    zero_dim = {k: (v.reshape(()) if "_raw" in k else v) for k, v in sd.items()}
    gains_only = {k: v for k, v in sd.items() if "_raw" not in k}
    gains_only.update({f"attention_params.{n}": torch.nn.functional.softplus(sd[f"attention_params.{n}_raw"]).reshape(())
                       for n in ("lambda_p", "lambda_i", "lambda_d")})
    for old in (zero_dim, gains_only):
        fresh = PIDSelfAttention(DIM, HEADS, pid=PIDConfig.preset("deit", learnable=True))
        fresh.load_state_dict(old, strict=True)
        got = fresh.attention_params()[:3]
        assert all(g.shape == (1,) for g in got)
        torch.testing.assert_close(torch.cat(got), torch.cat(want), rtol=1e-6, atol=1e-7)


def test_the_first_layers_derivative_gain_gets_a_zero_gradient():
    """The D term is zero at a group's first layer: lambda_d is in the graph with a zero gradient there (learnable
    gains equal to fixed ones and training: the zoo contract's learnable test)."""
    learned = Stack(PIDConfig.preset("lm", learnable=True))
    learned(torch.randn(2, 5, DIM)).square().sum().backward()
    for i, blk in enumerate(learned.blocks):
        gains = blk.attention_params
        assert gains.lambda_p_raw.grad.abs() > 0 and gains.lambda_i_raw.grad.abs() > 0
        assert (gains.lambda_d_raw.grad == 0) if i == 0 else (gains.lambda_d_raw.grad.abs() > 0)


def test_learned_gains_stay_positive_whatever_the_optimiser_does():
    """Proposition 2 (stability) needs positive gains: a step that would drive a plain parameter far below 0
    leaves the softplus-parametrised gain positive."""
    cfg = PIDConfig.preset("deit", learnable=True)
    gains = PIDGains(cfg)
    opt = torch.optim.SGD(gains.parameters(), lr=100.0)
    for _ in range(3):
        lp, li, ld, _, _ = gains()
        (lp + li + ld).backward()  # gradient +1 on each gain: SGD pushes them down hard
        opt.step()
        opt.zero_grad()
    assert all(g.item() > 0 for g in gains()[:3])
    assert all(torch.isfinite(g) for g in gains()[:3])


def test_learned_gain_initialised_at_zero_starts_tiny_and_can_grow():
    gains = PIDGains(PIDConfig.preset("neutreno", learnable=True))  # lambda_i = lambda_d = 0
    lp, li, ld, _, _ = gains()
    assert lp.item() == pytest.approx(0.6) and 0 < li.item() <= 1.01e-4 and 0 < ld.item() <= 1.01e-4
    (-li).backward()
    assert gains.lambda_i_raw.grad < 0  # gradient descent increases it


def test_state_dict_from_before_the_positive_parametrisation_loads_with_the_same_gains():
    gains = PIDGains(PIDConfig.preset("deit", learnable=True))
    old = {"lambda_p": torch.tensor(0.3), "lambda_i": torch.tensor(0.7), "lambda_d": torch.tensor(0.02)}
    gains.load_state_dict(old, strict=True)
    assert [g.item() for g in gains()[:3]] == pytest.approx([0.3, 0.7, 0.02], rel=1e-5)
    with pytest.raises(ValueError, match="learned PID gains must be positive"):
        PIDGains(PIDConfig(learnable=True)).load_state_dict({**old, "lambda_d": torch.tensor(-0.1)})


def test_reference_only_first_layer_in_the_module_stack():
    """The module stack with control_first_layer=False: block 1 is plain attention, later blocks controlled."""
    torch.manual_seed(0)
    cfg = PIDConfig.preset("deit", control_first_layer=False)
    pid, soft = Stack(cfg), Stack(PIDConfig(0.0, 0.0, 0.0, 1.0))  # zero gains: the softmax stack
    soft.load_state_dict(pid.state_dict())
    x = torch.randn(2, 5, DIM)
    first_pid, _ = pid.blocks[0](x, None)
    first_soft, _ = soft.blocks[0](x, None)
    assert torch.equal(first_pid, first_soft)
    assert not torch.allclose(pid(x), soft(x))
    learned = Stack(cfg.replace(learnable=True))
    learned.load_state_dict(pid.state_dict(), strict=False)
    torch.testing.assert_close(learned(x), pid(x), rtol=2e-4, atol=2e-4)  # same gains (softplus round trip)
    learned(x).sum().backward()
    assert all(p.grad is not None for p in learned.parameters())  # every parameter in the graph (DDP)


@pytest.mark.slow
def test_stack_compiles_fullgraph_and_matches_eager():
    torch._dynamo.reset()
    m = Stack(PIDConfig.preset("deit")).eval()
    x = torch.randn(2, 6, DIM)
    compiled = torch.compile(m, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x), m(x))


def test_dim_must_divide_heads():
    with pytest.raises(ValueError, match="divisible by num_heads"):
        PIDSelfAttention(30, 4)
