"""The fused teacher of label-free adaptation: wordpiece BM25, z-score fusion, and the trainer's ``anchor: fusion``
against slow references, with the real MiniLM."""

import math

import pytest
import torch
import torch.nn.functional as F

from pyserini_aligner.alignment import alignment_scores
from pyserini_aligner.strategy import MAXSIM
from pyserini_aligner.train.teacher import WordpieceBM25, in_units_of, zscore_fusion
from pyserini_aligner.train.validate import pad_ids
from tests.test_train_offdomain import bundle_path  # noqa: F401  (fixture)
from tests.test_train import tiny_config


def bm25_reference(corpus, query, doc, skip, k1=0.9, b=0.4):
    """Lucene BM25 of one (query, doc) pair, term by term."""
    texts = [[t for t in row if t not in skip] for row in corpus]
    avgdl = sum(map(len, texts)) / len(texts)
    terms = [t for t in doc if t not in skip]
    score = 0.0
    for t in query:
        df = sum(t in row for row in texts)
        tf = terms.count(t)
        if t in skip or df == 0 or tf == 0:
            continue
        idf = math.log(1 + (len(texts) - df + 0.5) / (df + 0.5))
        score += idf * tf / (tf + k1 * (1 - b + b * len(terms) / avgdl))
    return score


def test_wordpiece_bm25_matches_the_formula():
    corpus = [[101, 5, 6, 7, 102], [101, 5, 5, 8, 9, 9, 9, 102], [101, 10, 102], [101, 6, 8, 11, 12, 13, 102]]
    queries = [[101, 5, 9, 102], [101, 6, 6, 14, 102], [101, 102], [101, 13, 5, 8, 102]]
    docs = corpus + [[101, 5, 14, 14, 102]]  # a doc outside the corpus (e.g. a positive with a span cut out)
    bm25 = WordpieceBM25(corpus, skip={101, 102})
    got = bm25.scores(queries, docs, chunk=3)
    assert got.shape == (4, 5)
    for i, q in enumerate(queries):
        for j, d in enumerate(docs):
            assert float(got[i, j]) == pytest.approx(bm25_reference(corpus, q, d, {101, 102}), abs=1e-5)
    assert float(got[2].abs().sum()) == 0.0 and float(got[1, 0]) > 0  # only special tokens / a repeated term
    torch.testing.assert_close(bm25.scores(queries, bm25.doc_weights(docs)), got)
    with pytest.raises(ValueError, match="non-empty"):
        WordpieceBM25([])


def test_zscore_fusion_and_units_match_loops():
    a = torch.tensor([[1.0, 2.0, 3.0, 9.0], [0.5, 0.5, 0.5, 0.5]])
    b = torch.tensor([[10.0, 0.0, 5.0, -1.0], [3.0, 1.0, 2.0, 0.0]])
    allowed = torch.tensor([[True, True, True, False], [True, True, True, True]])
    got = zscore_fusion([a, b], allowed)
    for r in range(2):
        keep = allowed[r]
        expected = torch.zeros(int(keep.sum()))
        for s in (a, b):
            x = s[r][keep]
            std = x.std(unbiased=False)
            expected += (x - x.mean()) / std if std > 0 else torch.zeros_like(x)
        torch.testing.assert_close(got[r][keep], expected / 2)
    assert float(got[0, 3]) == 0.0  # a column outside the pool
    ref = torch.tensor([[0.2, 0.4, 0.6, 7.0], [1.0, 2.0, 3.0, 4.0]])
    scaled = in_units_of(got, ref, allowed)
    for r in range(2):
        keep = allowed[r]
        x = ref[r][keep]
        torch.testing.assert_close(scaled[r][keep], got[r][keep] * x.std(unbiased=False) + x.mean())
    with pytest.raises(ValueError, match="at least one"):
        zscore_fusion([])


def test_fusion_anchor_fuses_the_model_the_untrained_backbone_and_bm25(bundle_path, tmp_path):  # noqa: F811
    from pyserini_aligner.train.loop import Trainer

    with pytest.raises(ValueError, match="'contrastive_weight'"):
        tiny_config(bundle_path, contrastive_weight=0.0)  # and no anchor: nothing to train
    cfg = tiny_config(bundle_path, anchor="fusion", anchor_weight=1.0, contrastive_weight=0.0, lr_backbone=1e-3,
                      warmup_ratio=0.0)
    trainer = Trainer(cfg, tmp_path / "f", device="cpu", progress=False)
    with torch.no_grad():  # the starting model's backbone differs from the untrained one the teacher also uses
        trainer.teacher.backbone.encoder.layer[-1].output.dense.weight.mul_(1.5)
    batch = trainer.sampler.batch([0, 1, 2], 0, 0)
    corpus = trainer.corpus_ids[batch.corpus]
    q_ids = [trainer.query_ids[i] for i in batch.queries]
    d_ids = [corpus[r] for r in batch.doc_rows]
    q_in, d_in = pad_ids(q_ids, trainer.model.pad_id, trainer.device), pad_ids(d_ids, trainer.model.pad_id,
                                                                                trainer.device)
    allowed = torch.tensor(batch.allowed)
    teacher = trainer.teacher
    with torch.no_grad():
        q, d = teacher(*q_in, is_query=True), teacher(*d_in, is_query=False)
        own = alignment_scores(q.vectors, q.mask, d.vectors, d.mask, MAXSIM, q.salience, d.salience)
        from transformers import AutoModel

        raw_model = AutoModel.from_pretrained(teacher.backbone_source).eval()
        raw = torch.zeros(len(q_ids), len(d_ids))
        states = [F.normalize(raw_model(input_ids=ids, attention_mask=att).last_hidden_state, dim=-1)
                  for ids, att in (q_in, d_in)]
        for i, qi in enumerate(q_ids):  # MaxSim by loops over real tokens
            for j, dj in enumerate(d_ids):
                sim = states[0][i, :len(qi)] @ states[1][j, :len(dj)].T
                raw[i, j] = sim.max(1).values.mean()
    skip = set(teacher.special_ids.tolist())
    lexical = torch.tensor([[bm25_reference(corpus, qi, dj, skip) for dj in d_ids] for qi in q_ids])
    expected = in_units_of(zscore_fusion([own, raw, lexical], allowed), own, allowed)
    got = trainer.teacher_scores(q_in, d_in, trainer.strategy, (batch.corpus, q_ids, d_ids), allowed)
    torch.testing.assert_close(got[allowed], expected[allowed], atol=1e-4, rtol=1e-4)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    stats = trainer.train_step(batch)
    assert stats["anchor"] > 0 and stats["loss"] == pytest.approx(stats["anchor"], rel=1e-5)  # no cross-entropy
    assert any(not torch.equal(p, before[n]) for n, p in trainer.model.named_parameters() if n in before)
