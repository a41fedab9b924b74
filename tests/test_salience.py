"""Entropic LP solver, unary salience and pruning against loop references."""
from __future__ import annotations

import math

import pytest
import torch

import reference
from pyserini_aligner.salience import keep_count, prune_mask, redundant_tokens, solve_entropic_lp, unary_salience


def _rows(b: int, n: int, seed: int, scale: float = 5.0, dtype=torch.float64):
    """Scores uniform in [0, scale] [b, n] and a padding mask with random lengths (row 0 full)."""
    gen = torch.Generator().manual_seed(seed)
    s = scale * torch.rand(b, n, generator=gen, dtype=dtype)
    lens = torch.randint(1, n + 1, (b,), generator=gen)
    lens[0] = n
    return s, torch.arange(n) < lens.unsqueeze(1)


@pytest.mark.parametrize("eps", [0.002, 0.05, 0.5])
@pytest.mark.parametrize("k", [1.0, 2.5, 7.0])
def test_lp_matches_bisection_reference(eps, k):
    s, mask = _rows(6, 24, seed=int(100 * k + 1000 * eps))
    lam = solve_entropic_lp(s, k, eps, mask)
    for r in range(s.shape[0]):
        real = s[r][mask[r]].tolist()
        expected = torch.tensor(reference.lp_bisection(real, k, eps), dtype=torch.float64)
        torch.testing.assert_close(lam[r][mask[r]], expected, rtol=1e-9, atol=1e-9)
        assert (lam[r][~mask[r]] == 0).all()


def test_lp_is_the_fixed_point_of_the_paper_coordinate_ascent():
    s, _ = _rows(3, 10, seed=1, scale=1.0)
    lam = solve_entropic_lp(s, 3.0, 0.2)
    for r in range(3):
        ascent = reference.lp_paper_ascent(s[r].tolist(), 3.0, 0.2, n_iters=500)
        torch.testing.assert_close(lam[r], torch.tensor(ascent, dtype=torch.float64), rtol=1e-7, atol=1e-7)


@pytest.mark.parametrize("k", [1.0, 4.0, 25.6, 102.4])
def test_lp_constraints_float32_small_eps(k):
    s, mask = _rows(64, 256, seed=2, dtype=torch.float32)
    lam = solve_entropic_lp(s, k, 0.002, mask)
    target = torch.clamp(mask.sum(-1).float(), max=k)
    torch.testing.assert_close(lam.sum(-1), target, rtol=1e-6, atol=1e-5)
    assert lam.min() >= 0 and lam.max() <= 1


def test_lp_per_row_k_tensor():
    s, mask = _rows(5, 30, seed=3)
    k = torch.tensor([1.0, 2.5, 4.0, 10.0, 0.5], dtype=torch.float64)
    lam = solve_entropic_lp(s, k, 0.1, mask)
    torch.testing.assert_close(lam.sum(-1), torch.minimum(k, mask.sum(-1).double()), rtol=1e-10, atol=1e-10)
    for r in range(5):
        torch.testing.assert_close(lam[r : r + 1], solve_entropic_lp(s[r : r + 1], float(k[r]), 0.1, mask[r : r + 1]))


def test_lp_small_eps_approaches_hard_topk():
    gen = torch.Generator().manual_seed(4)
    n, k = 32, 5
    s = torch.stack([torch.randperm(n, generator=gen) for _ in range(8)]).double() * (5.0 / n)  # gaps 5/n
    hard = torch.zeros_like(s).scatter(-1, s.topk(k).indices, 1.0)
    errors = [(solve_entropic_lp(s, k, eps) - hard).abs().max().item() for eps in (1.0, 0.2, 0.05, 0.01, 0.002)]
    assert all(a > b for a, b in zip(errors, errors[1:]))
    assert errors[-1] < 1e-12


def test_lp_gradcheck():
    s, mask = _rows(4, 9, seed=5, scale=1.0)
    s.requires_grad_()
    k = torch.tensor([2.0, 3.5, 1.0, 5.0], dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda x: solve_entropic_lp(x, k, 0.3, mask), (s,))
    assert torch.autograd.gradcheck(lambda x: solve_entropic_lp(x, 1.5, 0.05), (s,))


@pytest.mark.parametrize("scale,eps", [(1e4, 0.002), (5.0, 1e-6), (1e4, 1e-6)])
def test_lp_no_overflow(scale, eps):
    for dtype in (torch.float32, torch.float64):
        gen = torch.Generator().manual_seed(6)
        s = (scale * torch.randn(8, 64, generator=gen)).to(dtype).requires_grad_()
        mask = torch.ones(8, 64, dtype=torch.bool)
        mask[1:, 40:] = False
        lam = solve_entropic_lp(s, 3.5, eps, mask)
        assert lam.isfinite().all() and lam.min() >= 0 and lam.max() <= 1
        torch.testing.assert_close(lam.sum(-1), torch.full((8,), 3.5, dtype=dtype), rtol=1e-6, atol=1e-5)
        (lam * torch.arange(64, dtype=dtype)).sum().backward()
        assert s.grad.isfinite().all()


def test_lp_masks_and_degenerate_k():
    s, mask = _rows(6, 12, seed=7)
    mask[3] = False  # an empty row
    s = s.masked_fill(~mask, 1e6).requires_grad_()  # huge scores at padding must be ignored
    n_real = mask.sum(-1)
    lam = solve_entropic_lp(s, 2.0, 0.01, mask)
    assert (lam[~mask] == 0).all()
    assert (lam[3] == 0).all()
    big = solve_entropic_lp(s, 12.0, 0.01, mask)  # k >= every row's real count
    assert torch.equal(big, mask.double())
    assert torch.equal(solve_entropic_lp(s, n_real.double(), 0.01, mask), mask.double())
    assert (solve_entropic_lp(s, 0.0, 0.01, mask) == 0).all()
    (lam.sum() + big.sum()).backward()
    assert s.grad.isfinite().all() and (s.grad[~mask] == 0).all()


def test_lp_half_precision_and_validation():
    s, mask = _rows(4, 16, seed=8, dtype=torch.float16)
    lam = solve_entropic_lp(s, 3.0, 0.002, mask)
    assert lam.dtype == torch.float16 and lam.isfinite().all()
    with pytest.raises(ValueError, match="eps"):
        solve_entropic_lp(s, 3.0, 0.0)


def test_unary_salience_modes():
    gen = torch.Generator().manual_seed(9)
    logits = torch.randn(5, 20, generator=gen, dtype=torch.float64)
    mask = torch.arange(20) < torch.tensor([20, 13, 7, 1, 10]).unsqueeze(1)
    logits = logits.masked_fill(~mask, 50.0)  # garbage at padding
    s = torch.relu(logits).masked_fill(~mask, 0)
    torch.testing.assert_close(unary_salience(logits, mask, 0.5, mode="relu"), s)
    torch.testing.assert_close(unary_salience(logits, mask, None, mode="lp"), s)
    hard = unary_salience(logits, mask, 0.4, mode="hard")
    lp = unary_salience(logits, mask, 0.4, eps=0.1, mode="lp")
    for r, length in enumerate(mask.sum(-1).tolist()):
        k = max(round(0.4 * length), 1)
        kept = reference.hard_topk(s[r, :length].tolist(), k)
        expected = torch.zeros(20, dtype=torch.float64)
        expected[kept] = s[r, kept]
        torch.testing.assert_close(hard[r], expected)
        lam = reference.lp_bisection(s[r, :length].tolist(), max(0.4 * length, 1.0), 0.1)
        torch.testing.assert_close(lp[r, :length], torch.tensor(lam, dtype=torch.float64) * s[r, :length])
    for u in (hard, lp):
        assert (u[~mask] == 0).all() and (u >= 0).all()


def test_unary_salience_is_differentiable_and_validates():
    logits = torch.randn(3, 10, dtype=torch.float64, requires_grad=True)
    mask = torch.ones(3, 10, dtype=torch.bool)
    unary_salience(logits, mask, 0.5).sum().backward()
    assert logits.grad.isfinite().all()
    with pytest.raises(ValueError, match="mode"):
        unary_salience(logits, mask, 0.5, mode="soft")
    with pytest.raises(ValueError, match="alpha"):
        unary_salience(logits, mask, 1.5)


@pytest.mark.parametrize("beta", [0.01, 0.25, 0.3, 0.5, 0.999])
def test_prune_mask_matches_reference(beta):
    gen = torch.Generator().manual_seed(10)
    sal = torch.rand(6, 20, generator=gen)
    sal[2, :] = 0.5  # all tied: earliest positions win
    mask = torch.arange(20) < torch.tensor([20, 10, 15, 1, 7, 0]).unsqueeze(1)
    sal = sal.masked_fill(~mask, 1e9)  # padded positions look most salient
    kept = prune_mask(sal, mask, beta)
    for r in range(6):
        assert kept[r].tolist() == reference.prune(sal[r].tolist(), mask[r].tolist(), beta)
        assert int(kept[r].sum()) == keep_count(int(mask[r].sum()), beta)
    assert not (kept & ~mask).any()


@pytest.mark.parametrize("beta,threshold", [(0.2, 0.9), (0.5, 0.5), (0.3, 0.99), (0.999, 0.7)])
def test_redundancy_aware_prune_mask_matches_reference(beta, threshold):
    gen = torch.Generator().manual_seed(11)
    vectors = torch.nn.functional.normalize(torch.randn(5, 16, 4, generator=gen), dim=-1)  # 4-d: many near pairs
    vectors[0, 5] = vectors[0, 2]  # exact duplicates
    sal = torch.rand(5, 16, generator=gen)
    sal[1, :] = 0.25  # all tied: the earlier token of a near pair is the more salient one
    mask = torch.arange(16) < torch.tensor([16, 12, 1, 9, 0]).unsqueeze(1)
    kept = prune_mask(sal, mask, beta, vectors, threshold)
    for r in range(5):
        assert kept[r].tolist() == reference.prune_redundant(sal[r].tolist(), mask[r].tolist(), vectors[r].tolist(),
                                                             beta, threshold)
        assert int(kept[r].sum()) == keep_count(int(mask[r].sum()), beta)
    flagged = redundant_tokens(sal, mask, vectors, threshold, chunk=2)  # chunking changes nothing
    assert torch.equal(flagged, redundant_tokens(sal, mask, vectors, threshold))
    assert flagged[0, 5] and not (flagged & ~mask).any()


def test_redundancy_keeps_distinct_tokens_first():
    base = torch.eye(4)
    vectors = base[[0, 0, 0, 1, 2, 3]].unsqueeze(0)  # three copies of one direction, then three distinct ones
    sal = torch.tensor([[0.9, 0.8, 0.7, 0.3, 0.2, 0.1]])
    mask = torch.ones(1, 6, dtype=torch.bool)
    assert prune_mask(sal, mask, 0.5).tolist() == [[True, True, True, False, False, False]]
    assert prune_mask(sal, mask, 0.5, vectors, 0.9).tolist() == [[True, False, False, True, True, False]]
    with pytest.raises(ValueError, match="vectors"):
        prune_mask(sal, mask, 0.5, None, 0.9)
    with pytest.raises(ValueError, match="threshold"):
        prune_mask(sal, mask, 0.5, vectors, 1.5)


def test_prune_mask_full_beta_and_validation():
    mask = torch.arange(8) < torch.tensor([8, 3]).unsqueeze(1)
    sal = torch.rand(2, 8)
    assert torch.equal(prune_mask(sal, mask, 1.0), mask)
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match="beta"):
            prune_mask(sal, mask, bad)


def test_keep_count():
    assert keep_count(10, 0.3) == 3  # 0.3·10 is 3.0000000000000004 in floats
    assert keep_count(10, 0.31) == 4
    assert keep_count(3, 0.01) == 1
    assert keep_count(0, 0.5) == 0
    assert keep_count(7, 1.0) == 7
    assert keep_count(256, 0.4) == math.ceil(256 * 0.4)
