"""The paper's theory (PIDformer Section 3), checked numerically with a fixed row-stochastic attention matrix K and
explicit Euler steps of size DT, against the lemmas' closed forms."""
import pytest
import torch

from pid_plugins import PIDConfig, pid_update
from pid_plugins.analysis import mean_pairwise_cosine, numerical_rank

N, D, DT = 24, 6, 0.05


@pytest.fixture(autouse=True)
def float64_default():
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


def make_problem(seed=0):
    g = torch.Generator().manual_seed(seed)
    K = torch.softmax(torch.randn(N, N, generator=g, dtype=torch.float64), dim=-1)
    V0 = torch.randn(N, D, generator=g, dtype=torch.float64)
    return K, V0, g


def euler(rhs, V, steps, dt=DT):
    for _ in range(steps):
        V = V + dt * rhs(V)
    return V


def p_steady_state(K, F, lp):
    B = K - (lp + 1) * torch.eye(N)
    return -lp * torch.linalg.solve(B, F)


def test_lemma2_softmax_collapses_to_rank_one():
    K, V0, _ = make_problem()
    assert numerical_rank(V0) == D
    V = euler(lambda V: K @ V - V, V0, steps=4000)  # V' = K V - V (eq. 8)
    assert numerical_rank(V, rtol=1e-6) == 1
    assert (V - V.mean(0, keepdim=True)).abs().max() < 1e-8 * V.abs().max()
    V_disc = torch.linalg.matrix_power(K, 200) @ V0  # Euler steps with dt = 1: V <- K V
    assert numerical_rank(V_disc, rtol=1e-6) == 1
    assert mean_pairwise_cosine(V_disc) > 1 - 1e-9


@pytest.mark.parametrize("lp", [0.2, 0.5, 0.8])
def test_lemma4_p_control_steady_state_independent_of_start_and_keeps_rank(lp):
    K, V0, g = make_problem(1)
    F = 0.3 * V0
    V_star = p_steady_state(K, F, lp)
    for start in (V0, torch.randn(N, D, generator=g), torch.zeros(N, D)):
        V = euler(lambda V: K @ V - (lp + 1) * V + lp * F, start, steps=3000)  # eq. 18
        torch.testing.assert_close(V, V_star, rtol=1e-8, atol=1e-8)
    assert numerical_rank(V_star) == numerical_rank(F) == D
    # a low-rank reference signal gives a steady state of exactly that rank
    F_low = torch.randn(N, 2, generator=g) @ torch.randn(2, D, generator=g)
    assert numerical_rank(p_steady_state(K, F_low, lp), rtol=1e-8) == 2


def test_proposition1_perturbation_bound():
    K, V0, g = make_problem(2)
    for lp in (0.2, 0.8, 3.0):
        for beta in (0.1, 0.3, 1.0):
            base = p_steady_state(K, beta * V0, lp)
            for _ in range(5):
                eps = torch.randn(N, D, generator=g) * 0.1
                moved = p_steady_state(K, beta * (V0 + eps), lp)
                assert (moved - base).abs().max() <= beta * eps.abs().max() * (1 + 1e-10)
                # also in the matrix inf-norm (max absolute row sum)
                assert (moved - base).abs().sum(1).max() <= beta * eps.abs().sum(1).max() * (1 + 1e-10)


def decay_rate(traj, target):
    dist = torch.tensor([(v - target).abs().max() for v in traj])
    return -(dist[-1].log() - dist[len(dist) // 2].log()) / (len(dist) - 1 - len(dist) // 2)


@pytest.mark.parametrize("ld", [0.05, 0.3, 0.6])
def test_lemma5_pd_same_steady_state_slower_by_one_plus_lambda_d(ld):
    K, V0, _ = make_problem(3)
    lp, F = 0.5, 0.3 * V0
    V_star = p_steady_state(K, F, lp)

    def run(rhs, steps):
        traj, V = [V0], V0
        for _ in range(steps):
            V = V + DT * rhs(V)
            traj.append(V)
        return traj

    p_rhs = lambda V: K @ V - (lp + 1) * V + lp * F
    # PD: V' = K V - V + lP e + lD e', e = F - V, e' = -V'  =>  (1 + lD) V' = K V - (lP + 1) V + lP F
    pd_rhs = lambda V: (K @ V - V + lp * (F - V)) / (1 + ld)
    p_traj, pd_traj = run(p_rhs, 600), run(pd_rhs, 600)
    pd_long = euler(pd_rhs, V0, steps=6000)
    torch.testing.assert_close(pd_long, V_star, rtol=1e-8, atol=1e-8)
    ratio = decay_rate(pd_traj, V_star) / decay_rate(p_traj, V_star)
    assert ratio == pytest.approx(1 / (1 + ld), rel=0.02)


def pid_block_matrix(K, lp, li, ld):
    I = torch.eye(N)
    top = torch.cat([torch.zeros(N, N), I], dim=1)
    bottom = torch.cat([-li / (ld + 1) * I, (K - (lp + 1) * I) / (ld + 1)], dim=1)
    return torch.cat([top, bottom], dim=0)


def test_proposition2_pid_is_stable_for_random_positive_gains():
    g = torch.Generator().manual_seed(4)
    worst = -float("inf")
    for trial in range(200):
        K = torch.softmax(torch.randn(N, N, generator=g) * (1 + 3 * torch.rand(1, generator=g)), dim=-1)
        lp, li, ld = (torch.rand(3, generator=g) * torch.tensor([5.0, 5.0, 5.0])).tolist()
        eig = torch.linalg.eigvals(pid_block_matrix(K, lp, li, ld))
        worst = max(worst, eig.real.max().item())
    assert worst < 0


def test_pid_dynamics_converge_to_the_reference_signal():
    """PID (eq. 23) with the integral term drives the error e = F - V to zero: V* = F keeps rank(F)."""
    K, V0, _ = make_problem(5)
    lp, li, ld = 0.8, 0.5, 0.05
    F = 0.1 * V0
    V, X = V0.clone(), torch.zeros(N, D)  # X = integral of e
    for _ in range(20000):
        dV = (K @ V - (lp + 1) * V + lp * F + li * X) / (1 + ld)
        V, X = V + DT * dV, X + DT * (F - V)
    torch.testing.assert_close(V, F, rtol=1e-6, atol=1e-6)
    assert numerical_rank(V) == D


@pytest.mark.parametrize("preset", ["deit", "segmenter", "lm"])
def test_discrete_layer_rule_keeps_the_rank_softmax_loses(preset):
    """The core function applied layer after layer with one fixed attention matrix (no projections)."""
    K, V0, _ = make_problem(6)
    cfg = PIDConfig.preset(preset)
    V_soft, V_pid, state = V0, V0, None
    cos_soft, cos_pid = [], []
    for _ in range(48):
        V_soft = K @ V_soft
        V_pid, state = pid_update(K @ V_pid, V_pid, state, cfg)
        cos_soft.append(float(mean_pairwise_cosine(V_soft)))
        cos_pid.append(float(mean_pairwise_cosine(V_pid)))
    assert numerical_rank(V_soft, rtol=1e-6) == 1
    assert torch.isfinite(V_pid).all()
    assert numerical_rank(V_pid, rtol=1e-6) == D
    assert cos_soft[-1] > 0.999
    assert max(cos_pid) < 0.9
