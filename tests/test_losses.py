"""Estimators against plain per-token reference loops and their defining properties; corrections acting
exactly as their formulas say on constructed inputs."""

import math

import pytest
import torch

from opdcache.training import losses as L


def _rand(*shape, seed=0):
    return -torch.rand(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 3


def test_lightning_matches_the_paper_formula_and_gradient():
    s = _rand(2, 5).requires_grad_()
    T = _rand(2, 5, seed=1)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.float64)
    terms, stats = L.lightning_terms(s, T, tau=0.5)
    loss = L.reduce(terms, mask)
    loss.backward()
    # plain loop: A = clip(T - s, -tau, tau) held fixed; d loss / d s_t = -A_t / tokens
    tokens = mask.sum()
    for b in range(2):
        for t in range(5):
            A = max(-0.5, min(0.5, float(T[b, t] - s[b, t])))
            assert s.grad[b, t].item() == pytest.approx(-A * mask[b, t].item() / tokens.item())
    assert stats["clipped"].sum() == ((T - s).abs() > 0.5).sum()


def test_is_gradient_is_the_importance_weighted_reverse_kl_gradient():
    s = _rand(1, 6).requires_grad_()
    b, T = _rand(1, 6, seed=2), _rand(1, 6, seed=3)
    mask = torch.ones(1, 6, dtype=torch.float64)
    L.reduce(L.is_terms(s, b, T)[0], mask).backward()
    expected = -torch.exp(s - b) * (T - s) / 6  # rho * grad s * sg(T - s)
    torch.testing.assert_close(s.grad, expected.detach())
    # on-policy (b = s) the loss value equals the per-token reverse-KL estimate sum(s - T) / tokens
    s2 = _rand(1, 6).requires_grad_()
    val = L.reduce(L.is_terms(s2, s2.detach(), T)[0], mask)
    assert val.item() == pytest.approx(float((s2 - T).sum() / 6))


def test_mc_averages_the_samples():
    s, b, T = _rand(2, 3, 4).requires_grad_(), _rand(2, 3, 4, seed=1), _rand(2, 3, 4, seed=2)
    terms, _ = L.mc_terms(s, b, T)
    manual = torch.stack([L.is_terms(s[..., j], b[..., j], T[..., j])[0] for j in range(4)], -1).mean(-1)
    torch.testing.assert_close(terms, manual)


def test_without_importance_weights_the_gradient_is_the_plain_score_function():
    """papers/001 App. F's no-IS ablation: the same advantage, no old-to-current weight: d/ds = -(T - s) / tokens."""
    s = _rand(2, 5).requires_grad_()
    b, T = _rand(2, 5, seed=4), _rand(2, 5, seed=5)
    mask = torch.ones(2, 5, dtype=torch.float64)
    terms, stats = L.is_terms(s, b, T, weighted=False)
    L.reduce(terms, mask).backward()
    torch.testing.assert_close(s.grad, (-(T - s) / 10).detach())
    torch.testing.assert_close(stats["rho"], torch.exp(s - b).detach())  # the ratio is still reported
    s2 = _rand(2, 3, 4).requires_grad_()
    b2, T2 = _rand(2, 3, 4, seed=6), _rand(2, 3, 4, seed=7)
    L.reduce(L.mc_terms(s2, b2, T2, weighted=False)[0], torch.ones(2, 3, dtype=torch.float64)).backward()
    torch.testing.assert_close(s2.grad, (-(T2 - s2) / 4 / 6).detach())


def test_ppo_matches_a_plain_loop_of_the_clipped_surrogate():
    """papers/001 eq. 6, L_old^clip: rho = exp(s - b), A_old = T - r (fixed), term = -min(rho A, clip(rho) A)."""
    s = _rand(3, 4).requires_grad_()
    b, T, r = s.detach() + 0.4 * torch.randn(3, 4, dtype=torch.float64), _rand(3, 4, seed=8), _rand(3, 4, seed=9)
    mask = torch.ones(3, 4, dtype=torch.float64)
    terms, stats = L.ppo_terms(s, b, T, r, eps=0.2)
    L.reduce(terms, mask).backward()
    for i in range(3):
        for t in range(4):
            rho, A = math.exp(float(s[i, t] - b[i, t])), float(T[i, t] - r[i, t])
            clipped = min(max(rho, 0.8), 1.2)
            value = -min(rho * A, clipped * A)
            assert terms[i, t].item() == pytest.approx(value)
            active = rho * A <= clipped * A  # the unclipped branch is the min: it carries the gradient
            assert s.grad[i, t].item() == pytest.approx(-rho * A / 12 if active else 0.0, abs=1e-12)
            assert stats["clipped"][i, t].item() == float(clipped != rho)


@pytest.mark.parametrize("direction", ["fkl", "rkl"])
@pytest.mark.parametrize("tail", [False, True])
def test_topk_kl_properties(direction, tail):
    lp = torch.log_softmax(torch.randn(3, 4, 50, dtype=torch.float64), -1)
    top = lp.topk(8, -1).indices
    t = lp.gather(-1, top)
    same, _ = L.topk_terms(t.clone().requires_grad_(), t, direction, tail)
    assert same.abs().max() < 1e-12
    lq = torch.log_softmax(torch.randn(3, 4, 50, dtype=torch.float64), -1).gather(-1, top).requires_grad_()
    kl, _ = L.topk_terms(lq, t, direction, tail)
    assert (kl > 0).all()
    # reference: explicit distributions on the support
    def dist(x):
        if tail:
            return torch.cat([x.exp(), 1 - x.exp().sum(-1, keepdim=True)], -1)
        return x.exp() / x.exp().sum(-1, keepdim=True)
    P, Q = dist(t), dist(lq.detach())
    ref = (P * (P.log() - Q.log())).sum(-1) if direction == "fkl" else (Q * (Q.log() - P.log())).sum(-1)
    torch.testing.assert_close(kl.detach(), ref)


def test_token_tis_truncates_at_the_cap():
    r_rollout = torch.log(torch.tensor([[0.5, 0.5, 0.1]]))
    r_train = torch.log(torch.tensor([[0.5, 0.25, 0.4]]))
    w = L.token_tis_weight(r_train, r_rollout, cap=2.0)
    torch.testing.assert_close(w, torch.tensor([[1.0, 0.5, 2.0]]))  # ratios 1, 0.5, 4 -> capped at 2


@pytest.mark.parametrize("which", ["k1", "k3"])
def test_sequence_rejection_uses_the_summed_estimator(which):
    lr = torch.tensor([[0.0, 0.0, 0.0], [-1.0, -1.0, 0.0], [0.5, 0.0, 0.0]])  # log(r_train / r_rollout)
    mask = torch.tensor([[1.0, 1, 1], [1, 1, 1], [1, 1, 0]])
    keep = L.sequence_reject_mask(lr, torch.zeros_like(lr), mask, which, threshold=1.0)
    k = {"k1": lambda x: -x, "k3": lambda x: math.exp(x) - 1 - x}[which]
    sums = [sum(k(float(v)) * float(m) for v, m in zip(row, mrow)) for row, mrow in zip(lr, mask)]
    assert keep.tolist() == [1.0 if x <= 1.0 else 0.0 for x in sums]
    assert keep.tolist() == ([1.0, 0.0, 1.0] if which == "k1" else [1.0, 1.0, 1.0])  # K3(-1) * 2 = 0.74


def test_trust_band_with_dual_clipping_of_negative_samples():
    c = L.Corrections(trust_band=True, band_low=0.2, band_high=0.2, dual_clip=3.0, band_cap=2.0)
    mask = torch.ones(5, 2)
    r_train = torch.zeros(5, 2)
    log_rho = torch.tensor([0.1, 0.5, 0.5, -0.5, 1.5])  # sequence ratios e^x: 1.11, 1.65, 1.65, 0.61, 4.48
    s = r_train + log_rho[:, None]
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0, -1.0])[:, None].expand(5, 2)
    r_rollout = torch.full((5, 2), -1.0)  # mismatch weight exp(1) = 2.72, capped at 2
    w, stats = L.trust_band_weights(s, r_train, r_rollout, adv, mask, c)
    # kept: positive with rho <= 1.2; negative with 0.8 <= rho <= 3 (the dual clip drops rho = 4.48)
    assert stats["band_kept"].tolist() == [1.0, 0.0, 1.0, 0.0, 0.0]
    torch.testing.assert_close(w, torch.tensor([2.0, 0.0, 2.0, 0.0, 0.0]))


def test_corrections_compose_with_any_estimator():
    s = _rand(2, 3).requires_grad_()
    T = _rand(2, 3, seed=1)
    mask = torch.ones(2, 3, dtype=torch.float64)
    r_train, r_rollout = _rand(2, 3, seed=4), _rand(2, 3, seed=5)
    c = L.Corrections(tis_cap=1.5, reject_k="k3", reject_threshold=100.0)
    terms, st = L.lightning_terms(s, T, 1.0)
    weights, cs = L.correction_weights(c, s, r_train, r_rollout, st["advantage"], mask)
    torch.testing.assert_close(weights, torch.exp(r_train - r_rollout).clamp(max=1.5))
    assert L.reduce(terms, mask, weights).item() == pytest.approx(float((terms * weights).sum() / 6))
    with pytest.raises(Exception, match="--reject-k must be k1 or k3"):
        L.Corrections(reject_k="k2")
