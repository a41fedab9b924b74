"""The projection fitted to keep the backbone's MaxSim ranking: numerics against loops, a synthetic case PCA gets
wrong, and the Trainer's use of it with the real MiniLM."""

import math

import pytest
import torch
import torch.nn.functional as F

from pyserini_aligner.train.config import TrainConfig
from pyserini_aligner.train.loop import Trainer
from pyserini_aligner.train.projection import (FitGroup, States, fit_projection, held_out_kl, maxsim, nearest,
                                               ranking_kl)
from tests.test_train import bundle_path, tiny_config  # noqa: F401  (fixture)


def _states(vectors: torch.Tensor, lengths: list[int]) -> States:
    mask = torch.arange(vectors.shape[1]).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)
    return States(F.normalize(vectors, dim=-1) * mask.unsqueeze(-1), mask)


def test_maxsim_and_ranking_kl_match_loops():
    gen = torch.Generator().manual_seed(0)
    q = _states(torch.randn(3, 4, 6, generator=gen), [4, 2, 3])
    d = _states(torch.randn(5, 7, 6, generator=gen), [7, 1, 5, 3, 6])
    w = torch.randn(2, 6, generator=gen)
    for weight in (None, w):
        got = maxsim(q, d, weight)
        for i in range(3):
            for j in range(5):
                qi = [q.vectors[i, t] for t in range(4) if q.mask[i, t]]
                dj = [d.vectors[j, t] for t in range(7) if d.mask[j, t]]
                if weight is not None:
                    qi = [F.normalize(weight @ v, dim=0) for v in qi]
                    dj = [F.normalize(weight @ v, dim=0) for v in dj]
                expected = sum(max(float(a @ b) for b in dj) for a in qi) / len(qi)
                assert float(got[i, j]) == pytest.approx(expected, abs=1e-5)
    student, teacher = torch.randn(3, 5, generator=gen), torch.randn(3, 5, generator=gen)
    expected = 0.0
    for i in range(3):
        p = [math.exp(v / 0.5) for v in teacher[i].tolist()]
        s = [math.exp(v / 0.5) for v in student[i].tolist()]
        expected += sum(pk / sum(p) * math.log((pk / sum(p)) / (sk / sum(s))) for pk, sk in zip(p, s)) / 3
    assert float(ranking_kl(student, teacher, 0.5)) == pytest.approx(expected, abs=1e-5)
    top = nearest(FitGroup(q, d), 2)
    assert top.tolist() == maxsim(q, d).topk(2, dim=-1).indices.tolist()


def _topic_states(n: int, length: int, topics: torch.Tensor, side: int, gen: torch.Generator) -> States:
    """Tokens of 9 dims: unit-variance noise in dims 0-2 (docs, side 0) or 3-5 (queries, side 1), which never
    meets the other side, and the text's topic (variance 1/3 per dim) in dims 6-8."""
    tokens = torch.zeros(n, length, 9)
    tokens[..., 3 * side:3 * side + 3] = torch.randn(n, length, 3, generator=gen)
    tokens[..., 6:] = topics.unsqueeze(1) + 0.1 * torch.randn(n, length, 3, generator=gen)
    return _states(tokens, [length] * n)


def test_fit_keeps_the_ranking_that_the_largest_variance_directions_lose():
    gen = torch.Generator().manual_seed(1)
    doc_topics = F.normalize(torch.randn(80, 3, generator=gen), dim=-1)
    docs = _topic_states(80, 6, doc_topics, 0, gen)
    targets = torch.randint(0, 80, (120,), generator=gen)
    queries = _topic_states(120, 3, doc_topics[targets], 1, gen)
    train, held = States(queries.vectors[:60], queries.mask[:60]), States(queries.vectors[60:], queries.mask[60:])
    flat = docs.vectors[docs.mask]
    pca = torch.linalg.eigh(flat.T @ flat).eigenvectors[:, -3:].T.contiguous()  # [3, 9]: the docs' noise
    fitted, losses = fit_projection(pca, [FitGroup(train, docs)], steps=150, batch=16, hard=8, candidates=40,
                                    lr=0.05, temperature=0.05, seed=0)
    assert len(losses) == 150 and fitted.shape == pca.shape

    def held_kl(weight):
        return float(ranking_kl(maxsim(held, docs, weight), maxsim(held, docs), 0.05))

    groups = [FitGroup(States(held.vectors[:20], held.mask[:20]), docs),
              FitGroup(States(held.vectors[20:], held.mask[20:]), docs)]
    both = held_out_kl(groups, {"pca": pca, "fitted": fitted}, 0.05)  # query-weighted mean over the groups
    assert both == pytest.approx({"pca": held_kl(pca), "fitted": held_kl(fitted)}, rel=1e-5)

    def top1(weight):  # how often the projected MaxSim ranks the query's own doc first
        return float((maxsim(held, docs, weight).argmax(-1) == targets[60:]).float().mean())

    assert held_kl(fitted) < 0.5 * held_kl(pca)
    assert top1(fitted) > top1(pca) + 0.3


def test_trainer_keeps_the_fit_only_where_it_ranks_held_out_queries_better(bundle_path, tmp_path):  # noqa: F811
    runs = {}
    for dim in (4, 128):  # 128 dims hold every token of the tiny corpus: PCA is already exact there
        pca = Trainer(tiny_config(bundle_path, dim=dim, projection_init="pca"), tmp_path / f"p{dim}", device="cpu",
                      progress=False)
        fit = Trainer(tiny_config(bundle_path, dim=dim, projection_init="maxsim", projection_fit_steps=40),
                      tmp_path / f"m{dim}", device="cpu", progress=False)
        assert fit.projection_fit["steps"] == 40 and fit.projection_fit["held_out_queries"] == 1
        assert pca.projection_fit == {}
        runs[dim] = (pca, fit)
    pca, fit = runs[4]
    assert fit.projection_fit["kl_fitted"] < fit.projection_fit["kl_pca"] and fit.projection_fit["kept"] == "fitted"
    assert not torch.allclose(fit.model.projection.weight, pca.model.projection.weight)
    pca, fit = runs[128]
    assert fit.projection_fit["kl_fitted"] >= fit.projection_fit["kl_pca"] - 1e-6  # no real gain: PCA is kept
    assert fit.projection_fit["kept"] == "pca"
    assert torch.equal(fit.model.projection.weight, pca.model.projection.weight)
    with pytest.raises(ValueError, match="'projection_fit_steps'"):
        TrainConfig.from_dict({"projection_fit_steps": -1})
