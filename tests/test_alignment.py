"""Alignment scoring: MaxSim/top-k/top-p/DA against loop references, padding invariance, strategies."""
from __future__ import annotations

import math

import pytest
import torch

import reference
from pyserini_aligner import alignment
from pyserini_aligner.alignment import (
    Strategy,
    alignment_scores,
    alignment_scores_grouped,
    alignment_scores_many,
    alignment_scores_paired,
    alignment_weights,
    parse_strategy,
)

STRATEGIES = [parse_strategy(s) for s in ("top-k:1", "top-k:2", "top-k:4", "top-p:0.3", "top-p:0.75", "da:2:0.1",
                                           "da:1.5:0.02")]


def _batch(b: int, length: int, dim: int, gen: torch.Generator, dtype=torch.float64, min_len: int = 1):
    """L2-normalised vectors [b, length, dim], a padding mask with random lengths and saliences."""
    x = torch.nn.functional.normalize(torch.randn(b, length, dim, generator=gen, dtype=dtype), dim=-1)
    lens = torch.randint(min_len, length + 1, (b,), generator=gen)
    lens[0] = length  # one full row
    mask = torch.arange(length) < lens.unsqueeze(1)
    sal = torch.rand(b, length, generator=gen, dtype=dtype)
    return x, mask, sal


def _case(seed: int, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    q, qm, qs = _batch(3, 6, 8, gen, dtype)
    d, dm, ds = _batch(5, 11, 8, gen, dtype)
    return q, qm, qs, d, dm, ds


def _loop_scores(q, qm, d, dm, spec, qs=None, ds=None):
    st = parse_strategy(spec)
    out = torch.zeros(q.shape[0], d.shape[0], dtype=torch.float64)
    for a in range(q.shape[0]):
        for b in range(d.shape[0]):
            out[a, b] = reference.alignment_score(
                q[a].tolist(), qm[a].tolist(), d[b].tolist(), dm[b].tolist(), st.kind, st.k, st.p, st.eps,
                None if qs is None else qs[a].tolist(), None if ds is None else ds[b].tolist(),
            )
    return out


def test_topk1_is_maxsim_over_real_query_tokens():
    q, qm, _, d, dm, _ = _case(0, torch.float32)
    sim = torch.einsum("qnh,bmh->qbnm", q, d).masked_fill(~dm[None, :, None, :], -math.inf)
    maxsim = (sim.max(-1).values * qm[:, None, :]).sum(-1)
    expected = maxsim / qm.sum(-1, keepdim=True)
    torch.testing.assert_close(alignment_scores(q, qm, d, dm, parse_strategy("top-k:1")), expected)


@pytest.mark.parametrize("p", [0.05, 0.3, 0.5, 0.9, 1.0])
@pytest.mark.parametrize("with_sal", [False, True])
def test_topp_equals_topk_with_per_doc_k(p, with_sal):
    q, qm, qs, d, dm, ds = _case(1)
    qs, ds = (qs, ds) if with_sal else (None, None)
    got = alignment_scores(q, qm, d, dm, parse_strategy(f"top-p:{p}"), qs, ds)
    for b in range(d.shape[0]):
        k = max(math.floor(p * int(dm[b].sum())), 1)
        ds_b = None if ds is None else ds[b : b + 1]
        one = alignment_scores(q, qm, d[b : b + 1], dm[b : b + 1], parse_strategy(f"top-k:{k}"), qs, ds_b)
        torch.testing.assert_close(got[:, b : b + 1], one)


@pytest.mark.parametrize("spec", STRATEGIES, ids=str)
@pytest.mark.parametrize("with_sal", [False, True])
def test_matches_loop_reference(spec, with_sal):
    q, qm, qs, d, dm, ds = _case(2)
    qs, ds = (qs, ds) if with_sal else (None, None)
    got = alignment_scores(q, qm, d, dm, spec, qs, ds)
    torch.testing.assert_close(got, _loop_scores(q, qm, d, dm, spec, qs, ds), rtol=1e-9, atol=1e-9)
    paired = alignment_scores_paired(q, qm, d[:3], dm[:3], spec, qs, None if ds is None else ds[:3])
    torch.testing.assert_close(paired, got.diagonal()[:3], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("spec", STRATEGIES, ids=str)
@pytest.mark.parametrize("with_sal", [False, True])
def test_padding_garbage_never_changes_a_score(spec, with_sal):
    q, qm, qs, d, dm, ds = _case(3)
    qs, ds = (qs, ds) if with_sal else (None, None)
    before = alignment_scores(q, qm, d, dm, spec, qs, ds)
    gen = torch.Generator().manual_seed(7)

    def garble(x, mask, extra):
        pad_shape = (x.shape[0], extra) + tuple(x.shape[2:])
        x = torch.cat([x, torch.zeros(pad_shape, dtype=x.dtype)], dim=1)
        mask = torch.cat([mask, torch.zeros(x.shape[0], extra, dtype=torch.bool)], dim=1)
        noise = 1e3 * torch.randn(x.shape, generator=gen, dtype=x.dtype)
        noise.view(-1)[::7] = math.nan
        noise.view(-1)[3::11] = math.inf
        pad = ~mask if x.dim() == 2 else ~mask.unsqueeze(-1)
        return torch.where(pad, noise, x), mask

    q2, qm2 = garble(q, qm, 2)
    d2, dm2 = garble(d, dm, 5)
    qs2 = None if qs is None else garble(qs, qm, 2)[0]
    ds2 = None if ds is None else garble(ds, dm, 5)[0]
    after = alignment_scores(q2, qm2, d2, dm2, spec, qs2, ds2)
    torch.testing.assert_close(after, before, rtol=1e-12, atol=1e-12)
    paired = alignment_scores_paired(q2, qm2, d2[:3], dm2[:3], spec, qs2, None if ds2 is None else ds2[:3])
    torch.testing.assert_close(paired, before.diagonal()[:3], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("spec", STRATEGIES, ids=str)
@pytest.mark.parametrize("with_sal", [False, True])
def test_grouped_matches_loop_reference(spec, with_sal):
    q, qm, qs, d, dm, ds = _case(7)
    groups = torch.tensor([[4, 0, 2], [1, 1, 3], [0, 2, 4]])  # each query's own candidates (repeats allowed)
    got = alignment_scores_grouped(q, qm, d[groups], dm[groups], spec, qs if with_sal else None,
                                   ds[groups] if with_sal else None)
    full = _loop_scores(q, qm, d, dm, spec, qs if with_sal else None, ds if with_sal else None)
    assert got.shape == (3, 3)
    torch.testing.assert_close(got, full.gather(1, groups), atol=1e-9, rtol=1e-9)


@pytest.mark.parametrize("with_sal", [False, True])
@pytest.mark.parametrize("chunk", [None, 1])
def test_many_strategies_at_once_match_the_loop_reference_and_each_alone(with_sal, chunk, monkeypatch):
    """Every strategy from one product and one selection: the loop reference's scores, and in float32 the scores
    of scoring with each strategy alone (one document per chunk, or all at once)."""
    q, qm, qs, d, dm, ds = _case(9)
    qs, ds = (qs, ds) if with_sal else (None, None)
    if chunk is not None:
        monkeypatch.setattr(alignment, "_CHUNK_ELEMENTS", chunk)
    specs = STRATEGIES + [parse_strategy("top-k:40")]  # k past every document's length
    every = alignment_scores_many(q, qm, d, dm, specs, qs, ds)
    assert len(every) == len(specs)
    for spec, got in zip(specs, every):
        torch.testing.assert_close(got, _loop_scores(q, qm, d, dm, str(spec), qs, ds), rtol=1e-9, atol=1e-9)
    f32 = [x.float() for x in (q, d)] + [None if x is None else x.float() for x in (qs, ds)]
    every = alignment_scores_many(f32[0], qm, f32[1], dm, specs, f32[2], f32[3])
    for spec, got in zip(specs, every):
        torch.testing.assert_close(got, alignment_scores(f32[0], qm, f32[1], dm, spec, f32[2], f32[3]),
                                   rtol=2e-7, atol=2e-7)
    assert [x.shape for x in alignment_scores_many(q, qm, d[:0], dm[:0], specs)] == [(3, 0)] * len(specs)
    empty = alignment_scores_many(q, qm, d[:, :0], dm[:, :0], specs)  # documents without tokens score 0
    assert all(torch.equal(x, torch.zeros(3, 5, dtype=x.dtype)) for x in empty)
    assert torch.equal(alignment_scores(q, qm, d[:, :0], dm[:, :0], specs[0]), empty[0])


def test_grouped_rejects_mismatched_shapes():
    q, qm, _, d, dm, _ = _case(8)
    with pytest.raises(ValueError, match="grouped scoring needs d"):
        alignment_scores_grouped(q, qm, d, dm, parse_strategy("top-k:1"))


def test_chunked_scoring_matches_paired(monkeypatch):
    q, qm, qs, d, dm, ds = _case(4)
    whole = alignment_scores(q, qm, d, dm, parse_strategy("da:2:0.1"), qs, ds)
    monkeypatch.setattr(alignment, "_CHUNK_ELEMENTS", 1)  # one doc per chunk
    chunked = alignment_scores(q, qm, d, dm, parse_strategy("da:2:0.1"), qs, ds)
    torch.testing.assert_close(chunked, whole, rtol=1e-12, atol=1e-12)


def test_weights_rows_and_padding():
    q, qm, _, d, dm, _ = _case(5)
    sim = torch.einsum("qnh,bmh->qbnm", q, d)
    m_real = dm.sum(-1).double()
    for spec, row_sum in [
        ("top-k:4", torch.clamp(m_real, max=4)),
        ("top-p:0.5", torch.floor(m_real * 0.5).clamp_min(1)),
        ("da:3:0.05", torch.clamp(m_real, max=3)),
    ]:
        w = alignment_weights(sim, dm, parse_strategy(spec))
        assert w.shape == sim.shape
        assert (w[~dm[None, :, None, :].expand_as(w)] == 0).all()
        torch.testing.assert_close(w.sum(-1), row_sum[None, :, None].expand(3, -1, 6), rtol=1e-9, atol=1e-9)


def test_empty_doc_or_query_scores_zero():
    q, qm, qs, d, dm, ds = _case(6)
    dm[1] = False
    qm[2] = False
    for spec in STRATEGIES:
        s = alignment_scores(q, qm, d, dm, spec, qs, ds)
        assert (s[:, 1] == 0).all() and (s[2] == 0).all() and s.isfinite().all()
    zero_sal = torch.zeros_like(qs)
    assert (alignment_scores(q, qm, d, dm, parse_strategy("top-k:1"), zero_sal, ds) == 0).all()


def test_dtype_and_gradients():
    q, qm, qs, d, dm, ds = _case(7, torch.float32)
    assert alignment_scores(q, qm, d.half(), dm, parse_strategy("top-k:1")).dtype == torch.float32
    assert alignment_scores(q.double(), qm, d, dm, parse_strategy("top-p:0.2")).dtype == torch.float64
    for spec in map(parse_strategy, ["top-k:2", "da:2:0.05"]):
        qq, dd = q.clone().requires_grad_(), d.clone().requires_grad_()
        qsal, dsal = qs.clone().requires_grad_(), ds.clone().requires_grad_()
        alignment_scores(qq, qm, dd, dm, spec, qsal, dsal).sum().backward()
        for t in (qq, dd, qsal, dsal):
            assert t.grad is not None and t.grad.isfinite().all() and t.grad.abs().sum() > 0


def test_da_gradcheck():
    q, qm, qs, d, dm, ds = _case(8)
    q, d, qs, ds = (t[:2, :4].clone().requires_grad_() for t in (q, d, qs, ds))
    qm, dm = qm[:2, :4], dm[:2, :4]
    fn = lambda *a: alignment_scores(a[0], qm, a[1], dm, parse_strategy("da:2:0.3"), a[2], a[3])  # noqa: E731
    assert torch.autograd.gradcheck(fn, (q, d, qs, ds))


@pytest.mark.parametrize("spec", ["top-k:1", "top-k:16", "top-p:0.015", "top-p:1", "da:4:0.04", "da:2.5:0.002"])
def test_parse_strategy_round_trip(spec):
    st = parse_strategy(spec)
    assert str(st) == spec
    assert parse_strategy(str(st)) == st
    assert parse_strategy(st) is st


def test_strategy_fields():
    assert parse_strategy("top-k:1") == Strategy("top-k", k=1.0)
    assert parse_strategy(" top-p:0.015 ") == Strategy("top-p", p=0.015)
    assert parse_strategy("da:4:0.04") == Strategy("da", k=4.0, eps=0.04)


BAD_SPECS = ["top-k:0", "top-k:1.5", "top-p:2", "top-p:0", "foo", "da:4", "da:0:0.1", "da:4:0", "top-k:", "top-k:x"]
BAD_SPECS += ["top-p:nan", "da:4:0.1:7", "top-k:1:2"]


@pytest.mark.parametrize("spec", BAD_SPECS)
def test_parse_strategy_rejects_bad_specs(spec):
    with pytest.raises(ValueError, match="expected") as err:
        parse_strategy(spec)
    assert repr(spec) in str(err.value)
